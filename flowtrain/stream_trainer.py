"""Old import path, kept working: this module is ``flowtrain.train.stream``."""
import sys

from flowtrain.train import stream as _module

sys.modules[__name__] = _module

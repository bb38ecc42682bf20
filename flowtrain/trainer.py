"""Old import path, kept working: this module is ``flowtrain.train.loop``."""
import sys

from flowtrain.train import loop as _module

sys.modules[__name__] = _module

"""Old import path, kept working: this module is ``flowtrain.train.loader``."""
import sys

from flowtrain.train import loader as _module

sys.modules[__name__] = _module

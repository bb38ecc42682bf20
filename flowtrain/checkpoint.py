"""Old import path, kept working: this module is ``flowtrain.train.checkpoint``."""
import sys

from flowtrain.train import checkpoint as _module

sys.modules[__name__] = _module

"""Old import path, kept working: this module is ``flowtrain.train.model``."""
import sys

from flowtrain.train import model as _module

sys.modules[__name__] = _module

"""Old import path, kept working: this module is ``flowtrain.train.metrics``."""
import sys

from flowtrain.train import metrics as _module

sys.modules[__name__] = _module

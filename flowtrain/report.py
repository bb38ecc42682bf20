"""Old import path, kept working: this module is ``flowtrain.train.report``."""
import sys

from flowtrain.train import report as _module

sys.modules[__name__] = _module

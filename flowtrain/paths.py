"""Old import path, kept working: this module is ``flowtrain.local.paths``."""
import sys

from flowtrain.local import paths as _module

sys.modules[__name__] = _module

"""Old import path, kept working: this module is ``flowtrain.local.runners``."""
import sys

from flowtrain.local import runners as _module

sys.modules[__name__] = _module

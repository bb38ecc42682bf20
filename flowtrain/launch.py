"""Old import path, kept working: this module is ``flowtrain.parallel.launch``."""
import sys

from flowtrain.parallel import launch as _module

sys.modules[__name__] = _module

"""Old import path, kept working: this module is ``flowtrain.parallel.schedules``."""
import sys

from flowtrain.parallel import schedules as _module

sys.modules[__name__] = _module

"""Old import path, kept working: this module is ``flowtrain.parallel.stages``."""
import sys

from flowtrain.parallel import stages as _module

sys.modules[__name__] = _module

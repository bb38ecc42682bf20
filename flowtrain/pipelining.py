"""Old import path, kept working: this module is ``flowtrain.parallel.pipeline``."""
import sys

from flowtrain.parallel import pipeline as _module

sys.modules[__name__] = _module

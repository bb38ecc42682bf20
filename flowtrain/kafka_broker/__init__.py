"""Old import path, kept working: this module is ``flowtrain.local.kafka``."""
import sys

from flowtrain.local import kafka as _module

sys.modules[__name__] = _module

"""Old import path, kept working: this module is ``flowtrain.local.kafka.broker``."""
import sys

from flowtrain.local.kafka import broker as _module

sys.modules[__name__] = _module

"""Old import path, kept working: this module is ``flowtrain.cli.batch``."""
import sys

from flowtrain.cli import batch as _module

sys.modules[__name__] = _module

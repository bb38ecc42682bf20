"""Old import path, kept working: this module is ``flowtrain.cli.stream``."""
import sys

from flowtrain.cli import stream as _module

sys.modules[__name__] = _module

"""Old import path, kept working: this module is ``flowtrain.cli.bench``."""
import sys

from flowtrain.cli import bench as _module

sys.modules[__name__] = _module

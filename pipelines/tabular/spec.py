"""Old import path, kept working: the dataset contract lives in ``connectors.dataset_spec``."""
import sys

from connectors import dataset_spec as _module

sys.modules[__name__] = _module

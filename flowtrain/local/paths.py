"""Where flowtrain keeps what it downloads or builds: outside the repository's tracked files.

One cache root (``$FLOWTRAIN_CACHE``, default ``~/.cache/flowtrain``) holds the Kafka broker
jars, the Prism binary, the default broker data directory and the dataset presets' demo inputs
(``pipelines.presets``: each under a folder of its own), so a second clone on the same
machine reuses them instead of fetching them again.
"""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    root = os.environ.get("FLOWTRAIN_CACHE") or os.path.join(Path.home(), ".cache", "flowtrain")
    path = Path(root).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path

"""Per-instance JSON status files of the streaming pipelines (feature pipeline, scorer).

Each DoFn instance writes its own file, ``{prefix}.{pid}-{id}`` or, with a kind,
``{prefix}.{kind}.{pid}-{id}`` (instances run in parallel threads and processes), by writing
``{path}.tmp`` and renaming it over ``path``, so a reader sees a whole file or the previous one.
Readers sum the files; :func:`clear_status` removes an earlier run's before a run starts.
"""
from __future__ import annotations

import glob
import json
import os
import time


def _pattern(prefix: str, kind: str | None) -> str:
    return glob.escape(f"{prefix}.{kind}" if kind else prefix) + ".*"


def write_status(prefix: str | None, owner: object, status: dict, kind: str | None = None) -> None:
    """Write ``status`` plus ``"time"`` (epoch seconds) as the status file of ``owner``
    (a DoFn instance); a no-op when ``prefix`` is empty (status files off)."""
    if not prefix:
        return
    path = f"{prefix}.{kind}.{os.getpid()}-{id(owner)}" if kind else f"{prefix}.{os.getpid()}-{id(owner)}"
    text = json.dumps({**status, "time": time.time()})  # one string, one write (json.dump writes in pieces)
    with open(f"{path}.tmp", "w") as fh:
        fh.write(text)
    os.replace(f"{path}.tmp", path)


def read_status(prefix: str, kind: str | None = None) -> list[dict]:
    """The status files under ``prefix`` (only those of ``kind`` when given; with no kind, every
    file under the prefix), in file-name order. ``.tmp`` files and files that vanished or cannot
    be parsed (a writer's partial file) are skipped."""
    found = []
    for path in sorted(glob.glob(_pattern(prefix, kind))):
        if path.endswith(".tmp"):
            continue
        try:
            with open(path) as fh:
                data = json.load(fh)
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            found.append(data)
    return found


def clear_status(prefix: str, kind: str | None = None) -> None:
    """Remove the status files (and leftover ``.tmp`` files) of an earlier run under ``prefix``."""
    for path in glob.glob(_pattern(prefix, kind)):
        try:
            os.remove(path)
        except FileNotFoundError:
            pass

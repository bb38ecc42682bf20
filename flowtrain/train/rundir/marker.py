"""The run marker ``run.json`` of a run directory (``flowtrain.train.rundir``): its format, reading it (a damaged
one is a ``RunDirError``), writing it atomically, and the run id it records.
"""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from connectors.atomic import atomic_write
from flowtrain.errors import FlowtrainError

__all__ = ["FORMAT", "RUN_MARKER", "RunDirError", "read_marker", "run_id_of", "running", "write_marker"]

RUN_MARKER = "run.json"
FORMAT = "flowtrain.run/1"


class RunDirError(FlowtrainError):
    """``--out`` cannot be used as asked; the message names the directory and what to do."""


def running(marker: dict) -> dict:
    """``marker`` with this process as the one running it (``pid``, ``host``)."""
    marker.update(pid=os.getpid(), host=socket.gethostname())
    return marker


def read_marker(path: str | Path) -> dict | None:
    """The run marker of directory ``path``, or None when it has none; a damaged one is a ``RunDirError``."""
    marker = Path(path) / RUN_MARKER
    if not marker.exists():
        return None
    try:
        data = json.loads(marker.read_text())
    except (OSError, ValueError) as err:
        raise RunDirError(f"{marker} cannot be read ({err}); it is not a flowtrain run marker") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not data.get("run_id"):
        raise RunDirError(f"{marker} is not a flowtrain run marker (format {FORMAT})")
    return data


def run_id_of(path: str | Path | None) -> str | None:
    """The run id recorded in ``path/run.json`` (None: no marker, e.g. a run dir given to ``fit`` by hand)."""
    if path is None:
        return None
    marker = read_marker(path)
    return marker["run_id"] if marker else None


def write_marker(path: Path, marker: dict) -> None:
    """Write ``marker`` as ``path/run.json`` (atomically), stamped ``updated`` now."""
    marker["updated"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    atomic_write(path / RUN_MARKER, json.dumps(marker, indent=2, default=str))

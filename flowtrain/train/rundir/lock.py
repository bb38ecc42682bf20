"""One run at a time in a run directory (``flowtrain.train.rundir``): an exclusive ``fcntl.flock`` on the
directory itself (no lock file is left in it), held until ``release`` or until the process ends; a second run
of the directory meanwhile is a ``RunDirError`` naming the running run's pid (from its ``run.json``).
"""
from __future__ import annotations

import fcntl
import os
import sys
import time
from pathlib import Path

from flowtrain.train.rundir.marker import RUN_MARKER, RunDirError, read_marker

__all__ = ["held", "holder", "lock", "lockable", "release"]

#: The run directories this process holds locked: path -> the open directory's file descriptor.
_HELD: dict[Path, int] = {}
#: Seconds a run that finds the directory locked waits for the holder's pid to appear in its run.json (the
#: holder writes it right after it locks: milliseconds, but seconds on a loaded machine; 2 s was seen short).
_PID_WAIT_S = 10.0


def holder(path: Path) -> str:
    """``pid N on host H`` of the run holding ``path`` (from its run.json), as soon as the holder wrote it."""
    deadline = time.monotonic() + _PID_WAIT_S
    while True:
        try:
            marker = read_marker(path)
        except RunDirError:
            marker = None
        if marker and marker.get("pid"):
            return f"pid {marker['pid']} on host {marker.get('host', '?')}, {marker.get('command', 'a')} run " \
                   f"{marker.get('run_id')}"
        if time.monotonic() >= deadline:
            return "pid not recorded yet"
        time.sleep(0.05)


def lock(path: Path) -> None:
    """Hold ``path`` (an existing directory) for this run: an exclusive ``flock`` on the directory, kept until
    ``release(path)`` or the process ends. Another run holding it is a ``RunDirError`` naming its pid. A lock
    this process already holds (an earlier run here that ended without ``mark_complete``) is taken over."""
    old = _HELD.pop(path, None)
    if old is not None:
        os.close(old)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunDirError(f"--out {path} is in use by another flowtrain run ({holder(path)}); two runs never share "
                          f"a run directory: wait for it to end (or stop it), or choose another --out") from None
    except OSError as err:  # a filesystem without locks (NFS without lockd, some FUSE mounts): run, and say so
        os.close(fd)
        print(f"warning: --out {path}: its filesystem does not lock ({err.strerror}); two runs started into it "
              f"at once are not kept apart", file=sys.stderr, flush=True)
        return
    except BaseException:
        os.close(fd)
        raise
    _HELD[path] = fd


def held(path: Path) -> bool:
    """Whether this process holds the lock of ``path`` (so no other process runs it: a run that the marker says
    is running there has ended, on this host, without recording its end)."""
    return path in _HELD


def release(path: str | Path) -> None:
    """Let go of the lock this process holds on run directory ``path`` (nothing when it holds none)."""
    fd = _HELD.pop(Path(os.path.abspath(path)), None)
    if fd is None:
        fd = _HELD.pop(Path(path).resolve(), None)
    if fd is not None:
        os.close(fd)


def lockable(path: Path, resume: bool) -> bool:
    """Whether a run may lock ``path``: new or empty (unless to resume), or holding a run marker."""
    entries = any(path.iterdir()) if path.is_dir() else False
    return (not resume) if not entries else (path / RUN_MARKER).exists()

"""Run-directory lock edges found by review: mark_failed lets go of the lock whatever the marker says, and a
filesystem that cannot lock runs with one warning line instead of a traceback."""
from __future__ import annotations

import errno
import fcntl
import os

from flowtrain.train.rundir import lock as rundir_lock
from flowtrain.train.rundir.rules import mark_failed, prepare_run_dir

OPTIONS = {"epochs": 1, "input": ["x.csv"], "label": "y"}


def _free(path) -> bool:
    """Whether another open of ``path`` can take the lock now (flock conflicts between two opens, one process)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_mark_failed_of_another_runs_marker_still_releases_this_processes_lock(tmp_path):
    out = tmp_path / "run"
    prepare_run_dir(out, OPTIONS)
    assert not _free(out)
    mark_failed(out, "not-this-run", RuntimeError("boom"))  # the marker names another run: left as it is
    assert _free(out)


def test_a_filesystem_without_locks_runs_with_one_warning_line(tmp_path, monkeypatch, capsys):
    def no_locks(fd, op):  # NFS without lockd, some FUSE mounts
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(rundir_lock.fcntl, "flock", no_locks)
    out = tmp_path / "run"
    run = prepare_run_dir(out, OPTIONS)
    assert run.run_id
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not lock" in err[0] and str(out) in err[0]

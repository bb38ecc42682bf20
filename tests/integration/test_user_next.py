"""Issue 45, what a user hits next, through the real command line and the real Beam pipelines.

Item 11: a job started in a script's background (SIGINT inherited as ignored) still stops on SIGINT."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pytest

from tests.procs import stop_group

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "flowtrain.cli"]


def _ignore_sigint() -> None:  # what `flowtrain batch ... &` in a script gets: SIGINT ignored, inherited
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_item11_a_batch_job_with_sigint_inherited_as_ignored_still_stops_on_sigint(tmp_path):
    r = np.random.default_rng(0)
    x = r.normal(size=400)
    pacsv.write_csv(pa.table({"x": x, "y": (x > 0).astype(np.int64)}), tmp_path / "t.csv")
    log = tmp_path / "out.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen([*CLI, "batch", "--input", str(tmp_path / "t.csv"), "--label", "y", "--numeric", "x",
                                 "--steps", "1000000", "--no-progress", "--threads", "1", "--out",
                                 str(tmp_path / "run")], cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=_ignore_sigint)
    try:
        deadline = time.monotonic() + 120
        while "model: step 0" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None and "model: step 0" in log.read_text(), log.read_text()[-3000:]
        proc.send_signal(signal.SIGINT)  # the process itself, as `kill -INT PID` does
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            raise AssertionError("flowtrain batch did not stop within 60 s of SIGINT (inherited as ignored)") from None
        assert proc.returncode != 0
        marker = json.loads((tmp_path / "run" / "run.json").read_text())
        assert marker["status"] == "failed", marker
    finally:
        stop_group(proc, signal.SIGKILL, timeout=10)

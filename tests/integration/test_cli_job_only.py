"""``flowtrain batch --job-only``: the ETL and job.json, the worker entry point run as torchrun would run it on a
node (a real process), then the printed report step. Moved here from tests/unit/test_cli_options.py (the fast
lane: it starts a worker process; the multihost lane runs the same job under torchrun across hosts)."""
from __future__ import annotations

import fcntl
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from flowtrain.cli.main import main

ROOT = Path(__file__).resolve().parents[2]  # the repository


@pytest.fixture(scope="module")
def synthetic(shared_data) -> str:
    return shared_data.regression_dataset(rows=1200)


def _batch(dataset: str, out: Path, *extra: str) -> list[str]:
    return ["batch", "--dataset", dataset, "--out", str(out), "--no-progress", "--dropout", "0", "--patience", "10",
            "--batch-size", "128", "--threads", "1", *extra]


def test_job_only_runs_through_the_worker_entry_point_then_the_printed_report_step(synthetic, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(_batch(synthetic, run, "--job-only", "--workers", "2", "--epochs", "2", "--hidden", "16,8")) == 0
    printed = capsys.readouterr().out
    # --job-only let go of its run directory: the report step may come from another process (a Python session
    # that ran --job-only does not block it); flock conflicts between two opens of the directory, even in one process
    fd = os.open(run, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    job = json.loads((run / "job.json").read_text())
    assert job["config"]["epochs"] == 2 and job["config"]["hidden"] == [16, 8] and job["failure_timeout_s"] == 60
    torchrun = next(line for line in printed.splitlines() if "torchrun" in line).split()
    module, target, job_path = torchrun[torchrun.index("-m") + 1:]
    assert job_path == str(run / "job.json")
    # one node of one: what torchrun would run on each node
    env = dict(os.environ, PYTHONPATH=str(ROOT), WORLD_SIZE="1", RANK="0", FLOWTRAIN_THREADS="1")
    worker = subprocess.run([sys.executable, "-m", module, target, job_path], capture_output=True, text=True,
                            timeout=240, env=env)
    assert worker.returncode == 0, worker.stderr[-3000:]
    trained = json.loads((run / "fit.json").read_text())
    report = next(line for line in printed.splitlines() if "then the report:" in line)
    argv = shlex.split(report.split("then the report:", 1)[1])
    assert argv[0] == "flowtrain"
    assert main(argv[1:] + ["--no-progress"]) == 0
    assert (run / "report.md").exists()
    assert json.loads((run / "fit.json").read_text())["steps"] == trained["steps"]  # the report trained nothing more

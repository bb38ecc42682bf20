"""``--worker-memory`` enforced on each spawned worker (#31 item 5; ``flowtrain.parallel.memcap``).

On this machine (cgroup v1, no delegation) the mechanism is RLIMIT_AS with a calibrated allowance; where
cgroup v2 delegates the memory controller it is memory.max. Either way a worker over its cap ends the job
with one line naming the cap, not a SIGKILL or a MemoryError traceback.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from flowtrain.parallel import memcap
from flowtrain.parallel.launch import WorkerFailure, spawn

ROOT = Path(__file__).resolve().parents[2]
ENV = {"PYTHONPATH": str(ROOT)}
GIB = 2**30
pytestmark = pytest.mark.timeout(240)


def _spawn(tmp_path, job: dict, cap: int, workers: int = 2) -> None:
    spawn(workers, "tests.memcap_jobs:allocate_job", job, failure_timeout_s=60, workdir=tmp_path / "w",
          extra_env=ENV, threads_per_worker=1, memory_cap=cap)


def test_worker_memory_a_worker_over_its_cap_ends_the_job_with_one_line(tmp_path):
    with pytest.raises(WorkerFailure) as failed:
        _spawn(tmp_path, {"mib": 3072, "rank": 1}, cap=int(1.5 * GIB))
    err = failed.value
    assert err.rank == 1 and "\n" not in str(err), str(err)
    assert str(err).startswith("worker rank 1 exceeded its memory cap, --worker-memory 1.50 GiB enforced by ")
    assert memcap.mechanism() in str(err)
    assert "Traceback" not in str(err) and "SIGKILL" not in str(err)


def test_worker_memory_a_worker_under_its_cap_runs_and_names_the_mechanism(tmp_path, capfd):
    _spawn(tmp_path, {"mib": 256}, cap=int(1.5 * GIB))
    out = capfd.readouterr()
    assert f"worker memory: --worker-memory 1.50 GiB enforced by {memcap.mechanism()}" in out.out + out.err
    assert memcap.read_cap(tmp_path / "w" / "heartbeats", 1).bytes == int(1.5 * GIB)


def test_worker_memory_below_a_workers_fixed_overhead_is_one_line(tmp_path):
    with pytest.raises(WorkerFailure) as failed:
        _spawn(tmp_path, {"mib": 1}, cap=64 * 2**20, workers=1)
    assert "\n" not in str(failed.value)
    assert "--worker-memory 0.06 GiB is below this worker's fixed overhead" in str(failed.value)

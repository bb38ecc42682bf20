"""The launcher blames the cause: a stopped worker, not its peer blocked in a collective."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from flowtrain.parallel.launch import WorkerFailure, spawn

ROOT = Path(__file__).resolve().parents[2]  # the repository


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1][:3]


@pytest.mark.timeout(120)
def test_a_stopped_worker_is_blamed_not_its_peer_waiting_in_a_collective(tmp_path):
    """Rank 1 is SIGSTOPped; rank 0 then waits in an all-reduce and stops heartbeating too (its
    last heartbeat is the older one: it beats every 2 s, rank 1 every 0.1 s)."""
    pids = tmp_path / "pids"
    pids.mkdir()
    beats = tmp_path / "w" / "heartbeats"
    stopped: dict[str, int] = {}

    def stop_rank_1() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not ((pids / "rank-1.pid").exists() and (beats / "rank-0.beat").exists()
                                                   and (beats / "rank-1.beat").exists()):
            time.sleep(0.05)
        time.sleep(2.5)
        stopped["pid"] = int((pids / "rank-1.pid").read_text())
        os.kill(stopped["pid"], signal.SIGSTOP)

    thread = threading.Thread(target=stop_rank_1, daemon=True)
    thread.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(WorkerFailure) as failure:
            spawn(2, "tests.launch_jobs:collective_loop_job",
                  {"pids": str(pids), "seconds": 90, "beat_every": [2.0, 0.1]}, failure_timeout_s=15,
                  workdir=tmp_path / "w", extra_env={"PYTHONPATH": str(ROOT)})
    finally:
        thread.join(timeout=70)
        for path in pids.glob("rank-*.pid"):
            pid = int(path.read_text())
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert failure.value.rank == 1, str(failure.value)
    assert "was stopped (process state T" in str(failure.value)
    assert time.monotonic() - t0 < 90
    time.sleep(0.5)
    assert not [p for p in pids.glob("rank-*.pid") if _alive(int(p.read_text()))], "a worker was left behind"

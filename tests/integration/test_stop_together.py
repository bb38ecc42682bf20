"""Issue 44 item 11 (and #49 item 7): replicas leave together, and workers never outlive their launcher.

* The stream trainer's checkpoint starts with the dead-letter topic's end, which rank 0 asks Kafka for while the
  other ranks went on into the checkpoint's gathers: a stop on rank 0 while Kafka did not answer left them
  waiting in a collective rank 0 never reached (a ZeRO engine's or a grid's, until a timeout or for ever). Now
  every replica waits with rank 0, a round at a time, heartbeating, and all leave at the same round.
* A launcher killed by SIGKILL left its workers running: their parent-death signal was SIGTERM, which a stream
  trainer's worker takes as "stop after a last checkpoint" (written after its launcher was gone). Now SIGKILL.

Real launcher, real worker entry point, gloo on 127.0.0.1; Kafka is a closed port (brokers that do not answer).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.timeout(240)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("stop_rank", [0, pytest.param(1, marks=pytest.mark.slow)])  # the same path: rank 0's in make test
def test_item11_a_stop_while_rank0_waits_for_kafka_makes_every_rank_leave_together(tmp_path, stop_rank):
    from flowtrain.parallel.launch import spawn

    job = {"bootstrap": f"127.0.0.1:{_closed_port()}", "stop_after": 2.0, "stop_rank": stop_rank,
           "out": str(tmp_path)}
    t0 = time.monotonic()
    spawn(2, "tests.stop_together_jobs:wait_for_kafka_job", job, failure_timeout_s=30, threads_per_worker=1)
    took = time.monotonic() - t0
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert all(r["how"].startswith("stopped: ") for r in ranks), ranks
    assert abs(ranks[0]["left_s"] - ranks[1]["left_s"]) < 5.0 and max(r["left_s"] for r in ranks) < 20, ranks
    assert took < 60, took


def test_item11_workers_die_with_a_launcher_killed_by_sigkill_and_write_nothing_after(tmp_path):
    launcher = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys
        from flowtrain.parallel.launch import spawn
        spawn(2, "tests.stop_together_jobs:outlive_job", {"out": sys.argv[1]}, failure_timeout_s=60,
              threads_per_worker=1)
    """), str(tmp_path)], start_new_session=True, cwd=os.getcwd())
    pids = []
    try:
        deadline = time.monotonic() + 120
        while len(pids) < 2:
            assert launcher.poll() is None and time.monotonic() < deadline
            pids = [int(p.read_text()) for p in tmp_path.glob("rank-*.pid") if p.read_text()]
            time.sleep(0.2)
        os.killpg(launcher.pid, signal.SIGKILL)  # the launcher's own group only: its workers are in theirs
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in pids), "a worker outlived its launcher"
        time.sleep(1.0)
        assert not list(tmp_path.glob("checkpoint-rank-*")), "a worker wrote after its launcher was gone"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(timeout=10)
        for pid in pids:  # only what is still one of this test's workers
            if _alive(pid) and "flowtrain.parallel.worker" in open(f"/proc/{pid}/cmdline").read():
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False

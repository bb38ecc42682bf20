"""Process safety (issue #22 items 4, 5, 7): a recorded pid is never trusted blindly, workers end
with the `flowtrain batch` that started them whatever signal ends it, and a `--workers 2` job
listens on 127.0.0.1 only."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flowtrain.local.kafka import LocalKafka
from flowtrain.local.processes import identity, same_process
from flowtrain.local.tools import free_port
from tests.procs import descendants, is_loopback, kill_tree, listening_sockets, still_running

pytestmark = pytest.mark.timeout(300)
CLI = [sys.executable, "-m", "flowtrain.cli"]


def _sleeper() -> subprocess.Popen:
    proc = subprocess.Popen(["sleep", "600"], stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")[0] != b"sleep":
        time.sleep(0.01)  # until it has exec'd
    return proc


@pytest.mark.parametrize("record", ["pid-only", "other-start-time"])
def test_item4_kafka_stop_never_signals_an_unrelated_process_holding_the_recorded_pid(tmp_path, record):
    """broker.json names a live process that is not the broker (a reused pid): stop leaves it alone."""
    sleeper = _sleeper()
    try:
        port = free_port()
        state = {"pid": sleeper.pid, "bootstrap": f"127.0.0.1:{port}", "port": port, "version": "4.3.1",
                 "started_at": time.time()}
        if record == "other-start-time":
            state["started"] = str(int(identity(sleeper.pid)["started"]) - 1000)
        (tmp_path / "broker.json").write_text(json.dumps(state))
        out = subprocess.run(CLI + ["kafka", "stop", "--port", str(port), "--data-dir", str(tmp_path)],
                             capture_output=True, text=True, timeout=120)
        time.sleep(0.3)
        assert sleeper.poll() is None, f"kafka stop killed an unrelated process (pid {sleeper.pid}): {out.stdout}"
        assert "not running" in out.stdout, out.stdout + out.stderr
        assert f"pid {sleeper.pid}" in out.stdout
        broker = LocalKafka(port=port, data_dir=tmp_path)
        assert broker.running_pid() is None
        assert broker.status()["running"] is False
    finally:
        sleeper.kill()
        sleeper.wait(timeout=10)


def test_item4_identity_is_start_time_and_command_line():
    sleeper = _sleeper()
    try:
        rec = identity(sleeper.pid)
        assert same_process(rec) and same_process(rec, marker="sleep")
        assert not same_process(rec, marker="kafka.Kafka")
        assert not same_process({**rec, "started": str(int(rec["started"]) + 1)})
        assert not same_process({"pid": sleeper.pid})  # no start time, no marker: not recognised
    finally:
        sleeper.kill()
        sleeper.wait(timeout=10)
    assert not same_process(rec)  # ended (reaped)


# -- flowtrain batch --workers 2 -----------------------------------------------------------------
@pytest.fixture(scope="module")
def small_dataset(shared_data) -> str:
    return shared_data.flights(every=40)


def _start_batch(dataset: str, run: Path) -> subprocess.Popen:
    """A `flowtrain batch --workers 2` that trains for minutes, in its own session (the test signals
    the parent alone, as `kill PID` or a closed terminal would)."""
    cmd = CLI + ["batch", "--no-progress", "--dataset", dataset, "--out", str(run), "--workers", "2",
                 "--epochs", "500", "--patience", "1000", "--batch-size", "64", "--failure-timeout", "60"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            start_new_session=True)


def _await_workers(proc: subprocess.Popen, run: Path, timeout: float = 180) -> dict[int, str]:
    """The parent's descendants once both workers have passed the rendezvous and train."""
    beats = run / "workers" / "heartbeats"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"batch ended early ({proc.returncode}): {proc.stderr.read()[-2000:]}"
        if all((beats / f"rank-{r}.beat").exists() for r in (0, 1)):
            tree = descendants(proc.pid)
            if len(tree) >= 2:
                return tree
        time.sleep(0.2)
    raise AssertionError(f"the two workers did not start within {timeout:.0f} s")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_item5_a_signal_to_batch_workers_parent_ends_every_worker(small_dataset, tmp_path, sig):
    proc = _start_batch(small_dataset, tmp_path / "run")
    tree: dict[int, str] = {}
    try:
        tree = _await_workers(proc, tmp_path / "run")
        os.kill(proc.pid, sig)  # the parent only: its workers run in their own process groups
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (proc.poll() is None or still_running(tree)):
            time.sleep(0.1)
        left = still_running(tree)
        assert proc.poll() is not None, f"flowtrain batch still runs 30 s after {sig.name}"
        assert not left, f"{sig.name} to flowtrain batch left workers running (parent now 1): {left}"
        assert proc.returncode != 0  # stopped, not finished
    finally:
        kill_tree(proc, tree)


def test_item7_a_workers_2_batch_job_listens_on_loopback_only(small_dataset, tmp_path):
    proc = _start_batch(small_dataset, tmp_path / "run")
    tree: dict[int, str] = {}
    try:
        tree = _await_workers(proc, tmp_path / "run")
        time.sleep(1.0)  # gloo's pairs are connected at the rendezvous; training runs
        sockets = listening_sockets([proc.pid, *tree])
        assert sockets, "no listening socket found in the job (the rendezvous store should be one)"
        exposed = {pid: [a for a in addrs if not is_loopback(a[0])] for pid, addrs in sockets.items()}
        exposed = {pid: addrs for pid, addrs in exposed.items() if addrs}
        assert not exposed, f"listening beyond 127.0.0.1: {exposed} (all: {sockets})"
    finally:
        kill_tree(proc, tree)


_PARENT = """
import sys, time
from flowtrain.local.processes import supervise
supervise({"a": (["sleep", "600"], sys.argv[1]), "b": (["sh", "-c", "sleep 600 & wait"], sys.argv[1])}, every_s=0.2)
print("supervise returned", flush=True)
"""


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGKILL],
                         ids=["SIGTERM", "SIGHUP", "SIGINT", "SIGKILL"])
def test_item5_supervised_children_and_theirs_end_with_the_parent_whatever_signal_ends_it(tmp_path, sig):
    """The supervisor itself, without a job around it: after a stop signal to the parent its children
    and what they started (a grandchild in a child's group) end within seconds; after the parent's
    SIGKILL its children do (the kernel's parent-death signal; a grandchild is its parent's to stop,
    as flowtrain's own children do: tests/integration/test_process_safety_stream.py)."""
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, str(tmp_path / "children.log")],
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    tree: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(tree) < 3:  # sleep, sh, and sh's sleep
            time.sleep(0.05)
            tree = descendants(parent.pid)
        assert len(tree) >= 3, f"children not started: {tree}"
        children = {pid: t for pid, t in tree.items() if _parent(pid) == parent.pid}
        assert len(children) == 2
        os.kill(parent.pid, sig)
        watched = children if sig == signal.SIGKILL else tree
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and still_running(watched):
            time.sleep(0.05)
        assert not still_running(watched), f"{sig.name} to the parent left {still_running(watched)}"
        parent.wait(timeout=20)
        if sig != signal.SIGKILL:
            assert "supervise returned" in parent.stdout.read()  # it stopped them and went on
    finally:
        kill_tree(parent, tree)

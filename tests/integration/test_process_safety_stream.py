"""Process safety of `flowtrain stream` (issue #22 items 5 and 7), on a real broker and Prism: every
process of a running job listens on 127.0.0.1 only, and no process of the job outlives a SIGHUP or
a SIGKILL of the `flowtrain stream` that started it. The loopback check and the SIGHUP test share one running job
(the module's ``jobs``); the SIGKILL test starts its own."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.procs import descendants, is_loopback, kill_tree, listening_sockets, still_running

pytestmark = [pytest.mark.kafka, pytest.mark.streaming, pytest.mark.timeout(600)]
CLI = [sys.executable, "-m", "flowtrain.cli"]


@pytest.fixture(scope="module")
def dataset(shared_data) -> str:
    return shared_data.flights(every=80)


def _new_topic(bootstrap: str) -> str:
    from kafka.admin import KafkaAdminClient, NewTopic

    name = f"raw-{uuid.uuid4().hex[:10]}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.create_topics([NewTopic(name, num_partitions=2, replication_factor=1)])
    finally:
        admin.close()
    return name


def _start_job(bootstrap: str, dataset: str, out: Path) -> subprocess.Popen:
    """`flowtrain stream --workers 2` (pipeline on Prism; trainer with two replicas) on a topic that
    holds events, in its own session (the test signals the parent alone)."""
    raw = _new_topic(bootstrap)
    replay = subprocess.run(CLI + ["replay", "--bootstrap", bootstrap, "--topic", raw, "--limit", "400"],
                            capture_output=True, text=True, timeout=180)
    assert replay.returncode == 0, replay.stderr[-2000:]
    out.mkdir(parents=True)
    return subprocess.Popen(CLI + ["stream", "--bootstrap", bootstrap, "--raw-topic", raw,
                                   "--features-topic", f"{raw}-features", "--dead-letter-topic", f"{raw}-dead",
                                   "--updates-topic", f"{raw}-updates", "--group-id", f"{raw}-group",
                                   "--dataset", dataset, "--out", str(out), "--batch-size", "50",
                                   "--workers", "2", "--checkpoint-every", "2"],
                            stdout=open(out.parent / "stream-test.log", "ab"), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def _logs(out: Path) -> str:
    text = ""
    for name in ("stream-test.log", "pipeline.log", "trainer.log"):
        try:
            where = out.parent if name == "stream-test.log" else out  # the test's own log: beside --out
            text += f"\n--- {name} ---\n" + (where / name).read_text(errors="replace")[-2500:]
        except OSError:
            pass
    return text


def _await_running(proc: subprocess.Popen, out: Path, timeout: float = 360) -> dict[int, str]:
    """The job's processes once Prism runs the pipeline and both trainer replicas have trained a step."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"flowtrain stream ended early ({proc.returncode}):{_logs(out)}"
        tree = descendants(proc.pid)
        prism = any("prism" in Path(f"/proc/{pid}/comm").read_text(errors="replace")
                    for pid in tree if Path(f"/proc/{pid}/comm").exists())
        beats = all((out / "workers" / "heartbeats" / f"rank-{r}.beat").exists() for r in (0, 1))
        try:
            step = json.loads((out / "trainer-status.json").read_text()).get("step", 0)
        except (OSError, ValueError):
            step = 0
        if prism and beats and step >= 1:
            return descendants(proc.pid)
        time.sleep(1)
    raise AssertionError(f"the stream job was not running within {timeout:.0f} s:{_logs(out)}")


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "?"


def _await_gone(proc: subprocess.Popen, tree: dict[int, str], timeout: float) -> dict[int, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (proc.poll() is None or still_running(tree)):
        time.sleep(0.5)
    return still_running(tree)


@pytest.fixture(scope="module")
def jobs(bootstrap, dataset, tmp_path_factory):
    """``running()``: the module's `flowtrain stream --workers 2` job that runs now, started (and awaited) when none
    does; every job it started is stopped (Ctrl-C, then SIGKILL) at the module's end."""
    started: list[subprocess.Popen] = []

    def running() -> subprocess.Popen:
        if started and started[-1].poll() is None:
            return started[-1]
        out = tmp_path_factory.mktemp("psjob") / "run"
        started.append(_start_job(bootstrap, dataset, out))
        _await_running(started[-1], out)
        return started[-1]

    yield running
    for proc in started:
        tree = descendants(proc.pid) if proc.poll() is None else {}
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the normal stop
            _await_gone(proc, tree, 120)
        kill_tree(proc, tree)


def test_item7_a_running_stream_job_listens_on_loopback_only(jobs):
    proc = jobs()
    tree = descendants(proc.pid)
    sockets = listening_sockets([proc.pid, *tree])
    # Prism's job server, the pipeline's SDK worker pool and the trainer's rendezvous store at least
    assert sum(len(a) for a in sockets.values()) >= 3, f"too few listening sockets found: {sockets}"
    exposed = {pid: ([a for a in addrs if not is_loopback(a[0])], _command(pid)) for pid, addrs in sockets.items()}
    exposed = {pid: found for pid, found in exposed.items() if found[0]}
    assert not exposed, f"listening beyond 127.0.0.1: {exposed} (all: {sockets})"


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGKILL], ids=["SIGHUP", "SIGKILL"])
def test_item5_a_signal_to_flowtrain_stream_ends_every_process_of_the_job(jobs, sig):
    """SIGHUP (a closed terminal) or SIGKILL to the parent alone: nothing of the job runs on."""
    proc = jobs()  # SIGHUP: the job the loopback test saw running; SIGKILL: a new one
    tree: dict[int, str] = {}
    try:
        tree = descendants(proc.pid)
        assert len(tree) >= 5, f"expected pipeline, Prism, trainer and two replicas: {tree}"
        os.kill(proc.pid, sig)
        left = _await_gone(proc, tree, 180)
        assert proc.poll() is not None, f"flowtrain stream still runs 180 s after {sig.name}"
        assert not left, f"{sig.name} to flowtrain stream left processes running: {left}"
    finally:
        kill_tree(proc, tree)

"""Process safety of `flowtrain stream` (issue #22 items 5 and 7, issue #28 item 3), on a real broker and Prism:
every process of a running `flowtrain stream --score --workers 2 --metrics-port P` (the feature pipeline and the
scorer on Prism each, with Beam's LOOPBACK worker pool; two training replicas with their rendezvous store; the job's
/metrics and status page) listens on 127.0.0.1 only, and so does the local Kafka broker it reads; the same run, fed
while the trainer publishes, serves fresh versions (issue #42); and no process of the job outlives a SIGHUP or a
SIGKILL of the `flowtrain stream` that started it. The loopback checks, the freshness check and the SIGHUP test share
one running job (the module's ``jobs``); the SIGKILL test starts its own. docs/security.md lists each listener."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from flowtrain.local.tools import free_port
from tests.procs import descendants, is_loopback, kill_tree, listening_sockets, still_running
from tests.scoring_helpers import dead_letters, predictions, read_topic
from tests.serving_checks import publications, stale_scored

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


@dataclass
class Job:
    proc: subprocess.Popen
    raw: str  # its raw topic (the others are named after it)
    out: Path
    port: int  # its /metrics


def _start_job(bootstrap: str, dataset: str, out: Path) -> Job:
    """`flowtrain stream --score --workers 2 --metrics-port P` (pipeline and scorer on Prism; trainer with two
    replicas) on a topic that holds events, in its own session (the test signals the parent alone)."""
    raw = _new_topic(bootstrap)
    replay = subprocess.run(CLI + ["replay", "--bootstrap", bootstrap, "--topic", raw, "--limit", "400"],
                            capture_output=True, text=True, timeout=180)
    assert replay.returncode == 0, replay.stderr[-2000:]
    out.mkdir(parents=True)
    port = free_port()
    proc = subprocess.Popen(CLI + ["stream", "--score", "--bootstrap", bootstrap, "--raw-topic", raw,
                                   "--features-topic", f"{raw}-features", "--dead-letter-topic", f"{raw}-dead",
                                   "--updates-topic", f"{raw}-updates", "--group-id", f"{raw}-group",
                                   "--predictions-topic", f"{raw}-pred", "--score-dead-letter-topic",
                                   f"{raw}-sdead", "--score-group-id", f"{raw}-sgroup", "--dataset", dataset,
                                   "--out", str(out), "--batch-size", "50", "--checkpoint-every", "2",
                                   "--workers", "2", "--metrics-port", str(port), "--wait-model", "300"],
                            stdout=open(out.parent / "stream-test.log", "ab"), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    return Job(proc, raw, out, port)


def _logs(out: Path) -> str:
    text = ""
    for name in ("stream-test.log", "pipeline.log", "trainer.log", "scorer.log"):
        try:
            where = out.parent if name == "stream-test.log" else out  # the test's own log: beside --out
            text += f"\n--- {name} ---\n" + (where / name).read_text(errors="replace")[-2500:]
        except OSError:
            pass
    return text


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text(errors="replace").strip()
    except OSError:
        return "?"


def _await_running(proc: subprocess.Popen, out: Path, timeout: float = 420) -> dict[int, str]:
    """The job's processes once two Prisms run the pipeline and the scorer, the scorer serves a version and both
    trainer replicas have trained a step."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"flowtrain stream ended early ({proc.returncode}):{_logs(out)}"
        tree = descendants(proc.pid)
        prisms = [pid for pid in tree if "prism" in _comm(pid)]
        beats = all((out / "workers" / "heartbeats" / f"rank-{r}.beat").exists() for r in (0, 1))
        try:
            scoring = "starting with model version" in (out / "scorer.log").read_text(errors="replace")
            step = json.loads((out / "trainer-status.json").read_text()).get("step", 0)
        except (OSError, ValueError):
            scoring, step = False, 0
        if len(prisms) >= 2 and scoring and beats and step >= 1:
            time.sleep(3)  # the scorer's pipeline is submitted to its Prism
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
    """``running()``: the module's `flowtrain stream --score --workers 2 --metrics-port P` job that runs now, started
    (and awaited) when none does; every job it started is stopped (Ctrl-C, then SIGKILL) at the module's end."""
    started: list[Job] = []

    def running() -> Job:
        if started and started[-1].proc.poll() is None:
            return started[-1]
        out = tmp_path_factory.mktemp("psjob") / "run"
        started.append(_start_job(bootstrap, dataset, out))
        _await_running(started[-1].proc, out)
        return started[-1]

    yield running
    for proc in (job.proc for job in started):
        tree = descendants(proc.pid) if proc.poll() is None else {}
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the normal stop
            _await_gone(proc, tree, 120)
        kill_tree(proc, tree)


def test_item7_a_running_stream_job_listens_on_loopback_only(jobs):
    proc = jobs().proc
    tree = descendants(proc.pid)
    sockets = listening_sockets([proc.pid, *tree])
    # Prism's job server, the pipeline's SDK worker pool and the trainer's rendezvous store at least
    assert sum(len(a) for a in sockets.values()) >= 3, f"too few listening sockets found: {sockets}"
    exposed = {pid: ([a for a in addrs if not is_loopback(a[0])], _command(pid)) for pid, addrs in sockets.items()}
    exposed = {pid: found for pid, found in exposed.items() if found[0]}
    assert not exposed, f"listening beyond 127.0.0.1: {exposed} (all: {sockets})"


def test_item3_a_running_stream_score_job_listens_on_loopback_only(kafka_broker, bootstrap, jobs):
    """#28 item 3: every process of the job and the broker it reads on 127.0.0.1 only, /metrics among them; then,
    fed while the trainer publishes versions, every prediction made 5 s after a publication carries that version or
    a newer one (issue #42, the whole job with --workers 2)."""
    job = jobs()
    proc, raw, out, port = job.proc, job.raw, job.out, job.port
    tree = descendants(proc.pid)
    broker = kafka_broker.status()["pid"]  # the broker (`--local-kafka`, `flowtrain kafka start`) too
    sockets = listening_sockets([proc.pid, *tree, broker])
    assert len(sockets.get(broker, [])) == 2, sockets  # clients and its KRaft controller
    found = {(pid, _command(pid)): addrs for pid, addrs in sockets.items()}
    assert any(p == port for _, p in sockets.get(proc.pid, [])), f"no /metrics on {port}: {found}"
    # two Prism job servers, two LOOPBACK worker pools, the rendezvous store, the metrics server at least
    assert sum(len(a) for a in sockets.values()) >= 6, f"too few listening sockets found: {found}"
    exposed = {key: [a for a in addrs if not is_loopback(a[0])] for key, addrs in found.items()}
    assert not {key: a for key, a in exposed.items() if a}, f"listening beyond 127.0.0.1: {exposed} (all: {found})"

    # issue #42 in the whole job: while the trainer publishes versions and events keep coming, every prediction
    # made 5 s after a publication carries that version or a newer one
    more = subprocess.run(CLI + ["replay", "--bootstrap", bootstrap, "--topic", raw, "--limit", "600",
                                 "--rate", "40", "--seed", "9"], capture_output=True, text=True, timeout=180)
    assert more.returncode == 0, more.stderr[-2000:]
    names = {"raw": raw, "pred": f"{raw}-pred", "updates": f"{raw}-updates"}
    sources = {f"{m.topic}/{m.partition}/{m.offset}" for m in read_topic(bootstrap, raw)}
    deadline = time.monotonic() + 240
    while True:
        preds = predictions(bootstrap, names["pred"])
        dead = dead_letters(bootstrap, f"{raw}-sdead")
        covered = {p["pred_source"] for p in preds} | {d["source"] for d in dead}
        if covered >= sources:
            break
        assert proc.poll() is None and time.monotonic() < deadline, \
            f"{len(covered)} of {len(sources)} events scored:{_logs(out)}"
        time.sleep(1)
    published = publications(bootstrap, names["updates"])
    fresh = stale_scored(preds, published)
    assert len(published) >= 3 and fresh["checked"] >= 300, (len(published), fresh)
    assert fresh["share"] <= 0.01, (fresh, _logs(out))


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGKILL], ids=["SIGHUP", "SIGKILL"])
def test_item5_a_signal_to_flowtrain_stream_ends_every_process_of_the_job(jobs, sig):
    """SIGHUP (a closed terminal) or SIGKILL to the parent alone: nothing of the job runs on."""
    proc = jobs().proc  # SIGHUP: the job the loopback tests saw running; SIGKILL: a new one
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

"""Issue 28 item 3, beyond Flink: every process of a running `flowtrain stream --score --workers 2 --metrics-port P`
(the feature pipeline and the scorer on Prism each, with Beam's LOOPBACK worker pool; two training replicas with
their rendezvous store; the job's /metrics and status page) listens on 127.0.0.1 only, and so does the local Kafka
broker it reads.
docs/security.md lists each of these listeners. The same run, then fed while the trainer publishes: every prediction
made 5 s after a publication carries that version or a newer one (issue #42, the whole job with --workers 2)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flowtrain.local.tools import free_port
from tests.procs import descendants, is_loopback, kill_tree, listening_sockets
from tests.scoring_helpers import dead_letters, predictions, read_topic
from tests.serving_checks import publications, stale_scored

pytestmark = [pytest.mark.kafka, pytest.mark.streaming, pytest.mark.timeout(600)]
CLI = [sys.executable, "-m", "flowtrain.cli"]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text(errors="replace").strip()
    except OSError:
        return "?"


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:160]
    except OSError:
        return "?"


def _logs(out: Path) -> str:
    text = ""
    for name in ("stream-test.log", "pipeline.log", "trainer.log", "scorer.log"):
        try:
            where = out.parent if name == "stream-test.log" else out  # the test's own log: beside --out
            text += f"\n--- {name} ---\n" + (where / name).read_text(errors="replace")[-2000:]
        except OSError:
            pass
    return text


def test_item3_a_running_stream_score_job_listens_on_loopback_only(kafka_broker, bootstrap, new_topic, shared_data,
                                                                   tmp_path):
    dataset = shared_data.flights(every=80)
    raw = new_topic(partitions=2, prefix="raw")
    replay = subprocess.run(CLI + ["replay", "--bootstrap", bootstrap, "--topic", raw, "--limit", "400"],
                            capture_output=True, text=True, timeout=180)
    assert replay.returncode == 0, replay.stderr[-2000:]
    out, port = tmp_path / "run", free_port()
    out.mkdir()
    proc = subprocess.Popen(CLI + ["stream", "--score", "--bootstrap", bootstrap, "--raw-topic", raw,
                                   "--features-topic", f"{raw}-features", "--dead-letter-topic", f"{raw}-dead",
                                   "--updates-topic", f"{raw}-updates", "--group-id", f"{raw}-group",
                                   "--predictions-topic", f"{raw}-pred", "--score-dead-letter-topic",
                                   f"{raw}-sdead", "--score-group-id", f"{raw}-sgroup", "--dataset", dataset,
                                   "--out", str(out), "--batch-size", "50", "--checkpoint-every", "2",
                                   "--workers", "2", "--metrics-port", str(port), "--wait-model", "300"],
                            stdout=open(out.parent / "stream-test.log", "ab"), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    tree: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 420
        while True:
            assert proc.poll() is None, f"flowtrain stream --score ended early ({proc.returncode}):{_logs(out)}"
            assert time.monotonic() < deadline, f"the job was not running within 420 s:{_logs(out)}"
            tree = descendants(proc.pid)
            prisms = [pid for pid in tree if "prism" in _comm(pid)]
            try:
                scoring = "starting with model version" in (out / "scorer.log").read_text(errors="replace")
                step = json.loads((out / "trainer-status.json").read_text()).get("step", 0)
            except (OSError, ValueError):
                scoring, step = False, 0
            if len(prisms) >= 2 and scoring and step >= 1:
                break
            time.sleep(1)
        time.sleep(3)  # the scorer's pipeline is submitted to its Prism
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
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the normal stop
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                pass
        kill_tree(proc, tree)

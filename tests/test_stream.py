"""The streaming job against a real broker and the real streaming runner (Prism)."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from kafka import KafkaConsumer, TopicPartition

from connectors.arrow import decode_batch
from tests.flights_data import make_flights_dataset

pytestmark = [pytest.mark.kafka, pytest.mark.streaming, pytest.mark.timeout(420)]
CLI = [sys.executable, "-m", "flowtrain.cli"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    return make_flights_dataset(tmp_path_factory.mktemp("streamds"), every=30)


def _names():
    tag = uuid.uuid4().hex[:6]
    return {"raw": f"raw-{tag}", "features": f"feat-{tag}", "dead": f"dead-{tag}", "updates": f"upd-{tag}",
            "group": f"g-{tag}"}


def _replay(bootstrap, topic, n, *, partitions=3, malformed=0.0, skip=0):
    proc = subprocess.run(CLI + ["replay", "--bootstrap", bootstrap, "--topic", topic, "--limit", str(n),
                                 "--partitions", str(partitions), "--malformed", str(malformed), "--skip", str(skip)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def _stream_args(bootstrap, names, dataset, out):
    return ["--bootstrap", bootstrap, "--raw-topic", names["raw"], "--features-topic", names["features"],
            "--dead-letter-topic", names["dead"], "--updates-topic", names["updates"], "--group-id", names["group"],
            "--dataset", dataset, "--out", str(out)]


def _committed(bootstrap, topic, group) -> tuple[int, int]:
    c = KafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    try:
        tps = [TopicPartition(topic, p) for p in c.partitions_for_topic(topic)]
        ends = c.end_offsets(tps)
        return sum(c.committed(tp) or 0 for tp in tps), sum(ends.values())
    finally:
        c.close()


def _start_pipeline(bootstrap, names, dataset, out, extra=()):
    Path(out).mkdir(parents=True, exist_ok=True)
    log = open(Path(out) / "pipeline-test.log", "ab")
    return subprocess.Popen(CLI + ["stream", "pipeline", *_stream_args(bootstrap, names, dataset, out),
                                   "--batch-size", "200", *extra],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc, sig=signal.SIGINT, timeout=60):
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _run_pipeline_until_caught_up(bootstrap, names, dataset, out, timeout=180):
    proc = _start_pipeline(bootstrap, names, dataset, out)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            done, end = _committed(bootstrap, names["raw"], names["group"])
            if end and done == end:
                return
            assert proc.poll() is None, (Path(out) / "pipeline-test.log").read_text()[-3000:]
            time.sleep(1)
        raise AssertionError(f"pipeline did not catch up in {timeout} s: {done}/{end}")
    finally:
        _stop(proc)


def _read_topic(bootstrap, topic):
    c = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, consumer_timeout_ms=4000)
    tps = [TopicPartition(topic, p) for p in c.partitions_for_topic(topic)]
    c.assign(tps)
    c.seek_to_beginning()
    out = list(c)
    c.close()
    return out


def test_counts_reconcile_and_every_malformed_kind_is_a_dead_letter(bootstrap, dataset, tmp_path):
    names = _names()
    printed = _replay(bootstrap, names["raw"], 1500, malformed=0.1)
    injected = json.loads(printed.split("malformed: ", 1)[1].strip().replace("'", '"'))
    _run_pipeline_until_caught_up(bootstrap, names, dataset, tmp_path)
    rows = sum(decode_batch(m.value).num_rows for m in _read_topic(bootstrap, names["features"]))
    dead = [dict(m.headers) for m in _read_topic(bootstrap, names["dead"])]
    reasons = [d["reason"].decode() for d in dead]
    assert rows + len(dead) == 1500  # raw events = feature rows + dead letters
    by_kind = {
        "broken JSON": sum(r.startswith("broken JSON") for r in reasons),
        "missing field": sum(r.startswith("missing field") for r in reasons),
        "wrong type": sum(r.startswith("wrong type") for r in reasons),
        "NaN": sum(r.startswith("NaN") for r in reasons),
        "impossible value": sum(r.startswith("impossible distance") for r in reasons),
    }
    assert by_kind == injected
    assert all(d["source"].decode().startswith(names["raw"] + "/") for d in dead)
    assert sum(r.startswith("cancelled or diverted") for r in reasons) > 0  # real-data rejects too


def _trainer(bootstrap, names, dataset, out, *extra):
    return subprocess.Popen(CLI + ["stream", "train", *_stream_args(bootstrap, names, dataset, out), "--ledger",
                                   "--checkpoint-every", "3", "--checkpoint-seconds", "1000", "--idle-exit", "3",
                                   *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def _ledger(run) -> dict[tuple[int, int], int]:
    counts: dict = {}
    for line in (Path(run) / "ledger.jsonl").read_text().splitlines():
        r = json.loads(line)
        counts[(r["partition"], r["offset"])] = counts.get((r["partition"], r["offset"]), 0) + 1
    return counts


def _final_model(run):
    from flowtrain.train import checkpoint

    return checkpoint.load(checkpoint.latest(Path(run) / "checkpoints"))["model"]


def _status_step(run) -> int:
    try:
        return json.loads((Path(run) / "trainer-status.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return 0


def test_trainer_killed_repeatedly_trains_every_event_exactly_once(bootstrap, dataset, tmp_path):
    names = _names()
    _replay(bootstrap, names["raw"], 3000, partitions=1)  # one feature partition: a deterministic order
    _run_pipeline_until_caught_up(bootstrap, names, dataset, tmp_path / "p")
    valid = {(int(p), int(o)) for m in _read_topic(bootstrap, names["features"])
             for p, o in zip(decode_batch(m.value)["src_partition"].to_pylist(),
                             decode_batch(m.value)["src_offset"].to_pylist())}
    steps = len(_read_topic(bootstrap, names["features"]))

    clean = _trainer(bootstrap, names, dataset, tmp_path / "clean")
    assert clean.wait(timeout=240) == 0, clean.stdout.read().decode()[-3000:]

    crashed = tmp_path / "crashed"
    rng = random.Random(1)
    for _ in range(3):  # kill -9 at random points, then restart from the checkpoint
        proc = _trainer(bootstrap, names, dataset, crashed)
        target = _status_step(crashed) + rng.randint(2, max(3, steps // 5))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and _status_step(crashed) < target and proc.poll() is None:
            time.sleep(0.05)
        time.sleep(rng.random() * 0.5)
        _stop(proc, signal.SIGKILL)
    final = _trainer(bootstrap, names, dataset, crashed)
    assert final.wait(timeout=240) == 0, final.stdout.read().decode()[-3000:]

    for run in (tmp_path / "clean", crashed):
        counts = _ledger(run)
        assert set(counts) == valid  # nothing lost
        assert set(counts.values()) == {1}  # nothing trained twice
    a, b = _final_model(tmp_path / "clean"), _final_model(crashed)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6


def test_pipeline_kill9_and_replayed_output_are_not_trained_twice(bootstrap, dataset, tmp_path):
    names = _names()
    _replay(bootstrap, names["raw"], 2000, partitions=2)
    proc = _start_pipeline(bootstrap, names, dataset, tmp_path)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and _committed(bootstrap, names["raw"], names["group"])[0] == 0:
        time.sleep(0.2)
    _stop(proc, signal.SIGKILL)  # mid-stream, outputs possibly written but not committed
    _replay(bootstrap, names["raw"], 1000, partitions=2, skip=2000)  # more events while it is down
    # Rewind the group to the start of each partition: the restarted pipeline writes everything
    # again, as it would after a crash between producing and committing.
    from kafka import OffsetAndMetadata

    c = KafkaConsumer(bootstrap_servers=bootstrap, group_id=names["group"], enable_auto_commit=False)
    c.commit({TopicPartition(names["raw"], p): OffsetAndMetadata(0, "", -1) for p in range(2)})
    c.close()
    _run_pipeline_until_caught_up(bootstrap, names, dataset, tmp_path)
    messages = _read_topic(bootstrap, names["features"])
    sources = [(p, o) for m in messages for p, o in zip(decode_batch(m.value)["src_partition"].to_pylist(),
                                                           decode_batch(m.value)["src_offset"].to_pylist())]
    assert len(sources) > len(set(sources))  # the features topic holds duplicates
    run = tmp_path / "train"
    trainer = _trainer(bootstrap, names, dataset, run)
    out, _ = trainer.communicate(timeout=240)
    assert trainer.returncode == 0, out.decode()[-3000:]
    counts = _ledger(run)
    assert set(counts) == set(sources) and set(counts.values()) == {1}
    assert f"{len(sources) - len(set(sources)):,} duplicate rows dropped" in out.decode()


def test_broker_stopped_and_restarted_mid_stream_loses_nothing(dataset, tmp_path):
    from flowtrain.local.kafka import LocalKafka, free_port

    broker = LocalKafka(port=free_port(below_ephemeral=True), data_dir=tmp_path / "kafka")
    broker.start(timeout_s=120, quiet=True)
    bootstrap = broker.bootstrap
    names = _names()
    run = tmp_path / "run"
    procs = []
    try:
        _replay(bootstrap, names["raw"], 1500, partitions=2)
        procs.append(_start_pipeline(bootstrap, names, dataset, tmp_path / "p"))
        procs.append(subprocess.Popen(
            CLI + ["stream", "train", *_stream_args(bootstrap, names, dataset, run), "--ledger",
                   "--checkpoint-seconds", "1"],
            stdout=open(tmp_path / "trainer.log", "ab"), stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and _status_step(run) < 2:
            time.sleep(0.2)
        broker.stop(quiet=True)  # mid-stream
        time.sleep(5)
        broker.start(timeout_s=120, quiet=True)
        _replay(bootstrap, names["raw"], 1500, partitions=2, skip=1500)
        deadline = time.monotonic() + 240
        valid = set()
        while time.monotonic() < deadline:
            done, end = _committed(bootstrap, names["raw"], names["group"])
            if end == 3000 and done == end:
                valid = {(int(p), int(o)) for m in _read_topic(bootstrap, names["features"])
                         for p, o in zip(decode_batch(m.value)["src_partition"].to_pylist(),
                                         decode_batch(m.value)["src_offset"].to_pylist())}
                if (run / "ledger.jsonl").exists() and set(_ledger(run)) == valid:
                    break
            assert procs[0].poll() is None, _tail(tmp_path / "p" / "pipeline-test.log")
            assert procs[1].poll() is None, _tail(tmp_path / "trainer.log")
            time.sleep(1)
        counts = _ledger(run)
        assert len(valid) > 2500 and set(counts) == valid and set(counts.values()) == {1}
    finally:
        for p in procs:
            _stop(p)
        from connectors.kafka import close_all_clients

        close_all_clients()
        broker.stop(quiet=True)


def _tail(path: Path, n: int = 40) -> str:
    """The log's last lines, without kafka-python's reconnect chatter."""
    lines = [l for l in Path(path).read_text(errors="replace").splitlines()
             if "kafka.cluster" not in l and "kafka.net" not in l and "kafka.consumer.fetcher" not in l]
    return "\n".join(lines[-n:])

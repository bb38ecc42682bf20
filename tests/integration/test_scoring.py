"""The scoring pipeline (`flowtrain stream score`) on the real broker and the real runner (Prism):
Beam RunInference with flowtrain's model, versions hot-swapped from the model-updates topic."""
from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from connectors.arrow import decode_batch
from tests.flights_data import make_flights_dataset
from tests.procs import stop_group as _stop

#: The tests that run the scorer on the broker and Prism.
live = [pytest.mark.kafka, pytest.mark.streaming, pytest.mark.timeout(300)]
CLI = [sys.executable, "-m", "flowtrain.cli"]
SWAP_S = 1.0
#: A generous bound: a published version serves within this many seconds (measured: 1-4 s).
BOUND_S = 30.0


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    return make_flights_dataset(tmp_path_factory.mktemp("scoreds"), every=60)


@pytest.fixture(scope="module")
def events() -> list[dict]:
    from pipelines.flights.events import events_from_table
    from pipelines.flights.nycflights import load_table

    out = []
    for e in events_from_table(load_table("flights")):
        out.append(e)
        if len(out) == 4000:
            return out
    return out


@pytest.fixture(scope="module")
def reference(dataset):
    """What the scorer must compute, computed here with the feature and model code directly."""
    import pyarrow.parquet as pq

    from connectors.dataset import read_manifest
    from flowtrain.local.paths import demo_tables_dir
    from flowtrain.train.loader import TabularDataset
    from pipelines.flights import features as FF
    from pipelines.flights.batch import export_tables

    from pipelines.flights.streaming import FlightFeaturizer

    tables = export_tables(demo_tables_dir())
    data = TabularDataset(dataset)
    featurizer = FlightFeaturizer(read_manifest(dataset)["stats"], FF.prepare_weather(pq.read_table(tables["weather"])),
                                  FF.prepare_planes(pq.read_table(tables["planes"])))
    return {"data": data, "featurizer": featurizer}


def _names():
    tag = uuid.uuid4().hex[:6]
    return {"raw": f"sraw-{tag}", "pred": f"spred-{tag}", "dead": f"sdead-{tag}", "updates": f"supd-{tag}",
            "group": f"sg-{tag}"}


ARCH = {"kind": "mlp", "hidden": [32, 16], "dropout": 0.0, "seed": 0}


def _model(reference, seed: int):
    """flowtrain's model as the trainer builds it, with weights that differ clearly per seed."""
    from flowtrain.train.stream import Architecture

    model = Architecture.from_dict(ARCH, "test").build(reference["data"])
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.eval()


def _publish(bootstrap, names, ckpt_dir: Path, version: int, state: dict | None = None, *, corrupt: str = ""):
    """A version published as the online trainer does: checkpoint.save, then a record on the updates topic."""
    from flowtrain.train import checkpoint

    path = checkpoint.save(ckpt_dir, version, {"model": state, "optimizer": {}, "step": version, "version": version,
                                               "architecture": ARCH, "positions": {}, "seen": {}}, keep=0)
    if corrupt == "truncated":  # torn after the checksum was written
        path.write_bytes(path.read_bytes()[:200])
    record = {"version": version, "step": version, "checkpoint": str(path), "positions": {}, "metrics": {},
              "reason": "periodic", "time": time.time()}
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    producer.send(names["updates"], key=str(version).encode(), value=json.dumps(record).encode())
    producer.flush()
    producer.close()
    return time.time()


def _produce(bootstrap, topic, events, *, malformed=0.0, seed=0) -> int:
    from pipelines.flights.events import MALFORMED_KINDS, malform

    rng = random.Random(seed)
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    for i, e in enumerate(events):
        value = malform(e, MALFORMED_KINDS[i % len(MALFORMED_KINDS)], rng) if rng.random() < malformed \
            else json.dumps(e).encode()
        producer.send(topic, key=(e.get("tailnum") or "x").encode(), value=value)
    producer.flush()
    producer.close()
    return len(events)


def _read(bootstrap, topic):
    """Every record of the topic now (up to its end offsets)."""
    c = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, fetch_max_wait_ms=50)
    try:
        tps = [TopicPartition(topic, p) for p in c.partitions_for_topic(topic) or []]
        if not tps:  # not created yet
            return []
        ends = c.end_offsets(tps)
        c.assign(tps)
        c.seek_to_beginning()
        out, deadline = [], time.monotonic() + 30
        while any(c.position(tp) < ends[tp] for tp in tps) and time.monotonic() < deadline:
            for records in c.poll(timeout_ms=200).values():
                out += records
        return out
    finally:
        c.close()


def _predictions(bootstrap, topic) -> list[dict]:
    rows = []
    for m in _read(bootstrap, topic):
        b = decode_batch(m.value)
        rows += b.to_pylist()
    return rows


def _dead(bootstrap, topic) -> list[dict]:
    return [{k: v.decode() for k, v in m.headers} for m in _read(bootstrap, topic)]


def _scorer(bootstrap, names, dataset, out: Path) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        CLI + ["stream", "score", "--bootstrap", bootstrap, "--raw-topic", names["raw"], "--updates-topic",
               names["updates"], "--predictions-topic", names["pred"], "--score-dead-letter-topic", names["dead"],
               "--score-group-id", names["group"], "--dataset", dataset, "--out", str(out), "--swap-interval",
               str(SWAP_S), "--wait-model", "60"],
        stdout=open(out / "scorer.log", "ab"), stderr=subprocess.STDOUT, start_new_session=True)


class _Feed:
    """Produces the next events, a small chunk every 0.3 s, as a live source would."""

    def __init__(self, bootstrap, names, events, *, start: int):
        self.bootstrap, self.names, self.events, self.n = bootstrap, names, events, start

    def until(self, done, proc, log: Path, *, within_s: float, then_s: float = 2.0) -> float:
        """Feeds until ``done(predictions, scorer log)``, then ``then_s`` more; returns when done held."""
        deadline, seen = time.monotonic() + within_s, None
        while seen is None or time.time() < seen + then_s:
            self.n += _produce(self.bootstrap, self.names["raw"], self.events[self.n:self.n + 40])
            time.sleep(0.3)
            if seen is None and done(_predictions(self.bootstrap, self.names["pred"]), log.read_text()):
                seen = time.time()
            assert proc.poll() is None, log.read_text()[-3000:]
            assert seen is not None or time.monotonic() < deadline, f"not within {within_s} s\n" + \
                log.read_text()[-3000:]
        return seen


def _committed(bootstrap, names) -> dict[int, int]:
    c = KafkaConsumer(bootstrap_servers=bootstrap, group_id=names["group"], enable_auto_commit=False)
    try:
        return {p: c.committed(TopicPartition(names["raw"], p)) or 0 for p in (0, 1)}
    finally:
        c.close()


def _wait_covered(bootstrap, names, n_raw: int, proc, log: Path, timeout=120):
    """Until predictions + dead letters cover every raw event (distinct sources); returns both."""
    deadline = time.monotonic() + timeout
    while True:
        preds, dead = _predictions(bootstrap, names["pred"]), _dead(bootstrap, names["dead"])
        if len({p["source"] for p in preds} | {d["source"] for d in dead}) >= n_raw:
            return preds, dead
        assert proc.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() < deadline, (f"{len(preds)} predictions + {len(dead)} dead letters of {n_raw} "
                                             f"events after {timeout} s\n{log.read_text()[-3000:]}")
        time.sleep(0.5)


def _expected(bootstrap, names, reference, models: dict[int, torch.nn.Module]) -> dict[str, dict[int, float]]:
    """source -> {version: probability} computed here from the raw topic with the feature code."""
    from connectors.kafka import KafkaRecord
    from pipelines.flights.scoring import featurize_records

    by_part: dict[int, list] = {}
    for m in _read(bootstrap, names["raw"]):
        by_part.setdefault(m.partition, []).append(
            KafkaRecord(m.topic, m.partition, m.offset, m.timestamp, m.key, m.value))
    data = reference["data"]
    out: dict[str, dict[int, float]] = {}
    for records in by_part.values():
        batch, _ = featurize_records(sorted(records, key=lambda r: r.offset), reference["featurizer"])
        if batch.features is None or not batch.features.num_rows:
            continue
        import pyarrow as pa

        from flowtrain.train.loader import table_to_split

        split = table_to_split(pa.Table.from_batches([batch.features]), data.spec)
        for version, model in models.items():
            with torch.no_grad():
                probs = torch.sigmoid(model(split.x_num, split.x_cat)).numpy()
            for src, p in zip(batch.features.column("source").to_pylist(), probs):
                out.setdefault(src, {})[version] = float(p)
    return out


def _apply(marks):
    def wrap(fn):
        for m in marks:
            fn = m(fn)
        return fn
    return wrap


@_apply(live)
def test_predictions_carry_their_version_and_hot_swap_without_restart(bootstrap, dataset, events, reference,
                                                                     tmp_path, say):
    names = _names()
    from connectors.kafka import ensure_topic

    ensure_topic(bootstrap, names["raw"], partitions=2)
    ensure_topic(bootstrap, names["updates"])
    models = {1: _model(reference, 1), 2: _model(reference, 2), 5: _model(reference, 5)}
    ckpts = tmp_path / "ckpts"
    _publish(bootstrap, names, ckpts, 1, models[1].state_dict())
    n = _produce(bootstrap, names["raw"], events[:400], malformed=0.05)
    t0 = time.monotonic()
    proc = _scorer(bootstrap, names, dataset, tmp_path / "run")
    log = tmp_path / "run" / "scorer.log"
    try:
        preds, dead = _wait_covered(bootstrap, names, n, proc, log)
        say(f"\nscoring: first {n} events scored {time.monotonic() - t0:.1f} s after the scorer started")
        assert {p["model_version"] for p in preds} == {1}

        # version 2 while the pipeline runs: scored with it within a bound, without a restart, and
        # once it serves, every newer event gets it (never version 1 again)
        feed = _Feed(bootstrap, names, events, start=n)
        t_pub2 = _publish(bootstrap, names, ckpts, 2, models[2].state_dict())
        t_seen2 = feed.until(lambda p, _: any(r["model_version"] == 2 for r in p), proc, log, within_s=BOUND_S)
        say(f"scoring: version 2 served {t_seen2 - t_pub2:.1f} s after its publication")
        preds, dead = _wait_covered(bootstrap, names, feed.n, proc, log)
        assert {p["model_version"] for p in preds if p["event_time"].timestamp() > t_seen2} == {2}

        # corrupt versions are rejected (logged with the reason); version 2 keeps serving
        t_bad = _publish(bootstrap, names, ckpts, 3, models[1].state_dict(), corrupt="truncated")
        from flowtrain.train.model import TabularMLP

        data = reference["data"]  # the weights of another architecture than the one it names
        _publish(bootstrap, names, ckpts, 4, TabularMLP(data.n_numeric, data.cardinalities, hidden=(8,)).state_dict())
        feed.until(lambda _, text: "model version 4 published at" in text, proc, log, within_s=BOUND_S)
        text = log.read_text()
        assert "model version 3 published at" in text and "rejected: ValueError" in text and "checksum" in text
        assert "Error(s) in loading state_dict" in text and "; serving version 2" in text

        # ... and the next good version is still picked up
        t_pub5 = _publish(bootstrap, names, ckpts, 5, models[5].state_dict())
        t_seen5 = feed.until(lambda p, _: any(r["model_version"] == 5 for r in p), proc, log, within_s=BOUND_S)
        preds, dead = _wait_covered(bootstrap, names, feed.n, proc, log)
        n = feed.n
        assert {p["model_version"] for p in preds if t_bad <= p["event_time"].timestamp() < t_pub5} == {2}
        assert {p["model_version"] for p in preds if p["event_time"].timestamp() > t_seen5} == {5}
    finally:
        _stop(proc)
    assert proc.returncode == 0, log.read_text()[-3000:]

    # every prediction equals flowtrain's forward of the version it names, on the same features
    expected = _expected(bootstrap, names, reference, models)
    diffs = [abs(p["prediction"] - expected[p["source"]][p["model_version"]]) for p in preds]
    assert len(diffs) == len(preds) and max(diffs) <= 1e-6

    # counts: every raw event is exactly one prediction or one dead letter (no restart here)
    raw = [f"{m.topic}/{m.partition}/{m.offset}" for m in _read(bootstrap, names["raw"])]
    assert len(raw) == n
    scored = [p["source"] for p in preds]
    rejected = [d["source"] for d in dead]
    assert sorted(scored + rejected) == sorted(raw)
    assert len(set(scored)) == len(scored) and not set(scored) & set(rejected)
    assert set(expected) == set(scored)  # the scorer rejected exactly what the feature code rejects
    reasons = {d["reason"].split(":")[0] for d in dead}
    assert {"broken JSON", "wrong type"} <= reasons


@_apply(live)
def test_scorer_killed_and_restarted_scores_every_event_at_least_once(bootstrap, dataset, events, reference,
                                                                     tmp_path, say):
    """At least once, precisely: after kill -9 and a restart from the committed offsets, every raw
    event has a prediction or a dead letter, and only events at or after the offsets committed at
    the kill are there twice."""
    names = _names()
    from connectors.kafka import ensure_topic

    ensure_topic(bootstrap, names["raw"], partitions=2)
    ensure_topic(bootstrap, names["updates"])
    _publish(bootstrap, names, tmp_path / "ckpts", 1, _model(reference, 1).state_dict())
    n = _produce(bootstrap, names["raw"], events[:600], malformed=0.02)
    proc = _scorer(bootstrap, names, dataset, tmp_path / "run")
    log = tmp_path / "run" / "scorer.log"
    feed = _Feed(bootstrap, names, events, start=n)
    try:
        # events keep arriving; kill -9 once the first offsets are committed: some events are
        # scored but not committed, others read but not scored, others not read yet
        feed.until(lambda *_: sum(_committed(bootstrap, names).values()) > 0, proc, log, within_s=120, then_s=0)
        n = feed.n + _produce(bootstrap, names["raw"], events[feed.n:feed.n + 40])  # in flight at the kill
        _stop(proc, signal.SIGKILL)
        committed = _committed(bootstrap, names)
        assert sum(committed.values()) < n
        n += _produce(bootstrap, names["raw"], events[n:n + 300])
        proc = _scorer(bootstrap, names, dataset, tmp_path / "run")
        preds, dead = _wait_covered(bootstrap, names, n, proc, log)
        deadline = time.monotonic() + 60  # the last commits follow the last writes
        while sum(_committed(bootstrap, names).values()) < n and time.monotonic() < deadline:
            time.sleep(0.5)
        assert sum(_committed(bootstrap, names).values()) == n, \
            f"committed {_committed(bootstrap, names)} of {n} events\n{log.read_text()[-3000:]}"
    finally:
        _stop(proc)
    raw = {f"{m.topic}/{m.partition}/{m.offset}" for m in _read(bootstrap, names["raw"])}
    sources = [p["source"] for p in preds] + [d["source"] for d in dead]
    assert set(sources) == raw and len(raw) == n  # nothing lost
    twice = {s for s in sources if sources.count(s) > 1}
    assert all(int(s.rsplit("/", 1)[1]) >= committed[int(s.split("/")[1])] for s in twice)
    say(f"\nscoring: kill -9 with offsets {committed} committed; after the restart {len(twice)} of {n} events "
        f"were scored twice, all at or after those offsets")


# --- the pieces, without a runner ----------------------------------------------------------------
def test_scored_ranges_commit_only_a_contiguous_prefix_and_skip_offsets_without_records():
    from pipelines.flights.scoring import ScoredRanges

    asked = []

    def first_record_at(offset):  # the log: offsets 0..19 and 25..40 hold records
        asked.append(offset)
        return offset if offset < 20 else max(offset, 25)

    r = ScoredRanges(0)
    assert not r.add(5, 9, first_record_at) and r.next == 0  # 0..4 still being scored
    assert not r.add(10, 14, first_record_at) and r.next == 0
    assert asked == [0]  # asked once for position 0
    assert r.add(0, 4, first_record_at) and r.next == 15  # the prefix closes: 0..14
    assert r.add(15, 19, first_record_at) and r.next == 20
    assert r.add(25, 30, first_record_at) and r.next == 31  # 20..24 hold no record: skipped
    assert not r.add(3, 8, first_record_at) and r.next == 31  # a range scored again (a restart) changes nothing
    r2 = ScoredRanges(100)  # a restart from a committed offset
    assert r2.add(100, 150, first_record_at) and r2.next == 151


def test_version_tracker_serves_the_newest_valid_version_and_rejects_bad_ones(dataset, reference, tmp_path, caplog):
    from flowtrain.train.published import LoadPublishedVersion
    from pipelines.flights.scoring import VersionTracker

    ckpts = tmp_path / "ckpts"
    paths = {}
    for v in (1, 2, 3):
        from flowtrain.train import checkpoint

        paths[v] = str(checkpoint.save(ckpts, v, {"model": _model(reference, v).state_dict(), "version": v,
                                                  "architecture": ARCH}, keep=0))
    Path(paths[3]).write_bytes(Path(paths[3]).read_bytes()[:100])  # torn after its checksum was written

    def rec(v, path=None):
        return f"upd/0/{v}", json.dumps({"version": v, "checkpoint": path or paths[v]}).encode()

    tracker = VersionTracker(LoadPublishedVersion(dataset))
    assert tracker.offer([rec(1)]) and tracker.current.version == 1
    with caplog.at_level("WARNING", logger="pipelines.flights.scoring"):
        assert tracker.offer([rec(2), rec(3), ("upd/0/9", b"{not json")])  # 3 is newest but corrupt
    assert tracker.current.version == 2
    reasons = {r["version"]: r["reason"] for r in tracker.rejected}
    assert "checksum" in reasons[3] and "not a model-update record" in reasons[None]
    assert "model version 3 published at upd/0/3 rejected" in caplog.text and "; serving version 2" in caplog.text
    assert not tracker.offer([rec(1)]) and tracker.current.version == 2  # never back to an older one
    assert "not newer than the serving version 2" in tracker.rejected[-1]["reason"]
    assert not tracker.offer([rec(3)])  # a rejected version is not tried again
    assert tracker.offer([rec(4, paths[1])]) is False  # the record says 4, the checkpoint holds 1
    assert "checkpoint holds version 1" in tracker.rejected[-1]["reason"]


def test_model_handler_scores_arrow_batches_in_one_forward_and_never_rolls_back(dataset, reference, events,
                                                                               tmp_path):
    import pyarrow as pa

    from connectors.kafka import KafkaRecord
    from flowtrain.train import checkpoint
    from flowtrain.train.loader import table_to_split
    from flowtrain.train.published import LoadPublishedVersion
    from pipelines.flights.scoring import FlowtrainModelHandler, featurize_records

    models = {v: _model(reference, v) for v in (1, 2)}
    paths = {v: str(checkpoint.save(tmp_path, v, {"model": m.state_dict(), "version": v, "architecture": ARCH},
                                    keep=0)) for v, m in models.items()}
    data = reference["data"]
    batches = []
    for lo in (0, 70, 130):  # three micro-batches of different sizes
        records = [KafkaRecord("raw", 0, i, 1_700_000_000_000 + i, None, json.dumps(e).encode())
                   for i, e in enumerate(events[lo:lo + 60 + lo // 10], start=lo)]
        batches.append(featurize_records(records, reference["featurizer"])[0])
    handler = FlowtrainModelHandler(LoadPublishedVersion(dataset), paths[1], data.spec)
    served = handler.load_model()
    results = list(handler.run_inference(batches, served))
    assert [r.model_id for r in results] == ["1"] * 3
    for b, r in zip(batches, results):
        split = table_to_split(pa.Table.from_batches([b.features]), data.spec)
        with torch.no_grad():
            want = torch.sigmoid(models[1](split.x_num, split.x_cat)).numpy()
        assert len(r.inference[0]) == b.features.num_rows and np.abs(r.inference[0] - want).max() <= 1e-6
    handler.update_model_path(paths[2])
    assert handler.load_model().version == 2
    handler.update_model_path(paths[1])  # an older version named again (a late window): not served
    assert handler.load_model().version == 2
    handler.update_model_path(str(tmp_path / "gone.pt"))  # unloadable: the newest loaded one keeps serving
    assert handler.load_model().version == 2


def test_serving_line_shows_the_serving_version_and_online_accuracy(tmp_path):
    from flowtrain.cli.score import serving_line

    now = time.time()
    (tmp_path / "score-status.json.predictions.1-1").write_text(json.dumps(
        {"predictions": 100, "labelled": 100, "correct": 70, "version": 3, "time": now - 5}))
    (tmp_path / "score-status.json.predictions.1-2").write_text(json.dumps(
        {"predictions": 100, "labelled": 100, "correct": 80, "version": 4, "time": now}))
    (tmp_path / "score-status.json.versions.1-3").write_text(json.dumps(
        {"version": 4, "rejected": [{"version": 5, "reason": "x"}], "time": now}))
    assert serving_line(tmp_path) == "serving v4 | online acc 0.750 (200 labelled) | rejected versions 1"
    assert serving_line(tmp_path / "none") == "serving - | online acc - (0 labelled)"

"""Authenticated model updates and published-version retention (#22 items 8 and 9), without a runner:
the trainer's ``Publisher`` signs versions, the scorer's ``VersionTracker`` believes only what it
can authenticate, reads only bounded regular files, orders versions per trainer run, and keeps
its own copy of what it serves; the model handler falls back to the newest valid copy."""
from __future__ import annotations

import dataclasses
import json
import os
import threading
from pathlib import Path

import pytest
import torch

from connectors.kafka import KafkaTarget, Topics

pytestmark = [pytest.mark.timeout(300)]
KEY = b"k" * 32
ARCH = {"kind": "mlp", "hidden": [8], "dropout": 0.0, "seed": 0}


@pytest.fixture(scope="module")
def dataset(shared_data) -> str:
    return shared_data.regression_dataset(rows=600)


def _weights(dataset: str, seed: int) -> dict:
    from flowtrain.train.loader import TabularDataset
    from flowtrain.train.models import Architecture

    model = Architecture.from_dict(ARCH, "test").build(TabularDataset(dataset))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return model.state_dict()


class _Topic:
    """An updates topic's records as the tracker reads them (publication order = offset)."""

    def __init__(self):
        self.records = []

    def add(self, value: bytes | dict):
        value = value if isinstance(value, bytes) else json.dumps(value).encode()
        n = len(self.records)
        self.records.append((f"upd/0/{n}", value, (1_700_000_000_000 + n, 0, n)))
        return self.records[-1]


def _key_source(tmp_path: Path, key: bytes = KEY):
    from connectors.model_updates import UpdateKeySource

    path = tmp_path / "update.key"
    path.write_bytes(key + b"\n")
    path.chmod(0o600)  # a secret: only its owner reads it
    path.chmod(0o600)  # a key only its owner may read (a group- or world-readable one is refused)
    return UpdateKeySource.from_options(str(path))


def _publisher(run: Path, *, keep=10, key_source=None):
    from flowtrain.train.published import Publisher

    return Publisher(run, keep=keep, key_source=key_source)


def _publish(pub, dataset, version: int, run_id: str) -> dict:
    return pub.publish(model=_weights(dataset, version), architecture=ARCH, version=version, step=version,
                       run_id=run_id, time=1.5)


def _tracker(dataset, tmp_path, key: bytes | None = KEY, **kw):
    from flowtrain.train.published import LoadPublishedVersion
    from pipelines.serving.versions import ModelCache, VersionTracker

    return VersionTracker(LoadPublishedVersion(dataset), key=key, cache=ModelCache(tmp_path / "cache", 3), **kw)


def test_signed_versions_serve_and_forged_unsigned_missigned_fifo_oversized_are_rejected(dataset, tmp_path):
    from connectors.model_updates import sign_record

    pub = _publisher(tmp_path / "run", key_source=_key_source(tmp_path))
    topic = _Topic()
    topic.add(_publish(pub, dataset, 1, "runA"))
    tracker = _tracker(dataset, tmp_path, max_model_bytes=50_000)
    assert tracker.offer(topic.records) and (tracker.current.version, tracker.current.run_id) == (1, "runA")

    real2 = _publish(pub, dataset, 2, "runA")
    copied = tmp_path / "copied.pt"  # a valid checkpoint copied elsewhere, named with a huge version
    copied.write_bytes(Path(real2["checkpoint"]).read_bytes())
    forged = {**real2, "version": 2 ** 62, "checkpoint": str(copied)}
    fifo = tmp_path / "fifo.pt"
    os.mkfifo(fifo)
    big = tmp_path / "big.pt"
    big.write_bytes(b"x" * 100_000)
    records = [
        {k: v for k, v in forged.items() if k != "signature"},  # unsigned
        forged,  # its signature was made for version 2: mis-signed
        sign_record({k: v for k, v in forged.items() if k != "signature"}, b"another key of 32 bytes........."),
        sign_record({**real2, "version": 3, "checkpoint": str(fifo)}, KEY),  # signed, but a FIFO
        sign_record({**real2, "version": 4, "checkpoint": str(big), "bytes": 100_000}, KEY),  # over the bound
        json.dumps({**real2, "pad": "x" * 70_000}).encode(),  # an oversized record
        sign_record({**real2, "version": 5, "sha256": "0" * 64}, KEY),  # digest of another file
        b"\xff not json",
    ]
    for r in records:
        topic.add(r)
    done = threading.Event()
    result = {}

    def offer():
        result["changed"] = tracker.offer(topic.records)
        done.set()

    threading.Thread(target=offer, daemon=True).start()
    assert done.wait(60), "the tracker hung (a FIFO path must never block it)"
    assert not result["changed"] and tracker.current.version == 1
    reasons = [r["reason"] for r in tracker.rejected]
    assert len(reasons) == len(records) == tracker.rejected_count
    assert reasons[0].startswith("unsigned") and reasons[1].startswith("bad signature")
    assert reasons[2].startswith("bad signature")
    assert any("is not a regular file" in r for r in reasons)
    assert any("does not match the record's sha256" in r for r in reasons)
    assert any("over the 65,536-byte bound" in r for r in reasons)  # the record
    assert any("big.pt has 100,000 bytes, over the 50,000-byte bound" in r for r in reasons)  # the file
    assert any("not a model-update record" in r for r in reasons)

    # the file bound: a separate tracker with a small bound rejects the real file by its size
    small = _tracker(dataset, tmp_path, max_model_bytes=100)
    assert not small.offer([topic.records[0]]) and "over the 100-byte bound" in small.rejected[0]["reason"]

    # the real next version still serves, and a replay of an older signed record is refused
    topic.add(real2)
    assert tracker.offer(topic.records) and tracker.current.version == 2
    topic.add(topic.records[0][1])
    assert not tracker.offer(topic.records) and tracker.current.version == 2
    assert "not newer than version 2 of its run runA" in tracker.rejected[-1]["reason"]


def test_another_runs_numbers_never_pin_the_scorer_across_restarts(dataset, tmp_path):
    key = _key_source(tmp_path)
    a, b = _publisher(tmp_path / "a", key_source=key), _publisher(tmp_path / "b", key_source=key)
    topic = _Topic()
    topic.add(_publish(a, dataset, 1, "runA"))
    tracker = _tracker(dataset, tmp_path)
    assert tracker.offer(topic.records) and tracker.current.run_id == "runA"
    topic.add(_publish(b, dataset, 2 ** 62, "runB"))  # another run with a huge number: it serves ...
    assert tracker.offer(topic.records) and tracker.current.version == 2 ** 62
    topic.add(_publish(a, dataset, 2, "runA"))  # ... and does not block run A's next version
    assert tracker.offer(topic.records) and (tracker.current.run_id, tracker.current.version) == ("runA", 2)
    restarted = _tracker(dataset, tmp_path / "restart")  # a scorer reading the whole topic again
    assert restarted.offer(topic.records) and (restarted.current.run_id, restarted.current.version) == ("runA", 2)
    assert restarted.rejected_count == 0


def test_without_a_key_updates_are_accepted_with_one_loud_warning(dataset, tmp_path, caplog):
    pub = _publisher(tmp_path / "run")  # no key: unsigned records
    topic = _Topic()
    topic.add(_publish(pub, dataset, 1, "r"))
    with caplog.at_level("WARNING", logger="pipelines.serving.versions"):
        tracker = _tracker(dataset, tmp_path, key=None)
        assert tracker.offer(topic.records)
        signed_only = _tracker(dataset, tmp_path / "k")
        assert not signed_only.offer(topic.records)
    assert caplog.text.count("MODEL UPDATES ARE NOT AUTHENTICATED") == 1
    assert signed_only.rejected[0]["reason"].startswith("unsigned")


def test_the_key_never_on_disk_and_too_short_a_key_is_an_error(dataset, tmp_path, monkeypatch):
    from connectors.model_updates import UpdateKeySource, check_record

    monkeypatch.setenv("FLOWTRAIN_UPDATE_KEY", KEY.decode())
    source = UpdateKeySource.from_options(None)
    run = tmp_path / "run"
    record = _publish(_publisher(run, key_source=source), dataset, 1, "r")
    assert check_record(json.dumps(record).encode(), KEY).signed
    for path in run.rglob("*"):
        assert not path.is_file() or KEY not in path.read_bytes(), path
    monkeypatch.setenv("FLOWTRAIN_UPDATE_KEY", "short")
    with pytest.raises(ValueError, match="FLOWTRAIN_UPDATE_KEY: the update key has 5 bytes"):
        _publisher(run, key_source=UpdateKeySource.from_options(None))


def test_published_versions_have_their_own_retention_and_the_scorer_its_own_copies(dataset, tmp_path):
    """#22.9: the trainer keeps only 2 published versions; the scorer's copy of the one it serves
    stays loadable, and a handler whose initial version is gone falls back to the newest valid copy."""
    from flowtrain.train.published import LoadPublishedVersion
    from pipelines.serving.handler import FlowtrainModelHandler
    from pipelines.serving.versions import ModelCache

    pub = _publisher(tmp_path / "run", keep=2, key_source=_key_source(tmp_path))
    topic = _Topic()
    topic.add(_publish(pub, dataset, 1, "r"))
    tracker = _tracker(dataset, tmp_path)
    tracker.offer(topic.records)
    first = tracker.current
    for v in range(2, 6):
        topic.add(_publish(pub, dataset, v, "r"))
    assert len(list((tmp_path / "run" / "published").glob("ckpt-*.pt"))) == 2
    assert not Path(json.loads(topic.records[0][1])["checkpoint"]).exists()  # the trainer pruned version 1
    from flowtrain.train.loader import TabularDataset

    spec = TabularDataset(dataset).spec
    handler = FlowtrainModelHandler(LoadPublishedVersion(dataset), first, spec, cache_dir=str(tmp_path / "cache"))
    assert handler.load_model().version.version == 1  # the scorer's copy of version 1
    tracker.offer(topic.records)
    assert tracker.current.version == 5
    assert [v.version for v in ModelCache(tmp_path / "cache").listed()] == [5, 1]  # the copies' retention
    Path(first.path).unlink()  # the initial copy gone too: a new handler serves the newest valid copy
    fresh = FlowtrainModelHandler(LoadPublishedVersion(dataset), first, spec, cache_dir=str(tmp_path / "cache"))
    assert fresh.load_model().version.version == 5


@pytest.mark.kafka
def test_the_online_trainer_signs_every_version_keeps_its_run_id_on_resume_and_prunes_published(
        bootstrap, new_topic, dataset, tmp_path):
    """`flowtrain stream train` with $FLOWTRAIN_UPDATE_KEY and --keep-published 2: every record
    verifies with the key and names its file's digest; a resumed run keeps its run id and numbers
    on; published/ keeps 2 versions; the key is in no file of the run and on no command line."""
    import subprocess
    import sys

    from connectors.model_updates import check_record, read_model_file
    from tests.integration.test_stream_trainer import _publish_features

    topic = new_topic(partitions=2)
    out = tmp_path / "train"
    argv = [sys.executable, "-m", "flowtrain.cli", "stream", "train", "--bootstrap", bootstrap, "--features-topic",
            topic, "--updates-topic", f"{topic}-updates", "--dataset", dataset, "--out", str(out),
            "--checkpoint-every", "3", "--checkpoint-seconds", "1000", "--idle-exit", "2", "--keep-published", "2",
            "--hidden", "8"]
    env = dict(os.environ, FLOWTRAIN_UPDATE_KEY=KEY.decode())

    def train(*extra):
        proc = subprocess.run(argv + list(extra), capture_output=True, text=True, timeout=240, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert KEY.decode() not in " ".join(argv) + proc.stdout + proc.stderr

    _publish_features(bootstrap, topic, dataset, partitions=2, rows=20, cycle=(0,))
    train()
    first = _records(bootstrap, f"{topic}-updates")
    _publish_features(bootstrap, topic, dataset, partitions=2, rows=20, cycle=(1,))  # new sources
    train()  # resumed from its checkpoint: the same run
    records = [check_record(r, KEY) for r in _records(bootstrap, f"{topic}-updates")]
    assert len(first) >= 4 and len(records) >= 2 * len(first) - 1
    assert all(r.signed for r in records) and len({r.run_id for r in records}) == 1
    assert [r.version for r in records] == list(range(1, len(records) + 1))
    assert len(list((out / "published").glob("ckpt-*.pt"))) == 2
    read_model_file(records[-1], 1 << 30)  # the newest file is there, with the digest its record names
    for path in out.rglob("*"):
        assert not path.is_file() or KEY not in path.read_bytes(), path
    with pytest.raises(Exception, match="bad signature"):
        check_record(_records(bootstrap, f"{topic}-updates")[0], b"x" * 32)


def _records(bootstrap: str, topic: str) -> list[bytes]:
    from kafka import KafkaConsumer, TopicPartition

    c = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    try:
        tp = TopicPartition(topic, 0)
        c.assign([tp])
        c.seek_to_beginning(tp)
        end = c.end_offsets([tp])[tp]
        out = []
        while c.position(tp) < end:
            out += [r.value for r in c.poll(timeout_ms=500).get(tp, [])]
        return out
    finally:
        c.close()


def test_a_version_with_another_architectures_weights_is_rejected_with_the_reason(dataset, tmp_path):
    from flowtrain.train.loader import TabularDataset
    from flowtrain.train.models import TabularMLP

    data = TabularDataset(dataset)
    pub = _publisher(tmp_path / "run", key_source=_key_source(tmp_path))
    topic = _Topic()
    topic.add(_publish(pub, dataset, 1, "r"))
    topic.add(pub.publish(model=TabularMLP(data.n_numeric, data.cardinalities, hidden=(3,)).state_dict(),
                          architecture=ARCH, version=2, step=2, run_id="r"))
    tracker = _tracker(dataset, tmp_path)
    assert tracker.offer(topic.records[:1]) and not tracker.offer(topic.records)
    assert tracker.current.version == 1 and "Error(s) in loading state_dict" in tracker.rejected[0]["reason"]


def test_item7_a_replayed_old_signed_record_never_rolls_a_restarted_scorer_back(dataset, tmp_path):
    """#28.7: a byte-identical re-send of a legitimately signed old record (version 1 after 4) is
    published later on Kafka, but its signed sequence is old: a restarted scorer starts with
    version 4, a running one rejects the replay; a replay of another run's record never displaces
    the run published after it."""
    from connectors.model_updates import check_record

    key = _key_source(tmp_path)
    a = _publisher(tmp_path / "a", key_source=key)
    topic = _Topic()
    published = [_publish(a, dataset, v, "runA") for v in (1, 2, 3, 4)]
    checked = [check_record(json.dumps(r).encode(), KEY) for r in published]
    assert all(c.signed and c.run_id == "runA" for c in checked)
    assert [c.sequence for c in checked] == sorted({c.sequence for c in checked})  # strictly increasing
    for r in published:
        topic.add(r)
    running = _tracker(dataset, tmp_path / "running")
    assert running.offer(topic.records) and running.current.version == 4
    topic.add(published[0])  # the replay: the same bytes, a new Kafka offset and timestamp
    assert topic.records[-1][1] == topic.records[0][1]
    restarted = _tracker(dataset, tmp_path / "restarted")  # a scorer reading the whole topic at start
    assert restarted.offer(topic.records) and (restarted.current.run_id, restarted.current.version) == ("runA", 4)
    assert not running.offer(topic.records) and running.current.version == 4
    assert "not newer than version 4 of its run runA" in running.rejected[-1]["reason"]

    # another run published after run A's version 4; then run A's version 4 re-sent
    b = _publisher(tmp_path / "b", key_source=key)
    topic.add(_publish(b, dataset, 1, "runB"))
    assert running.offer(topic.records) and (running.current.run_id, running.current.version) == ("runB", 1)
    topic.add(published[3])
    again = _tracker(dataset, tmp_path / "again")
    assert again.offer(topic.records) and (again.current.run_id, again.current.version) == ("runB", 1)
    assert not running.offer(topic.records) and running.current.run_id == "runB"
    assert running.rejected[-1]["kind"] == "stale" and "a replayed or stale record" in running.rejected[-1]["reason"]


def test_item11_a_record_whose_file_is_gone_loads_the_scorers_own_copy(dataset, tmp_path):
    """#28.11, the tracker: the trainer's published/ is gone; the scorer's copy (named by the
    record's digest, which the signed record authenticates) loads."""
    import shutil

    pub = _publisher(tmp_path / "run", key_source=_key_source(tmp_path))
    topic = _Topic()
    for v in (1, 2):
        topic.add(_publish(pub, dataset, v, "r"))
    first = _tracker(dataset, tmp_path)
    assert first.offer(topic.records) and first.current.version == 2
    shutil.rmtree(tmp_path / "run" / "published")
    restarted = _tracker(dataset, tmp_path)  # the same scorer --out: its cache
    assert restarted.offer(topic.records) and restarted.current.version == 2
    assert restarted.current.path == first.current.path and restarted.rejected_count == 0


@pytest.mark.kafka
def test_item11_a_restarted_scorer_whose_trainers_published_is_gone_starts_from_its_stored_version(
        bootstrap, new_topic, dataset, tmp_path):
    """#28.11, the start-up wait (`wait_for_version`, on the real broker): the trainer's published/
    is gone and the copy of the newest version was pruned from the scorer's cache; the scorer starts
    at once with the newest valid version it stored instead of failing with "no valid model version"."""
    import shutil

    from flowtrain.train.loader import TabularDataset
    from flowtrain.train.published import LoadPublishedVersion
    from pipelines.serving.config import ScoreConfig
    from pipelines.serving.updates import wait_for_version
    from pipelines.serving.versions import ModelCache
    from tests.scoring_helpers import send

    topic = new_topic(partitions=1, prefix="upd")
    key = _key_source(tmp_path)
    pub = _publisher(tmp_path / "run", key_source=key)
    cfg = ScoreConfig(kafka=KafkaTarget(bootstrap), load_version=LoadPublishedVersion(dataset),
                      spec=TabularDataset(dataset).spec, update_key=key,
                      topics=Topics(raw="unused-raw", predictions="unused-predictions", updates=topic,
                                    dead_letters="unused-dead-letters"),
                      model_cache_dir=str(tmp_path / "scorer" / "models"), keep_models=3)
    send(bootstrap, topic, json.dumps(_publish(pub, dataset, 1, "r")).encode())
    served, _ = wait_for_version(cfg, timeout_s=30)  # the first run of the scorer stores version 1
    assert served.version == 1
    send(bootstrap, topic, json.dumps(_publish(pub, dataset, 2, "r")).encode())
    shutil.rmtree(tmp_path / "run" / "published")  # the trainer's files: gone
    # version 2 was never copied by the scorer; version 1's copy is all it has
    assert [v.version for v in ModelCache(cfg.model_cache_dir).listed()] == [1]
    served, tracker = wait_for_version(cfg, timeout_s=10)  # before: TimeoutError after 10 s
    assert (served.version, served.run_id) == (1, "r") and Path(served.path).parent == Path(cfg.model_cache_dir)
    assert any("does not exist" in r["reason"] for r in tracker.rejected)  # version 2: said why

    empty = new_topic(partitions=1, prefix="upd")  # the records gone too (retention): the stored copy serves
    served, _ = wait_for_version(dataclasses.replace(cfg, topics=dataclasses.replace(cfg.topics, updates=empty)), timeout_s=10)
    assert served.version == 1

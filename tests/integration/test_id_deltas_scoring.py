"""Issue 32 item 3 end to end: the online trainer (`flowtrain stream train`) on a dataset with an ID column
publishes each version as the dense parameters + only the ID rows changed (a snapshot every --snapshot-every),
and the scorer (`flowtrain stream score`, Beam RunInference on Prism) applies them strictly in order: with a
delta lost on its updates topic it never applies the deltas after the gap, serves the next snapshot and the
deltas after it, and its tables end equal to the trainer's; a scorer starting late starts from the newest
snapshot on the topic plus the deltas after it (the files before it pruned by the trainer's retention)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from kafka import KafkaConsumer, KafkaProducer

import flowtrain
from connectors.arrow import encode_batch
from connectors.dataset import read_manifest
from connectors.id_deltas import decode
from connectors.id_keys import key_of
from connectors.kafka import KafkaTarget, Topics
from pipelines.stream.status import read_status
from tests.procs import stop_group
from tests.scoring_helpers import KEY, predictions, produce, scorer, topic_names
from tests.serving_checks import AFTER_S, send_events

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "flowtrain.cli"]
ENV = dict({k: v for k, v in os.environ.items() if k != "FLOWTRAIN_UPDATE_KEY"}, PYTHONPATH=str(ROOT))
NEW_USERS = [f"fresh-user-{i}" for i in range(40)]


@pytest.fixture(scope="module")
def id_batch(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("id-deltas")
    r = np.random.default_rng(2)
    lines = ["x1,user,y"]
    for _ in range(1200):
        u, x1 = int(min(r.zipf(1.3), 80)), r.normal()
        lines.append(f"{x1:.4f},user-{u},{int(x1 + (u % 2) * 2 - 1 + r.normal() * 0.3 > 0)}")
    (base / "clicks.csv").write_text("\n".join(lines) + "\n")
    flowtrain.batch(input=[str(base / "clicks.csv")], label="y", numeric=["x1"], id_columns=["user"],
                    task="classification", out=str(base / "run"), steps=20, batch_size=128, eval_every=10,
                    id_dim=4, hidden=(8,), no_progress=True)
    key_file = base / "update.key"
    key_file.write_bytes(KEY)
    key_file.chmod(0o600)
    return {"run": base / "run", "dataset": base / "run" / "dataset", "key_file": str(key_file)}


def _feature_messages(dataset: Path, rows: int = 40) -> list[bytes]:
    """The dataset's rows as feature messages, then rows of users the batch run never saw (new IDs: rows added)."""
    manifest = read_manifest(dataset)
    table = pa.concat_tables([pq.read_table(dataset / s["file"]) for split in ("train", "valid", "test")
                              for s in manifest["splits"][split]]).slice(0, 480)
    fresh = table.slice(0, 240)
    keys = [key_of(NEW_USERS[i % len(NEW_USERS)]) for i in range(fresh.num_rows)]
    fresh = fresh.set_column(fresh.schema.get_field_index("id__user"), "id__user", pa.array(keys, pa.int64()))
    table = pa.concat_tables([table, fresh])
    out = []
    for start in range(0, table.num_rows, rows):
        chunk = table.slice(start, rows).combine_chunks()
        chunk = chunk.append_column("src_partition", pa.array([0] * chunk.num_rows, pa.int32()))
        chunk = chunk.append_column("src_offset", pa.array(range(start, start + chunk.num_rows), pa.int64()))
        (batch,) = chunk.to_batches()
        out.append(encode_batch(batch))
    return out


def _send_features(bootstrap: str, topic: str, messages: list[bytes]) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    for value in messages:
        producer.send(topic, value=value, partition=0).get(timeout=30)
    producer.close()


def _trainer(bootstrap, features, updates, b: dict, out: Path, *extra) -> list[str]:
    return CLI + ["stream", "train", "--bootstrap", bootstrap, "--features-topic", features, "--updates-topic", updates,
                  "--dead-letter-topic", f"{features}-dead", "--dataset", str(b["dataset"]), "--out", str(out),
                  "--checkpoint-seconds", "1000", "--checkpoint-every", "1", "--snapshot-every", "3",
                  "--init-weights", str(b["run"] / "model.pt"), "--threads", "1", "--update-key-file",
                  b["key_file"], *extra]


def _records(bootstrap: str, topic: str, timeout_ms: int = 3000) -> list[dict]:
    consumer = KafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                             consumer_timeout_ms=timeout_ms, enable_auto_commit=False)
    try:
        return [json.loads(m.value) for m in consumer]
    finally:
        consumer.close()


def _trainer_table(out: Path) -> tuple[dict, dict]:
    """The trainer's newest checkpoint: its ID table (key -> row) and its dense weights."""
    ckpt = sorted((out / "checkpoints").glob("ckpt-*.pt"))[-1]
    model = torch.load(ckpt, weights_only=True)["model"]
    table = dict(zip(model["ids.0.table.keys"].tolist(), model["ids.0.table.weight"].numpy()))
    return table, {k: v.numpy() for k, v in model.items() if ".table." not in k}


def _assert_same_as_trainer(copy_path: str, out: Path, version: int) -> None:
    v = decode(Path(copy_path).read_bytes())
    assert (v.version, v.kind) == (version, "snapshot")
    table, dense = _trainer_table(out)
    served = dict(zip(v.tables["ids.0"].keys.tolist(), v.tables["ids.0"].rows))
    assert set(served) == set(table) and {key_of(u) for u in NEW_USERS} <= set(served)
    assert all(np.array_equal(served[k], table[k]) for k in table)
    assert set(v.dense) == set(dense) and all(np.array_equal(v.dense[k], dense[k]) for k in dense)


def _events(n: int, start: int = 0) -> list[dict]:
    r = np.random.default_rng(start)
    users = [f"user-{int(min(r.zipf(1.3), 80))}" if i % 3 else NEW_USERS[i % len(NEW_USERS)] for i in range(n)]
    return [{"reading_id": f"r-{start + i}", "x1": float(r.normal()), "user": users[i]} for i in range(n)]


def _held(run: Path) -> bool:
    """Whether the scorer's version tracker holds a delta (its status, written as it changes)."""
    return any((s.get("ids") or {}).get("held_now", 0) > 0 for s in read_status(str(run / "score-status.json"),
                                                                                   "versions"))


@pytest.mark.streaming
def test_id_deltas_scorer_with_a_lost_delta_never_applies_out_of_order_and_ends_equal_to_the_trainer(
        bootstrap, new_topic, id_batch, tmp_path):
    from connectors.kafka import ensure_topic

    names = topic_names()
    features = new_topic(partitions=1)
    for t in (names["raw"], names["updates"]):
        ensure_topic(bootstrap, t)
    trainer_updates = f"{features}-updates"
    messages = _feature_messages(id_batch["dataset"])  # 18 messages: one version each
    _send_features(bootstrap, features, messages[:2])
    out = tmp_path / "trainer"
    trainer = subprocess.Popen(_trainer(bootstrap, features, trainer_updates, id_batch, out, "--idle-exit", "20"),
                               stdout=open(tmp_path / "trainer.log", "wb"), stderr=subprocess.STDOUT, env=ENV,
                               start_new_session=True)
    proc = None
    relayed: list[dict] = []
    relay = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    source = KafkaConsumer(trainer_updates, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                           enable_auto_commit=False)
    lost = 5  # versions 1S 2D 3D 4S 5D 6D 7S ...: 5 is lost, so 6 has no base: held until the snapshot 7

    def forward_updates():
        for records in source.poll(timeout_ms=200).values():
            for m in records:
                rec = json.loads(m.value)
                relayed.append(rec)
                if rec["version"] != lost:
                    relay.send(names["updates"], m.value).get(timeout=30)

    try:
        deadline = time.monotonic() + 240
        while not relayed:
            forward_updates()
            assert trainer.poll() is None and time.monotonic() < deadline, (tmp_path / "trainer.log").read_text()
        run = tmp_path / "run"
        proc = scorer(bootstrap, names, str(id_batch["dataset"]), run, "--update-key-file", id_batch["key_file"])
        log = run / "scorer.log"
        n = produce(bootstrap, names["raw"], _events(60))
        sent = 2
        while trainer.poll() is None:  # the rest of the stream while the scorer serves
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()[-3000:]
            # the snapshot 7 (message 6) only once the scorer holds 6: the gap is then seen, not skipped over
            if sent < len(messages) and len(relayed) >= sent - 1 and (sent != 6 or _held(run)):
                _send_features(bootstrap, features, messages[sent:sent + 1])
                sent += 1
            forward_updates()
            if len(relayed) >= len(messages):  # every message trained and published: stop it (a final
                stop_group(trainer)  # checkpoint only if a step came after the last one: none)
                break
            n += produce(bootstrap, names["raw"], _events(10, start=n))
            time.sleep(0.3)
        assert trainer.returncode == 0, (tmp_path / "trainer.log").read_text()[-3000:]
        forward_updates()
        last = max(r["version"] for r in relayed)
        assert last >= 9
        # what users see (#42): every event sent 5 s after the last ID version's publication is scored with it
        time.sleep(AFTER_S + 0.5)
        burst = send_events(bootstrap, names["raw"], _events(100, start=n))
        n += len(burst)
        while not burst.keys() <= {p["pred_source"] for p in predictions(bootstrap, names["pred"])}:
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.5)
        carried = [p["pred_model_version"] for p in predictions(bootstrap, names["pred"]) if p["pred_source"] in burst]
        assert len(carried) == len(burst) and set(carried) == {last}, sorted(set(carried))
        statuses = read_status(str(run / "score-status.json"), "versions")  # one per worker process's reader
    finally:
        source.close()
        relay.close()
        if proc is not None:
            stop_group(proc)
        stop_group(trainer)
    kinds = {r["version"]: r["kind"] for r in relayed}
    assert [kinds[v] for v in range(1, 8)] == ["snapshot", "delta", "delta", "snapshot", "delta", "delta", "snapshot"]
    assert all(r["format"] == "flowtrain-id-delta/1" and "signature" in r for r in relayed)
    # a delta carries the rows its step touched (one message of 40 rows), not the table
    assert max(r["rows"]["ids.0"] for r in relayed if r["kind"] == "delta") <= 40
    assert max(r["rows"]["ids.0"] for r in relayed if r["kind"] == "snapshot") > 40
    # never out of order: 6 (whose base 5 was lost) was never served; the snapshot 7 and what followed were
    served = {p["pred_model_version"] for p in predictions(bootstrap, names["pred"])}
    assert lost not in served and 6 not in served and last in served
    assert any((s.get("ids") or {}).get("held", 0) >= 1 for s in statuses)  # counted in the scorer's status
    status = max(statuses, key=lambda s: s["time"])
    assert status["version"] == last and status["ids"]["held_now"] == 0
    _assert_same_as_trainer(status["path"], out, last)


def test_id_deltas_late_scorer_starts_from_the_newest_snapshot_and_the_deltas_after_it(
        bootstrap, new_topic, id_batch, tmp_path):
    from connectors.model_updates import UpdateKeySource
    from flowtrain.train.published import LoadPublishedVersion
    from pipelines.serving.config import ScoreConfig
    from pipelines.serving.updates import wait_for_version

    features = new_topic(partitions=1)
    updates = f"{features}-updates"
    messages = _feature_messages(id_batch["dataset"])
    messages = messages[:6] + messages[12:17]  # 11 versions, with users the batch run never saw
    _send_features(bootstrap, features, messages)
    out = tmp_path / "trainer"
    done = subprocess.run(_trainer(bootstrap, features, updates, id_batch, out, "--idle-exit", "3",
                                   "--keep-published", "2"), capture_output=True, text=True, timeout=300, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    records = _records(bootstrap, updates)
    assert [r["version"] for r in records] == list(range(1, 12))
    # the trainer keeps 2 payloads and every one from the newest snapshot (10) on
    assert sorted(p.name for p in (out / "published").glob("ids-*")) == [
        "ids-000000010-snapshot.safetensors", "ids-000000011-delta.safetensors"]
    # the scorer's start-up (flowtrain stream score waits for its first version so) on a fresh model cache
    cfg = ScoreConfig(kafka=KafkaTarget(bootstrap), load_version=LoadPublishedVersion(str(id_batch["dataset"])),
                      spec=None, topics=Topics(raw="-", predictions="-", dead_letters="-", updates=updates),
                      update_key=UpdateKeySource.from_options(id_batch["key_file"]),
                      model_cache_dir=str(tmp_path / "late" / "models"))
    version, tracker = wait_for_version(cfg, timeout_s=60)
    assert version.version == 11
    assert tracker.rejected_count == 0, tracker.rejected  # the pruned versions before the snapshot never read
    status = tracker.ids_status()
    assert status["superseded"] == 9 and status["applied"] == 2 and status["held"] == 0
    _assert_same_as_trainer(version.path, out, 11)
    model, loaded = LoadPublishedVersion(str(id_batch["dataset"]))(version.path, version.sha256)
    assert loaded == 11 and len(model.ids["0"].table) == len(_trainer_table(out)[0])

"""Issue 32 item 3 with item 2: `flowtrain stream train --workers 2` on a dataset with an ID column (each table
sharded row-wise over the two replicas) publishes deltas, as one process does: every replica's rows added,
updated and evicted since the previous version, gathered to rank 0 and published as one delta, with a snapshot
of the whole table every --snapshot-every versions. The scorer's real version tracker and loader apply the
records in order and end with exactly the trainer's final checkpoint (the same rows, bit for bit: the same
floats travel)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
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
from flowtrain.train.ids import owner_of
from flowtrain.train.published import LoadPublishedVersion
from pipelines.serving.versions import ModelCache, UpdateMessage, VersionTracker

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]
ENV = dict({k: v for k, v in os.environ.items() if k != "FLOWTRAIN_UPDATE_KEY"}, PYTHONPATH=str(ROOT))
KEY = b"sharded-deltas-key-0123456789abc"
ROWS = 30  # rows per feature message


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory) -> dict:
    """A small batch run with one ID column whose rows expire after 150 events (the stream evicts rows)."""
    base = tmp_path_factory.mktemp("id-sharded-deltas")
    r = np.random.default_rng(11)
    lines = ["x1,user,y"]
    for _ in range(600):
        u, x1 = int(min(r.zipf(1.3), 60)), r.normal()
        lines.append(f"{x1:.4f},user-{u},{int(x1 + (u % 2) * 2 - 1 + r.normal() * 0.3 > 0)}")
    (base / "clicks.csv").write_text("\n".join(lines) + "\n")
    flowtrain.batch(input=[str(base / "clicks.csv")], label="y", numeric=["x1"], id_columns=["user"],
                    task="classification", out=str(base / "run"), steps=10, batch_size=128, eval_every=10,
                    id_dim=4, hidden=(8,), dropout=0.0, min_id_count=1, id_ttl=150, no_progress=True)
    key_file = base / "update.key"
    key_file.write_bytes(KEY)
    key_file.chmod(0o600)
    return {"run": base / "run", "dataset": base / "run" / "dataset", "key_file": str(key_file)}


def _messages(dataset: Path) -> list[pa.RecordBatch]:
    """The dataset's rows, then rows of users the batch run never saw (rows added while old ones expire)."""
    manifest = read_manifest(dataset)
    table = pa.concat_tables([pq.read_table(dataset / s["file"]) for split in ("train", "valid", "test")
                              for s in manifest["splits"][split]]).slice(0, 240)
    fresh = table.slice(0, 240)
    keys = [key_of(f"sharded-new-user-{i % 50}") for i in range(fresh.num_rows)]
    fresh = fresh.set_column(fresh.schema.get_field_index("id__user"), "id__user", pa.array(keys, pa.int64()))
    table = pa.concat_tables([table, fresh])
    return [table.slice(start, ROWS).combine_chunks().to_batches()[0] for start in range(0, table.num_rows, ROWS)]


def _send(bootstrap: str, topic: str, messages: list[pa.RecordBatch]) -> None:
    """Message i on feature partition i % 2, its rows' sources on the raw partition of that number in order."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    nxt = {0: 0, 1: 0}
    for i, batch in enumerate(messages):
        p = i % 2
        offsets = list(range(nxt[p], nxt[p] + batch.num_rows))
        nxt[p] += batch.num_rows
        batch = batch.append_column("src_partition", pa.array([p] * batch.num_rows, pa.int32()))
        batch = batch.append_column("src_offset", pa.array(offsets, pa.int64()))
        producer.send(topic, value=encode_batch(batch), partition=p).get(timeout=30)
    producer.close()


def _updates(bootstrap: str, topic: str) -> list[UpdateMessage]:
    consumer = KafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                             consumer_timeout_ms=3000, enable_auto_commit=False)
    try:
        return [UpdateMessage(f"{m.topic}/{m.partition}/{m.offset}", m.value, (m.timestamp, m.partition, m.offset))
                for m in consumer]
    finally:
        consumer.close()


def test_id_sharded_trainer_publishes_deltas_that_applied_in_order_equal_its_checkpoint(
        bootstrap, new_topic, sharded_run, tmp_path):
    topic = new_topic(partitions=2)
    _send(bootstrap, topic, _messages(sharded_run["dataset"]))
    out = tmp_path / "trainer"
    argv = [sys.executable, "-m", "flowtrain.cli", "stream", "train", "--bootstrap", bootstrap, "--features-topic",
            topic, "--updates-topic", f"{topic}-updates", "--dead-letter-topic", f"{topic}-dead", "--dataset",
            str(sharded_run["dataset"]), "--out", str(out), "--checkpoint-seconds", "1000", "--checkpoint-every", "1",
            "--snapshot-every", "3", "--init-weights", str(sharded_run["run"] / "model.pt"), "--idle-exit", "2",
            "--threads", "1", "--device", "cpu", "--failure-timeout", "60", "--workers", "2",
            "--update-key-file", sharded_run["key_file"]]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    messages = _updates(bootstrap, f"{topic}-updates")
    records = [json.loads(m.value) for m in messages]
    n = len(records)
    assert [r["version"] for r in records] == list(range(1, n + 1)) and n >= 6
    assert [r["kind"] for r in records[:6]] == ["snapshot", "delta", "delta", "snapshot", "delta", "delta"]
    # the deltas carry both replicas' rows (keys each rank owns), the rows evicted, and only the rows touched
    deltas = [decode(Path(r["checkpoint"]).read_bytes()).tables["ids.0"] for r in records if r["kind"] == "delta"]
    changed = np.concatenate([d.keys for d in deltas])
    assert set(owner_of(changed, 2).tolist()) == {0, 1}
    assert sum(len(d.evicted) for d in deltas) > 0
    assert max(r["rows"]["ids.0"] for r in records if r["kind"] == "delta") <= 2 * ROWS
    # the scorer's version tracker and loader, each record in the order read: every version applied in turn
    load = LoadPublishedVersion(str(sharded_run["dataset"]))
    tracker = VersionTracker(load, key=KEY, cache=ModelCache(tmp_path / "scorer" / "models"))
    for m in messages:
        tracker.offer([m])
    assert tracker.rejected_count == 0, tracker.rejected
    status = tracker.ids_status()
    assert status["applied"] == n and status["held"] == 0 and tracker.current.version == n
    # ... equal to the trainer's final checkpoint (the table whole, written after the last version's step)
    ckpt = torch.load(sorted((out / "checkpoints").glob("ckpt-*.pt"))[-1], weights_only=True)
    assert ckpt["version"] == n
    model = ckpt["model"]
    want = dict(zip(model["ids.0.table.keys"].tolist(), model["ids.0.table.weight"]))
    served, version = load(tracker.current.path, tracker.current.sha256)
    assert version == n
    table = served.ids["0"].table
    assert set(table.key_to_row) == set(want) and set(owner_of(np.asarray(list(want)), 2).tolist()) == {0, 1}
    assert all(torch.equal(table.weight[table.key_to_row[k]], row) for k, row in want.items())
    got = served.state_dict()
    dense = [k for k in model if ".table." not in k]
    assert dense and all(torch.equal(got[k], model[k]) for k in dense)

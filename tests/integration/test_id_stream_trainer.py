"""Issue 32 items 1, 2: the online trainer grows the batch run's ID tables with IDs first seen on the stream,
and the tables are in the checkpoint with the ledger: killed with SIGKILL and restarted, every row is trained
exactly once and the tables equal an uninterrupted run's."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from kafka import KafkaProducer

import flowtrain
from connectors.arrow import encode_batch
from connectors.dataset import read_manifest
from connectors.id_keys import key_of

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(420)]
ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "flowtrain.cli"]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))
NEW_USERS = [f"new-user-{i}" for i in range(30)]


@pytest.fixture(scope="module")
def id_run(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("id-stream")
    r = np.random.default_rng(1)
    lines = ["x1,user,y"]
    for _ in range(1500):
        u, x1 = int(min(r.zipf(1.3), 100)), r.normal()
        lines.append(f"{x1:.4f},user-{u},{int(x1 + (u % 2) * 2 - 1 + r.normal() * 0.3 > 0)}")
    (base / "clicks.csv").write_text("\n".join(lines) + "\n")
    flowtrain.batch(input=[str(base / "clicks.csv")], label="y", numeric=["x1"], id_columns=["user"],
                    task="classification", out=str(base / "run"), steps=30, batch_size=128, eval_every=15,
                    id_dim=4, hidden=(16,), no_progress=True)
    return base / "run"


def _publish(bootstrap: str, topic: str, dataset: Path, rows: int = 40) -> set:
    """The dataset's rows as feature messages, then rows of users the batch run never saw."""
    manifest = read_manifest(dataset)
    table = pa.concat_tables([pq.read_table(dataset / s["file"]) for split in ("train", "valid", "test")
                              for s in manifest["splits"][split]])
    table = table.slice(0, 600)
    fresh = table.slice(0, 300)
    keys = [key_of(NEW_USERS[i % len(NEW_USERS)]) for i in range(fresh.num_rows)]
    fresh = fresh.set_column(fresh.schema.get_field_index("id__user"), "id__user", pa.array(keys, pa.int64()))
    table = pa.concat_tables([table, fresh])
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    sources = set()
    for start in range(0, table.num_rows, rows):
        chunk = table.slice(start, rows).combine_chunks()
        offsets = list(range(start, start + chunk.num_rows))
        chunk = chunk.append_column("src_partition", pa.array([0] * chunk.num_rows, pa.int32()))
        chunk = chunk.append_column("src_offset", pa.array(offsets, pa.int64()))
        (batch,) = chunk.to_batches()
        producer.send(topic, value=encode_batch(batch), partition=0).get(timeout=30)
        sources.update((0, o) for o in offsets)
    producer.close()
    return sources


def _argv(bootstrap, topic, dataset, run: Path, out: Path, idle: str) -> list[str]:
    return CLI + ["stream", "train", "--bootstrap", bootstrap, "--features-topic", topic, "--updates-topic",
                  f"{topic}-updates", "--dataset", str(dataset), "--out", str(out), "--ledger",
                  "--checkpoint-seconds", "1000", "--checkpoint-every", "3", "--init-weights", str(run / "model.pt"),
                  "--idle-exit", idle, "--threads", "1"]


def _table(out: Path) -> dict:
    ckpt = sorted((out / "checkpoints").glob("ckpt-*.pt"))[-1]
    model = torch.load(ckpt, weights_only=True)["model"]
    return dict(zip(model["ids.0.table.keys"].tolist(), model["ids.0.table.weight"]))


def _step(out: Path) -> int:
    try:
        return json.loads((out / "trainer-status.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return 0


def test_id_stream_trainer_grows_tables_exactly_once_under_sigkill(bootstrap, new_topic, id_run, tmp_path):
    dataset = id_run / "dataset"
    topic = new_topic(partitions=1)
    sources = _publish(bootstrap, topic, dataset)
    # uninterrupted
    whole = tmp_path / "whole"
    proc = subprocess.run(_argv(bootstrap, topic, dataset, id_run, whole, "3"), capture_output=True, text=True,
                          timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = _table(whole)
    assert {key_of(u) for u in NEW_USERS} <= set(table)  # IDs first seen on the stream got rows
    # killed with SIGKILL after a few checkpoints, restarted
    crashed = tmp_path / "crashed"
    run = subprocess.Popen(_argv(bootstrap, topic, dataset, id_run, crashed, "30"), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=ENV, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and _step(crashed) < 7 and run.poll() is None:
            time.sleep(0.05)
        os.killpg(run.pid, signal.SIGKILL)
        run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait(timeout=10)
    again = subprocess.run(_argv(bootstrap, topic, dataset, id_run, crashed, "3"), capture_output=True, text=True,
                           timeout=300, env=ENV)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from ckpt-" in again.stdout
    counts: dict = {}
    for line in (crashed / "ledger.jsonl").read_text().splitlines():
        r = json.loads(line)
        counts[(r["partition"], r["offset"])] = counts.get((r["partition"], r["offset"]), 0) + 1
    assert set(counts) == sources and set(counts.values()) == {1}
    resumed = _table(crashed)
    assert set(resumed) == set(table)
    assert max(float((resumed[k] - table[k]).abs().max()) for k in table) <= 1e-5

"""Issue 32 item 2 on the stream: `flowtrain stream train --workers 2` on a dataset with ID columns shards each
ID table row-wise over the replicas (the rank `key mod 2` owns a key's row; lookups and gradients by all-to-all),
checkpoints each table whole with the ledger, trains every row exactly once across SIGKILL and a restart, equals
one process, and resumes on another number of workers."""
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
from connectors.id_keys import BAD_KEYS, key_of, reason_counts
from flowtrain.train.ids import owner_of
from tests.procs import worker_pids

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(420)]
ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "flowtrain.cli"]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))
NEW_USERS = [f"stream-user-{i}" for i in range(40)]
ROWS = 30  # rows per feature message: one message per replica and step


@pytest.fixture(scope="module")
def id_run(tmp_path_factory) -> Path:
    """A small batch run with one ID column (every ID gets a row at its first sight: --min-id-count 1)."""
    base = tmp_path_factory.mktemp("id-workers")
    r = np.random.default_rng(7)
    lines = ["x1,user,y"]
    for _ in range(900):
        u, x1 = int(min(r.zipf(1.3), 80)), r.normal()
        lines.append(f"{x1:.4f},user-{u},{int(x1 + (u % 2) * 2 - 1 + r.normal() * 0.3 > 0)}")
    (base / "clicks.csv").write_text("\n".join(lines) + "\n")
    flowtrain.batch(input=[str(base / "clicks.csv")], label="y", numeric=["x1"], id_columns=["user"],
                    task="classification", out=str(base / "run"), steps=10, batch_size=128, eval_every=10,
                    id_dim=4, hidden=(16,), dropout=0.0, min_id_count=1, no_progress=True)
    return base / "run"


def _messages(dataset: Path) -> list[pa.RecordBatch]:
    """The dataset's rows, then as many again with users the batch run never saw, as feature messages."""
    manifest = read_manifest(dataset)
    table = pa.concat_tables([pq.read_table(dataset / s["file"]) for split in ("train", "valid", "test")
                              for s in manifest["splits"][split]]).slice(0, 360)
    fresh = table.slice(0, 240)
    keys = [key_of(NEW_USERS[i % len(NEW_USERS)]) for i in range(fresh.num_rows)]
    fresh = fresh.set_column(fresh.schema.get_field_index("id__user"), "id__user", pa.array(keys, pa.int64()))
    table = pa.concat_tables([table, fresh])
    # every 13th row's ID value had no key (the stream pipeline gives it its reason's reserved key): the fallback
    keys = table.column("id__user").to_numpy().copy()
    kinds = list(BAD_KEYS)
    for j, i in enumerate(range(0, len(keys), 13)):
        keys[i] = BAD_KEYS[kinds[j % len(kinds)]]
    table = table.set_column(table.schema.get_field_index("id__user"), "id__user", pa.array(keys, pa.int64()))
    return [table.slice(start, ROWS).combine_chunks().to_batches()[0] for start in range(0, table.num_rows, ROWS)]


def _bad(messages: list[pa.RecordBatch]) -> dict:
    """The rows without a key, as the trainer's status counts them ("user: <reason>")."""
    counts: dict = {}
    for m in messages:
        for kind, n in reason_counts(m.column("id__user").to_numpy()).items():
            counts[f"user: {kind}"] = counts.get(f"user: {kind}", 0) + n
    return counts


def _send(bootstrap: str, topic: str, messages: list[pa.RecordBatch], partitions: list[int],
          next_offset: dict | None = None) -> set:
    """Message i on feature partition ``partitions[i % len(partitions)]``, its rows' sources on the raw partition
    of the same number in offset order (as the stream pipeline writes them); returns the sources sent."""
    next_offset = {} if next_offset is None else next_offset
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    sources = set()
    for i, batch in enumerate(messages):
        p = partitions[i % len(partitions)]
        start = next_offset.get(p, 0)
        offsets = list(range(start, start + batch.num_rows))
        next_offset[p] = start + batch.num_rows
        batch = batch.append_column("src_partition", pa.array([p] * batch.num_rows, pa.int32()))
        batch = batch.append_column("src_offset", pa.array(offsets, pa.int64()))
        producer.send(topic, value=encode_batch(batch), partition=p).get(timeout=30)
        sources.update((p, o) for o in offsets)
    producer.close()
    return sources


def _argv(bootstrap, topic, run: Path, out: Path, idle: str, *extra: str) -> list[str]:
    return CLI + ["stream", "train", "--bootstrap", bootstrap, "--features-topic", topic, "--updates-topic",
                  f"{topic}-updates", "--dead-letter-topic", f"{topic}-dead", "--dataset", str(run / "dataset"),
                  "--out", str(out), "--ledger", "--checkpoint-seconds", "1000", "--checkpoint-every", "3",
                  "--init-weights", str(run / "model.pt"), "--idle-exit", idle, "--threads", "1", "--device", "cpu",
                  "--failure-timeout", "60", *extra]


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _kill_after(argv: list[str], out: Path, steps: int) -> None:
    """Start ``argv`` (two workers) and SIGKILL both worker processes once ``steps`` steps are trained; the
    launcher then ends the job as failed."""
    run = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                           start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and _step(out) < steps and run.poll() is None:
            time.sleep(0.05)
        pids = worker_pids(str(out / "workers" / "job.json"))
        assert set(pids) == {0, 1}, f"workers not found ({pids}); {run.poll()}"
        for pid in pids.values():
            os.kill(pid, signal.SIGKILL)
        _, err = run.communicate(timeout=120)
        assert run.returncode != 0 and "killed by SIGKILL" in err, err[-3000:]
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait(timeout=10)


def _step(out: Path) -> int:
    try:
        return json.loads((out / "trainer-status.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return 0


def _final(out: Path) -> dict:
    return torch.load(sorted((out / "checkpoints").glob("ckpt-*.pt"))[-1], weights_only=True)["model"]


def _rows(model: dict) -> dict:
    return dict(zip(model["ids.0.table.keys"].tolist(), model["ids.0.table.weight"]))


def _exactly_once(out: Path, sources: set) -> None:
    counts: dict = {}
    for line in (out / "ledger.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "partition" in r:
            counts[(r["partition"], r["offset"])] = counts.get((r["partition"], r["offset"]), 0) + 1
    assert set(counts) == sources, f"{len(sources - set(counts))} rows never trained"
    assert set(counts.values()) == {1}, "rows trained twice"


def test_id_stream_two_workers_sigkill_restart_exactly_once_equals_one_process(bootstrap, new_topic, id_run,
                                                                             tmp_path):
    """First every feature message on partition 0 of a two-partition topic: replica 0 reads them all, replica 1
    none, but it owns the rows of the keys that hash to it, so every step of two workers is one process's step
    (the dense gradient is replica 0's sum plus replica 1's zeros: equal by construction, not by luck) while half
    the table lives on rank 1 and travels by all-to-all. Killed with SIGKILL after 7 steps and restarted on ONE
    worker (the checkpoint holds each table whole): every row exactly once, and the end equals one process's.
    Then more messages on both partitions and the run resumed on two workers again: each replica trains its own
    rows against the sharded tables, every row still exactly once."""
    topic = new_topic(partitions=2)
    messages = _messages(id_run / "dataset")
    sent: dict = {}
    first = messages[:14]
    sources = _send(bootstrap, topic, first, [0], sent)
    one = tmp_path / "one"
    _run(_argv(bootstrap, topic, id_run, one, "2"))
    want = _final(one)
    out = tmp_path / "two"
    _kill_after(_argv(bootstrap, topic, id_run, out, "60", "--workers", "2"), out, 7)
    again = _run(_argv(bootstrap, topic, id_run, out, "2"))
    assert "resumed from ckpt-" in again.stdout
    _exactly_once(out, sources)
    assert json.loads((out / "trainer-status.json").read_text())["id_fallbacks"] == _bad(first)
    got = _final(out)
    rows_w, rows_g = _rows(want), _rows(got)
    assert {key_of(u) for u in NEW_USERS[:10]} <= set(rows_w)  # IDs first seen on the stream got rows
    assert set(rows_g) == set(rows_w)  # the checkpoint held the table whole: both ranks' keys
    assert set(owner_of(np.asarray(list(rows_g)), 2).tolist()) == {0, 1}
    assert max(float((rows_g[k] - rows_w[k]).abs().max()) for k in rows_w) <= 1e-5
    dense = [k for k in want if ".table." not in k]
    assert dense and set(dense) == {k for k in got if ".table." not in k}
    worst = max(float((got[k].double() - want[k].double()).abs().max()) for k in dense)
    assert worst <= 1e-5, f"dense parameters differ from one process's by {worst:.3g}"
    # the rest of the stream on both partitions, two workers resuming the one worker's checkpoint
    sources |= _send(bootstrap, topic, messages[len(first):], [0, 1], sent)
    resumed = _run(_argv(bootstrap, topic, id_run, out, "2", "--workers", "2"))
    assert "resumed from ckpt-" in resumed.stdout
    _exactly_once(out, sources)
    rows = _rows(_final(out))
    assert set(rows_g) <= set(rows) and {key_of(u) for u in NEW_USERS} <= set(rows)
    # rows whose ID had no key trained on the fallback vector, counted by reason once each (SIGKILL, two restarts)
    status = json.loads((out / "trainer-status.json").read_text())
    assert status["id_fallbacks"] == _bad(messages) and len(status["id_fallbacks"]) == 4
    steps: dict = {}
    for line in (out / "ledger.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "partition" in r:
            steps.setdefault(r["step"], set()).add(r["partition"])
    assert any(parts == {0, 1} for parts in steps.values())  # steps that trained both replicas' rows at once
    moved = [k for k in rows_g if float((rows[k] - rows_g[k]).abs().max()) > 0]  # trained after the resume
    assert set(owner_of(np.asarray(moved), 2).tolist()) == {0, 1}

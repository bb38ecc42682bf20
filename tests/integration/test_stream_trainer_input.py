"""The online trainer's input against the real broker: every kind of bad feature message is a dead
letter with its reason (counted, sent once, past it for good), the good rows around it are trained
exactly once, a restart (also after a crash before any checkpoint) sends nothing twice, and a
diverged model is never checkpointed or published."""
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
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from connectors.arrow import encode_batch
from connectors.dataset import read_manifest
from connectors.kafka import KafkaTarget, Topics, dead_letter_from_record

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parent.parent.parent
CLI = [sys.executable, "-m", "flowtrain.cli"]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))
ROWS = 40


@pytest.fixture(scope="module")
def batch_run(shared_data) -> tuple[str, Path]:
    """y = 3x + 2[c == a] + noise: numeric x, categorical c (3 values: codes 0..3), a regression."""
    return shared_data.regression_run(hidden="16,8", epochs=1, rows=600)


@pytest.fixture(scope="module")
def dataset(batch_run) -> str:
    return batch_run[0]


def _table(dataset: str) -> pa.Table:
    manifest = read_manifest(dataset)
    return pa.concat_tables([pq.read_table(Path(dataset) / s["file"]) for s in manifest["splits"]["train"]])


def _good(table: pa.Table, index: int) -> pa.Table:
    """Feature message ``index``: ROWS dataset rows with their sources (raw partition 0, offsets index*ROWS...)."""
    chunk = table.slice(index * ROWS, ROWS).combine_chunks()
    chunk = chunk.append_column("src_partition", pa.array([0] * ROWS, pa.int32()))
    return chunk.append_column("src_offset", pa.array(range(index * ROWS, (index + 1) * ROWS), pa.int64()))


def _set(table: pa.Table, name: str, values) -> pa.Table:
    return table.set_column(table.schema.get_field_index(name), name, values)


def _bomb() -> bytes:
    """8.5 KB on the wire, 256 MiB decoded: 64 Mi zstd-compressed float32 zeros."""
    batch = pa.record_batch({"num__x": pa.array(np.zeros(64 << 20, np.float32))})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def _bad_messages(table: pa.Table, index: int) -> list[tuple[str, bytes, str]]:
    """(kind, payload, what its reason says) of each bad kind, built from good message ``index`` (with
    sources of their own: rows already trained would be dropped as duplicates before they are used)."""
    good = _good(table, index)
    good = _set(good, "src_offset", pa.array(range(10**6 + index * ROWS, 10**6 + (index + 1) * ROWS), pa.int64()))
    x = good.column("num__x").to_numpy().copy()
    nan = x.copy()
    nan[3] = np.nan
    label = good.column("label").to_numpy().astype(np.float32)
    label[5] = np.inf
    huge = np.full(len(x), 1e30, np.float32)  # finite, but far outside the dataset's range of x
    huge_label = np.full(len(x), 3e38, np.float32)  # finite, but the model's squared error is not
    return [
        ("not_arrow", b'{"x": 1.5, "c": "a"}', "not an Arrow IPC stream"),
        ("schema", encode_batch(good.drop(["cat__c"])), "missing column(s) 'cat__c'"),
        ("schema", encode_batch(_set(good, "num__x", pa.array([str(v) for v in x]))),
         "'num__x' is string (expected a number)"),
        ("values", encode_batch(_set(good, "cat__c", pa.array([57] * ROWS, pa.int32()))), "category code 57"),
        ("values", encode_batch(_set(good, "num__x", pa.array(nan))), "'num__x' has 1 value(s) that are not finite"),
        ("values", encode_batch(_set(good, "label", pa.array(label))), "'label' has 1 value(s) that are not finite"),
        ("too_large", _bomb(), "decodes to 268,435,456 bytes"),
        ("values", encode_batch(_set(good, "num__x", pa.array(huge))), "column's range"),
        ("non_finite_loss", encode_batch(_set(good, "label", pa.array(huge_label))), "output or loss"),
    ]


def _produce(bootstrap: str, topic: str, payloads: list[bytes]) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", max_request_size=16 << 20)
    for payload in payloads:
        producer.send(topic, value=payload, partition=0).get(timeout=30)
    producer.close()


def _dead_letters(bootstrap: str, topic: str) -> list:
    c = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, consumer_timeout_ms=3000)
    parts = c.partitions_for_topic(topic) or set()
    if not parts:
        c.close()
        return []
    c.assign([TopicPartition(topic, p) for p in parts])
    c.seek_to_beginning()
    out = [dead_letter_from_record(m.value, m.headers)[0] for m in c]
    c.close()
    return out


def _ledger(run: Path) -> tuple[dict, dict]:
    rows: dict = {}
    rejected: dict = {}
    for line in (run / "ledger.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "rejected" in r:
            key = (r["rejected"]["partition"], r["rejected"]["offset"])
            rejected[key] = rejected.get(key, 0) + 1
        else:
            rows[(r["partition"], r["offset"])] = rows.get((r["partition"], r["offset"]), 0) + 1
    return rows, rejected


def _config(bootstrap, topic, dataset, out, **kw):
    from flowtrain.train.stream.config import StreamTrainConfig

    topics = Topics(features=topic, updates=f"{topic}-updates", dead_letters=f"{topic}-dead",
                    raw=kw.pop("raw_topic", None))
    return StreamTrainConfig(kafka=KafkaTarget(bootstrap), topics=topics, run_dir=str(out), dataset_dir=dataset,
                             hidden=(16, 8),
                             ledger=True, device="cpu", checkpoint_seconds=1000.0, **kw)


def test_every_bad_kind_is_a_dead_letter_once_and_the_good_rows_train_exactly_once(bootstrap, new_topic, dataset,
                                                                                    tmp_path):
    from flowtrain.train.stream.online import run_stream_trainer

    table = _table(dataset)
    topic = new_topic(partitions=1)
    bad = _bad_messages(table, 0)
    payloads, good_sources, bad_offsets = [], set(), {}
    for i, (kind, payload, says) in enumerate(bad):  # good, bad, good, bad, ..., good
        payloads.append(encode_batch(_good(table, i)))
        good_sources.update((0, o) for o in range(i * ROWS, (i + 1) * ROWS))
        bad_offsets[len(payloads)] = (kind, says)
        payloads.append(payload)
    payloads.append(encode_batch(_good(table, len(bad))))
    good_sources.update((0, o) for o in range(len(bad) * ROWS, (len(bad) + 1) * ROWS))
    _produce(bootstrap, topic, payloads)

    out = tmp_path / "run"
    summary = run_stream_trainer(_config(bootstrap, topic, dataset, out, idle_exit=2.0, checkpoint_every=3))
    assert summary["rows"] == len(good_sources)
    assert summary["rejected"] == {"not_arrow": 1, "schema": 2, "values": 4, "too_large": 1, "non_finite_loss": 1}

    letters = _dead_letters(bootstrap, f"{topic}-dead")
    assert sorted(letter.source for letter in letters) == sorted(f"{topic}/0/{o}" for o in bad_offsets)
    for letter in letters:
        kind, says = bad_offsets[int(letter.source.rsplit("/", 1)[1])]
        assert says in letter.reason, (kind, letter.reason)
    bomb = next(letter for letter in letters if "decodes to" in letter.reason)
    assert len(bomb.payload) < 16_000  # the message as it came, not what it decodes to

    rows, rejected = _ledger(out)
    assert set(rows) == good_sources and set(rows.values()) == {1}
    assert rejected == {(0, o): 1 for o in bad_offsets}
    ckpt = torch.load(sorted((out / "checkpoints").glob("ckpt-*.pt"))[-1], weights_only=True)
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values() if v.is_floating_point())
    assert ckpt["positions"] == {"0": len(payloads)} and sum(ckpt["rejected"].values()) == len(bad)
    status = json.loads((out / "trainer-status.json").read_text())
    assert sum(status["rejected"].values()) == len(bad) and np.isfinite(status["loss"])

    # a restart reads nothing again and sends nothing again
    again = run_stream_trainer(_config(bootstrap, topic, dataset, out, idle_exit=1.0))
    assert again["resumed_from"] and again["rows"] == 0
    assert again["rejected"] == summary["rejected"]
    assert len(_dead_letters(bootstrap, f"{topic}-dead")) == len(bad)


def _status(run: Path) -> dict:
    try:
        return json.loads((run / "trainer-status.json").read_text())
    except (OSError, ValueError):
        return {}


@pytest.mark.timeout(420)
def test_a_crash_before_the_first_checkpoint_sends_no_dead_letter_twice(bootstrap, new_topic, dataset, tmp_path):
    table = _table(dataset)
    topic = new_topic(partitions=1)
    kind, payload, says = _bad_messages(table, 1)[3]  # a category code out of range
    _produce(bootstrap, topic, [encode_batch(_good(table, 0)), payload, encode_batch(_good(table, 2))])
    out = tmp_path / "run"
    argv = CLI + ["stream", "train", "--bootstrap", bootstrap, "--features-topic", topic, "--updates-topic",
                  f"{topic}-updates", "--dead-letter-topic", f"{topic}-dead", "--dataset", dataset, "--out", str(out),
                  "--hidden", "16,8", "--ledger", "--device", "cpu", "--checkpoint-every", "1000",
                  "--checkpoint-seconds", "1000"]
    proc = subprocess.Popen(argv + ["--idle-exit", "120"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=ENV, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None and _status(out).get("rows") != 2 * ROWS:
            time.sleep(0.1)
        assert _status(out).get("rows") == 2 * ROWS, (proc.poll(), proc.stderr.read() if proc.poll() else "")
        assert len(_dead_letters(bootstrap, f"{topic}-dead")) == 1
        assert not list((out / "checkpoints").glob("ckpt-*.pt"))  # the crash comes before any checkpoint
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    again = subprocess.run(argv + ["--idle-exit", "2"], capture_output=True, text=True, timeout=240, env=ENV)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "counted again, not sent again" in again.stdout
    assert "1 feature message(s) rejected" in again.stdout
    letters = _dead_letters(bootstrap, f"{topic}-dead")
    assert [letter.source for letter in letters] == [f"{topic}/0/1"] and says in letters[0].reason
    rows, rejected = _ledger(out)
    assert len(rows) == 2 * ROWS and set(rows.values()) == {1} and rejected == {(0, 1): 1}


def test_non_finite_weights_are_never_trained_checkpointed_or_published(bootstrap, new_topic, batch_run, tmp_path):
    import shutil

    from flowtrain.train.stream.online import run_stream_trainer

    dataset, run = batch_run
    table = _table(dataset)
    topic = new_topic(partitions=1)
    _produce(bootstrap, topic, [encode_batch(_good(table, i)) for i in range(3)])
    start = tmp_path / "batch"
    start.mkdir()
    shutil.copy(run / "config.json", start / "config.json")
    weights = torch.load(run / "model.pt", weights_only=True)
    first = next(k for k, v in weights.items() if v.is_floating_point())
    weights[first].view(-1)[0] = float("nan")  # a model that diverged: it would train and publish NaN
    torch.save(weights, start / "model.pt")
    out = tmp_path / "run"
    with pytest.raises(ValueError, match="the starting weights .* are not finite"):  # NonFiniteModel
        run_stream_trainer(_config(bootstrap, topic, dataset, out, idle_exit=2.0,
                                   init_weights=str(start / "model.pt")))
    assert not list((out / "checkpoints").glob("ckpt-*.pt"))
    assert _dead_letters(bootstrap, f"{topic}-updates") == []  # nothing published
    assert _dead_letters(bootstrap, f"{topic}-dead") == []  # and no good message blamed for it
    # the same model.pt in `flowtrain stream train`: a one-line error, exit 2
    proc = subprocess.run(CLI + ["stream", "train", "--bootstrap", bootstrap, "--features-topic", topic,
                                 "--dataset", dataset, "--out", str(tmp_path / "cli"), "--init-weights",
                                 str(start / "model.pt")], capture_output=True, text=True, timeout=240, env=ENV)
    assert proc.returncode == 2 and "are not finite" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.timeout(420)
def test_with_two_replicas_each_rejects_its_own_and_the_counts_add_up_once(bootstrap, new_topic, dataset, tmp_path):
    table = _table(dataset)
    topic = new_topic(partitions=2)
    bad = _bad_messages(table, 2)
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    sent, good_sources = {0: 0, 1: 0}, set()
    expected_letters = set()
    for i in range(4):  # per partition: good, bad, good, bad, ... (each replica reads one partition)
        part = i % 2
        good = _good(table, i)
        good = _set(good, "src_partition", pa.array([part] * ROWS, pa.int32()))
        producer.send(topic, value=encode_batch(good), partition=part).get(timeout=30)
        good_sources.update((part, o) for o in range(i * ROWS, (i + 1) * ROWS))
        sent[part] += 1
        producer.send(topic, value=bad[i][1], partition=part).get(timeout=30)
        expected_letters.add(f"{topic}/{part}/{sent[part]}")
        sent[part] += 1
    producer.close()
    out = tmp_path / "run"
    argv = CLI + ["stream", "train", "--bootstrap", bootstrap, "--features-topic", topic, "--updates-topic",
                  f"{topic}-updates", "--dead-letter-topic", f"{topic}-dead", "--dataset", dataset, "--out", str(out),
                  "--hidden", "16,8", "--ledger", "--device", "cpu", "--workers", "2", "--checkpoint-every", "2",
                  "--failure-timeout", "120", "--idle-exit", "3"]
    first = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=ENV)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "4 feature message(s) rejected" in first.stdout, first.stdout[-2000:]
    letters = _dead_letters(bootstrap, f"{topic}-dead")
    assert {letter.source for letter in letters} == expected_letters and len(letters) == 4
    rows, rejected = _ledger(out)
    assert set(rows) == good_sources and set(rows.values()) == {1}
    assert set(rejected) == {tuple(int(x) for x in s.rsplit("/", 2)[1:]) for s in expected_letters}
    assert set(rejected.values()) == {1}
    again = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=ENV)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "4 feature message(s) rejected" in again.stdout  # the checkpoint's counts, none added
    assert len(_dead_letters(bootstrap, f"{topic}-dead")) == 4


def _sourced(table: pa.Table, index: int, offsets, partition: int = 0) -> pa.Table:
    """A feature message of len(offsets) dataset rows whose sources are (partition, offsets)."""
    offsets = list(offsets)
    chunk = table.slice((index * ROWS) % (table.num_rows - len(offsets)), len(offsets)).combine_chunks()
    chunk = chunk.append_column("src_partition", pa.array([partition] * len(offsets), pa.int32()))
    return chunk.append_column("src_offset", pa.array(offsets, pa.int64()))


@pytest.mark.timeout(240)
def test_an_impossible_source_offset_is_a_dead_letter_and_never_marks_later_rows_duplicates(bootstrap, new_topic,
                                                                                             dataset, tmp_path):
    """Issue 28 item 6: a valid 1-row message with src_offset 2**62 (and one from a raw partition that does not
    exist) between rows 0-399 and 400-599 of raw partition 0: both are dead letters naming the source, rows
    400-599 are trained (not dropped as duplicates), and the checkpoint's seen state is 599. Checked against
    the raw topic's end offsets, and, without a raw topic, against the highest offset trained."""
    from flowtrain.train.stream.online import run_stream_trainer

    table = _table(dataset)
    raw = new_topic(partitions=1, prefix="raw")
    _produce(bootstrap, raw, [b'{"x": 1}'] * 600)  # the raw events the 600 legitimate rows came from
    payloads = [encode_batch(_sourced(table, i, range(i * ROWS, (i + 1) * ROWS))) for i in range(10)]
    attacks = {len(payloads): "2**62", len(payloads) + 1: "partition"}
    payloads.append(encode_batch(_sourced(table, 0, [2**62])))
    payloads.append(encode_batch(_sourced(table, 1, [5], partition=7)))
    payloads += [encode_batch(_sourced(table, i, range(i * ROWS, (i + 1) * ROWS))) for i in range(10, 15)]

    for name, raw_topic, says in (("with-raw", raw, "at or past the end of the raw topic"),
                                  ("without-raw", None, "past the highest offset trained")):
        topic = new_topic(partitions=1)
        _produce(bootstrap, topic, payloads)
        out = tmp_path / name
        summary = run_stream_trainer(_config(bootstrap, topic, dataset, out, idle_exit=2.0, raw_topic=raw_topic))
        # without the raw topic, a partition not trained yet has no reference: partition 7's row is trained
        legit = {(0, o) for o in range(600)} | (set() if raw_topic else {(7, 5)})
        assert summary["dropped_duplicates"] == 0 and summary["rows"] == len(legit), (name, summary)
        rows, rejected = _ledger(out)
        assert set(rows) == legit and set(rows.values()) == {1}, name
        ckpt = torch.load(sorted((out / "checkpoints").glob("ckpt-*.pt"))[-1], weights_only=True)
        assert ckpt["seen"]["0"] == 599, (name, ckpt["seen"])
        letters = {int(letter.source.rsplit("/", 1)[1]): letter.reason
                   for letter in _dead_letters(bootstrap, f"{topic}-dead")}
        if raw_topic:  # partition 7 is not one of the raw topic's
            assert set(letters) == set(attacks) and set(rejected) == {(0, o) for o in attacks}, (name, letters)
            assert "has 7, but the raw topic" in letters[max(attacks)], letters
        else:
            assert set(letters) == {min(attacks)}, (name, letters)
        assert str(2**62) in letters[min(attacks)] and says in letters[min(attacks)], letters
        assert summary["rejected"].get("source") == len(letters), summary

"""Arrow codec, dead letters, file readers and dataset directories."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import apache_beam as beam
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to

from connectors.arrow import DecodeArrow, EncodeArrow, SchemaMismatch, decode_batch, encode_batch
from connectors.dataset import MANIFEST, DatasetError, ReadDataset, WriteDataset, read_manifest
from connectors.deadletter import DeadLetter, WriteDeadLettersToJsonl
from connectors.files import ReadFromFiles
from flowtrain.local.runners import pipeline_options

SCHEMA = pa.schema([("x", pa.float32()), ("c", pa.string())])


def _batch(lo, hi):
    return pa.RecordBatch.from_pydict({"x": [float(i) for i in range(lo, hi)],
                                       "c": [f"c{i % 3}" for i in range(lo, hi)]}, schema=SCHEMA)


def _rows(batch):
    return list(zip(batch.column("x").to_pylist(), batch.column("c").to_pylist()))


def test_arrow_codec_round_trip_and_schema_mismatch():
    batch = _batch(0, 10)
    assert decode_batch(encode_batch(batch), SCHEMA).equals(batch)
    other = pa.schema([("x", pa.float64()), ("c", pa.string())])
    with pytest.raises(SchemaMismatch) as err:
        decode_batch(encode_batch(batch), other)
    assert "x: double" in str(err.value) and "x: float" in str(err.value)


def test_decode_arrow_dead_letters_reconcile(tmp_path):
    good = [encode_batch(_batch(i * 10, i * 10 + 10)) for i in range(4)]
    wrong_schema = encode_batch(pa.RecordBatch.from_pydict({"y": [1, 2]}))
    garbage = b"\x00not arrow at all"
    payloads = good + [wrong_schema, garbage]
    with TestPipeline(options=pipeline_options("batch")) as p:
        batches, errs = p | beam.Create(payloads) | DecodeArrow(expected_schema=SCHEMA)
        assert_that(batches | beam.FlatMap(_rows), equal_to([r for i in range(4) for r in _rows(_batch(i * 10, i * 10 + 10))]))
        reasons = errs | beam.Map(lambda d: d.reason.split(":")[0].split(".")[0])
        assert_that(reasons, equal_to(["record batch schema does not match the expected schema",
                                       "not an Arrow IPC stream"]), label="reasons")
        counts = ((batches | "nb" >> beam.combiners.Count.Globally()),
                  (errs | "ne" >> beam.combiners.Count.Globally()))
        total = counts | beam.Flatten() | beam.CombineGlobally(sum)
        assert_that(total, equal_to([len(payloads)]), label="in = out + dead letters")
        _ = errs | WriteDeadLettersToJsonl(str(tmp_path / "dead.jsonl"))
    lines = [json.loads(l) for l in open(tmp_path / "dead.jsonl")]
    assert len(lines) == 2 and all(set(l) == {"source", "reason", "payload"} for l in lines)


def test_encode_then_decode_in_pipeline():
    with TestPipeline(options=pipeline_options("batch")) as p:
        batches, _ = (p | beam.Create([_batch(0, 5)]) | EncodeArrow() | DecodeArrow(expected_schema=SCHEMA))
        assert_that(batches | beam.FlatMap(_rows), equal_to(_rows(_batch(0, 5))))


def test_read_parquet_by_row_group_csv_and_jsonl(tmp_path):
    table = pa.Table.from_batches([_batch(0, 100)])
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=30)  # 4 row groups
    (tmp_path / "b.csv").write_text("x,c\n1.5,u\nNA,v\n")
    (tmp_path / "c.jsonl").write_text('{"x": 2.0, "c": "w"}\n{"x": 3.0, "c": null}\n')
    with TestPipeline(options=pipeline_options("batch")) as p:
        pqb = p | "pq" >> ReadFromFiles(str(tmp_path / "*.parquet"), with_source=True)
        assert_that(pqb | "n" >> beam.Map(lambda b: b.num_rows), equal_to([30, 30, 30, 10]), label="groups")
        assert_that(pqb | "src" >> beam.FlatMap(lambda b: b.column("_source_row").to_pylist()),
                    equal_to(list(range(100))), label="rows")
        csv = p | "csv" >> ReadFromFiles(str(tmp_path / "b.csv"))
        assert_that(csv | "cr" >> beam.FlatMap(lambda b: b.to_pylist()),
                    equal_to([{"x": 1.5, "c": "u"}, {"x": None, "c": "v"}]), label="csv")
        js = p | "js" >> ReadFromFiles(str(tmp_path / "c.jsonl"))
        assert_that(js | "jr" >> beam.FlatMap(lambda b: b.to_pylist()),
                    equal_to([{"x": 2.0, "c": "w"}, {"x": 3.0, "c": None}]), label="jsonl")


def test_dataset_write_then_read_round_trip(tmp_path):
    out = tmp_path / "ds"
    pairs = [("train", _batch(0, 50)), ("train", _batch(50, 80)), ("test", _batch(80, 100))]
    with TestPipeline(options=pipeline_options("batch")) as p:
        _ = p | beam.Create(pairs) | WriteDataset(out, metadata={"label": "x", "stats": {"x": [1, 2]}})
    manifest = read_manifest(out)
    assert manifest["rows"] == {"train": 80, "test": 20}
    assert manifest["label"] == "x" and manifest["stats"] == {"x": [1, 2]}
    assert sum(s["rows"] for s in manifest["splits"]["train"]) == 80
    assert [f["name"] for f in manifest["schema"]] == ["x", "c"]
    assert not list(tmp_path.glob("ds.tmp-*"))
    with TestPipeline(options=pipeline_options("batch")) as p:
        rows = p | ReadDataset(out, split="train") | beam.FlatMap(_rows)
        assert_that(rows, equal_to(_rows(_batch(0, 80))))
    with pytest.raises(DatasetError, match="no split 'valid'"):
        ReadDataset(out, split="valid")
    with pytest.raises(DatasetError, match="exists"):
        with TestPipeline(options=pipeline_options("batch")) as p:
            _ = p | beam.Create(pairs) | WriteDataset(out)


@pytest.mark.timeout(120)
def test_killed_dataset_write_leaves_no_manifest(tmp_path):
    out = tmp_path / "ds"
    script = textwrap.dedent(f"""
        import time, apache_beam as beam, pyarrow as pa
        from connectors.dataset import WriteDataset
        from flowtrain.local.runners import pipeline_options

        def slow(i):
            time.sleep(0.5 if i else 0)
            return ("train", pa.RecordBatch.from_pydict({{"x": [float(i)] * 10}}))

        with beam.Pipeline(options=pipeline_options("batch")) as p:
            _ = p | beam.Create(list(range(200))) | beam.Map(slow) | WriteDataset({str(out)!r})
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=os.getcwd(), start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not list(tmp_path.glob("ds.tmp-*/train/*.parquet")):
            time.sleep(0.2)
        assert list(tmp_path.glob("ds.tmp-*/train/*.parquet")), "the writer never started a shard"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert not (out / MANIFEST).exists() and not out.exists()
    with pytest.raises(DatasetError, match="not a finished dataset"):
        read_manifest(out)


def test_dead_letter_type():
    d = DeadLetter(b"x", "t/0/1", "why")
    assert d.source == "t/0/1" and d.reason == "why"

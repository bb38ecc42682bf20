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
from connectors.deadletter import WriteDeadLettersToJsonl
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
    lines = [json.loads(line) for line in open(tmp_path / "dead.jsonl")]
    assert len(lines) == 2 and all(set(r) == {"source", "reason", "payload"} for r in lines)


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


# --- bad input while reading (issue #16, item 5): named by file and line, dead letters, no temporaries ---
def _read_all(path, **kw):
    """(rows, dead letters) of one file as ``ReadFromFiles(..., with_errors=True)`` reads it (its units' reader)."""
    from connectors.deadletter import DeadLetter
    from connectors.files import file_format, iter_unit, list_units

    rows, dead = [], []
    for unit in list_units(str(path), file_format(str(path))):
        for item in iter_unit(unit, with_source=True, **kw):
            (dead.append(item) if isinstance(item, DeadLetter) else rows.extend(item.to_pylist()))
    return rows, dead


def test_a_late_bad_value_past_the_first_blocks_is_a_dead_letter_naming_file_and_line(tmp_path):
    from connectors.dataset_spec import FeatureSpec
    from pipelines.tabular.pipeline import run_tabular_etl

    n, bad_at = 260_000, 250_000  # ~4.8 MB: the bad value lies past the first 4 MB pre-flight reads
    lines = [f"{i * 0.123456789:.8f},{'ab'[i % 2]},{i % 7}" for i in range(n)]
    lines[bad_at] = "abc,a,1"
    path = tmp_path / "big.csv"
    path.write_text("x,c,y\n" + "\n".join(lines) + "\n")
    assert path.stat().st_size > 4 << 20
    spec = FeatureSpec(label="y", task="regression", numeric=["x"], categorical=["c"])
    m = run_tabular_etl([str(path)], spec, dataset_path=str(tmp_path / "ds"),
                        dead_letters_path=str(tmp_path / "dead.jsonl"), options=pipeline_options("batch"))
    assert m["counts"]["in"] == n and m["counts"]["out"] == n - 1
    dead = [json.loads(line) for line in open(tmp_path / "dead.jsonl")]
    assert [(d["source"], d["reason"]) for d in dead] == [
        (f"{path}:{bad_at + 2}", "column 'x' holds a value that is not a number")]
    assert dead[0]["payload"]["json"]["x"] == "abc"
    assert not list(tmp_path.glob("beam-temp-*")) and not list(tmp_path.glob("ds.tmp-*"))


def test_a_malformed_json_line_is_a_dead_letter_naming_file_and_line(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"x": 1.0, "c": "a"}\n\n{"x": 2.0, "c": \n{"x": "two", "c": "b"}\n[1, 2]\n{"x": 4.0, "c": "d"}\n')
    rows, dead = _read_all(path, column_types={"x": pa.float64(), "c": pa.string()}, columns=["x", "c"])
    assert sorted((r["x"], r["_source_row"]) for r in rows) == [(1.0, 1), (4.0, 6)]
    by_line = {d.source: d.reason for d in dead}
    assert set(by_line) == {f"{path}:3", f"{path}:4", f"{path}:5"}
    assert by_line[f"{path}:3"].startswith("malformed JSON line")
    assert by_line[f"{path}:4"] == "column 'x' holds a value that is not a number"
    assert by_line[f"{path}:5"] == "JSON line is a list, not an object"
    with TestPipeline(options=pipeline_options("batch")) as p:  # the same through Beam: rows + errs = lines
        batches, errs = p | ReadFromFiles(str(path), with_source=True, with_errors=True, columns=["x", "c"],
                                          column_types={"x": pa.float64(), "c": pa.string()})
        assert_that(batches | "rows" >> beam.FlatMap(lambda b: b.column("_source_row").to_pylist()),
                    equal_to([1, 6]), label="rows")
        assert_that(errs | "errs" >> beam.Map(lambda d: d.source), equal_to([f"{path}:{i}" for i in (3, 4, 5)]),
                    label="errs")


def test_quoted_newlines_in_a_large_csv_are_read_and_lines_counted(tmp_path):
    n = 60_000  # ~3 MB: pyarrow's parallel reader splits blocks at newlines inside quotes
    body = [f'{i},"note {i}\nsecond line, with a comma",{i % 3}' for i in range(n)]
    body[n - 10] = f'{n - 10},"short row"'  # a record with too few fields, after 49,990 two-line records
    path = tmp_path / "notes.csv"
    path.write_text("id,note,k\n" + "\n".join(body) + "\n")
    rows, dead = _read_all(path, column_types={"id": pa.float64(), "note": pa.string(), "k": pa.string()})
    assert len(rows) == n - 1 and rows[0]["note"].endswith("with a comma")
    lines = {r["id"]: r["_source_row"] for r in rows}
    assert lines[0.0] == 2 and lines[float(n - 1)] == 2 + 2 * (n - 1) - 1  # the short row has one line
    assert [(d.source, d.reason) for d in dead] == [(f"{path}:{2 + 2 * (n - 10)}",
                                                     "CSV row has 2 fields, the header has 3")]
    # without declared types (whole-file inference) the same file reads too
    with TestPipeline(options=pipeline_options("batch")) as p:
        plain, _ = p | "plain" >> ReadFromFiles(str(path), with_errors=True)
        counts = plain | beam.Map(lambda b: b.num_rows) | beam.CombineGlobally(sum)
        assert_that(counts, equal_to([n - 1]))


def test_duplicate_header_names_are_an_error_naming_the_file(tmp_path):
    from connectors.dataset_spec import FeatureSpec
    from connectors.files import FileReadError, csv_header
    from pipelines.tabular.preflight import preflight

    path = tmp_path / "dup.csv"
    path.write_text("x,y,x\n1,2,3\n")
    with pytest.raises(FileReadError, match=r"dup.csv: the header repeats column names: 'x' \(columns 1, 3\)"):
        csv_header(str(path))
    with pytest.raises(FileReadError, match="repeats column names"):
        preflight([str(path)], FeatureSpec(label="y", numeric=["x"]))


def test_a_file_that_fails_the_pipeline_names_itself_and_leaves_no_temporaries(tmp_path):
    from connectors.dataset_spec import FeatureSpec
    from pipelines.tabular.pipeline import run_tabular_etl

    path = tmp_path / "latin1.csv"  # valid UTF-8 for the first 4 MB pre-flight reads, then a Latin-1 byte
    path.write_bytes(b"x,c,y\n" + b"".join(b"%d,abcdefghij,%d\n" % (i, i % 5) for i in range(250_000))
                     + b"5,caf\xe9,1\n")
    assert path.stat().st_size > 4 << 20
    spec = FeatureSpec(label="y", task="regression", numeric=["x"], categorical=["c"])
    with pytest.raises(Exception) as err:
        run_tabular_etl([str(path)], spec, dataset_path=str(tmp_path / "ds"),
                        dead_letters_path=str(tmp_path / "dead.jsonl"), options=pipeline_options("batch"))
    assert f"{path}: cannot be read as CSV" in str(err.value)
    assert not list(tmp_path.glob("beam-temp-*")) and not list(tmp_path.glob("ds*"))


def test_an_integer_column_never_truncates_or_wraps_a_value(tmp_path):
    """A declared integer type: 1.5, a number out of range or not a number is a dead letter
    naming the column, never 1, INT_MIN or a wrapped value (the cast used to be unchecked)."""
    path = tmp_path / "ints.csv"
    path.write_text("n,w\n7,1\n1.5,2\n1e20,3\nx,300\n-2,4\n")
    rows, dead = _read_all(path, column_types={"n": pa.int64(), "w": pa.int8()}, columns=["n", "w"])
    assert sorted((r["n"], r["w"], r["_source_row"]) for r in rows) == [(-2, 4, 6), (7, 1, 2)]
    by_line = {d.source: d.reason for d in dead}
    assert by_line == {f"{path}:{i}": "column 'n' holds a value that is not a whole number in the range of int64"
                       for i in (3, 4, 5)}
    # an integer column read as a narrower type: out of range is a dead letter, not wrapped
    rows, dead = _read_all(path, column_types={"w": pa.int8()}, columns=["w"])
    assert 300 not in [r["w"] for r in rows] and any("range of int8" in d.reason for d in dead)

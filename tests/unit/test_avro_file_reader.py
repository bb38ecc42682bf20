"""Avro object container files as inputs (issue 33, item 1): typed from the file's schema, as Parquet's columns;
a value that does not fit its declared type is its row's dead letter; a file that is not Avro, or is truncated,
is one ``FileReadError`` naming it."""
from __future__ import annotations

import datetime as dt
import decimal

import fastavro
import pyarrow as pa
import pytest

from connectors.deadletter import DeadLetter
from connectors.files import FileReadError, avro_head, check_avro_file, file_format, iter_unit, list_units

SCHEMA = {"type": "record", "name": "Row", "namespace": "t", "fields": [
    {"name": "id", "type": "long"}, {"name": "x1", "type": ["null", "double"]},
    {"name": "x2", "type": ["null", "string"]}, {"name": "c", "type": {"type": "enum", "name": "C", "symbols": ["a", "b"]}},
    {"name": "n", "type": "int"}, {"name": "t", "type": {"type": "long", "logicalType": "timestamp-millis"}},
    {"name": "d", "type": {"type": "bytes", "logicalType": "decimal", "precision": 6, "scale": 2}},
    {"name": "c2", "type": ["null", "C"]}]}


def _write(path, n=5):
    rows = [{"id": i, "x1": None if i == 2 else i * 0.5, "x2": "abc" if i == 3 else str(i), "c": "ab"[i % 2], "n": i,
             "t": dt.datetime(2024, 1, 1, tzinfo=dt.timezone.utc), "d": decimal.Decimal("1.25"), "c2": "a"}
            for i in range(n)]
    with open(path, "wb") as fh:
        fastavro.writer(fh, SCHEMA, rows, codec="deflate", sync_interval=64)
    return path


def test_item1_an_avro_file_is_typed_from_its_schema_as_parquet_columns(tmp_path):
    path = str(_write(tmp_path / "rows.avro"))
    assert file_format(path) == "avro"
    head = avro_head(path)
    assert dict(zip(head.schema.names, head.schema.types)) == {
        "id": pa.int64(), "x1": pa.float64(), "x2": pa.string(), "c": pa.string(), "n": pa.int32(),
        "t": pa.timestamp("ms", tz="UTC"), "d": pa.decimal128(6, 2), "c2": pa.string()}
    assert head.column("x1").to_pylist() == [0.0, 0.5, None, 1.5, 2.0] and check_avro_file(path) == 5


def test_item1_an_avro_record_that_fails_the_declared_types_is_a_dead_letter_naming_file_and_row(tmp_path):
    path = str(_write(tmp_path / "rows.avro"))
    out = list(iter_unit(list_units(path, "avro")[0], columns=["id", "x1", "x2", "c"], with_source=True,
                         column_types={"id": None, "x1": pa.float64(), "x2": pa.float64(), "c": pa.string()},
                         batch_rows=2))
    dead = [x for x in out if isinstance(x, DeadLetter)]
    rows = pa.Table.from_batches([x for x in out if not isinstance(x, DeadLetter)])
    assert [(d.source, d.reason) for d in dead] == [(f"{path}:3", "column 'x2' holds a value that is not a number")]
    assert rows.column("id").to_pylist() == [0, 1, 2, 4] and rows.column("_source_row").to_pylist() == [0, 1, 2, 4]
    assert rows.column("x2").to_pylist() == [0.0, 1.0, 2.0, 4.0]


@pytest.mark.parametrize("damage", ["truncated", "not_avro"])
def test_item1_a_corrupt_or_foreign_avro_file_is_one_error_naming_the_file(tmp_path, damage):
    good = _write(tmp_path / "rows.avro", n=200).read_bytes()
    path = tmp_path / "bad.avro"
    path.write_bytes(good[:-20] if damage == "truncated" else b"x1,x2\n1,2\n")
    for read in (check_avro_file, avro_head):
        with pytest.raises(FileReadError) as err:
            read(str(path))
        assert str(err.value).startswith(f"{path}: not a readable Avro object container file" if damage == "truncated"
                                         else f"{path}: not an Avro object container file (it starts with b'x1,x'")
        assert "\n" not in str(err.value)


def test_item1_replay_reads_an_avro_file_as_its_rows(tmp_path):
    from pipelines.stream.replay import read_files

    table = read_files([str(_write(tmp_path / "rows.avro"))], columns=["id", "x1", "t"])
    assert table.column("id").to_pylist() == [0, 1, 2, 3, 4] and table.schema.field("t").type == pa.timestamp(
        "ms", tz="UTC")

"""Avro object container files (``.avro``), read with fastavro (a Beam dependency), one file per unit.
``ReadFromAvro`` reads them in Beam (``ReadFromFiles`` too, by the file name).

Columns are typed from the file's own (writer's) schema, as Parquet's are from its schema (``avro_arrow_type``:
``long`` -> int64, ``double`` -> float64, ``string``/``enum`` -> string, ``["null", T]`` -> T nullable,
``timestamp-millis``/``-micros`` -> timestamp UTC, ``date`` -> date32, ``decimal`` -> decimal128); declared types
then apply as for Parquet (a value that does not fit rejects its row). A file that is not Avro, or is truncated
or corrupt, is a ``FileReadError`` naming the file (``check_avro_file`` reads every block's framing first).
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

import fastavro
import pyarrow as pa
from apache_beam.io.filesystems import FileSystems

from connectors.avro_schema import AvroSchemaError, check_avro_schema
from connectors.files.units import FileReadError, FileUnit, ReadUnits, ReadUnitsFn, numbered

__all__ = ["ReadFromAvro", "avro_arrow_type", "avro_head", "check_avro_file", "read_avro"]


def read_avro(fh, unit: FileUnit, *, columns: Sequence[str] | None = None, batch_rows: int = 65_536,
              **_) -> Iterator[tuple]:
    """The reader of an Avro unit (``units.Reader``): its rows numbered from 0."""
    return numbered(unit, _avro_records(fh, unit.path, columns, batch_rows))


class _ReadAvroFn(ReadUnitsFn):
    reader = staticmethod(read_avro)


class ReadFromAvro(ReadUnits):
    """Avro object container files as ``pyarrow.RecordBatch``es (the options of ``units.ReadUnits``)."""

    read_fn = _ReadAvroFn
    fixed_format = "avro"


_AVRO_PRIMITIVES = {"null": pa.null(), "boolean": pa.bool_(), "int": pa.int32(), "long": pa.int64(),
                    "float": pa.float32(), "double": pa.float64(), "bytes": pa.binary(), "string": pa.string()}
_AVRO_LOGICAL = {"timestamp-millis": pa.timestamp("ms", tz="UTC"), "timestamp-micros": pa.timestamp("us", tz="UTC"),
                 "local-timestamp-millis": pa.timestamp("ms"), "local-timestamp-micros": pa.timestamp("us"),
                 "date": pa.date32(), "time-millis": pa.time32("ms"), "time-micros": pa.time64("us"),
                 "uuid": pa.string()}


def avro_arrow_type(avro_type, named: dict | None = None) -> pa.DataType | None:
    """The Arrow type of an Avro field's type (a union with null: the other branch, nullable); None for what has
    no one column type (records, arrays, maps, unions of several types: Arrow infers from the values)."""
    named = {} if named is None else named
    if isinstance(avro_type, list):
        branches = [t for t in avro_type if t != "null"]
        return avro_arrow_type(branches[0], named) if len(branches) == 1 else (pa.null() if not branches else None)
    if isinstance(avro_type, str):
        if avro_type in _AVRO_PRIMITIVES:
            return _AVRO_PRIMITIVES[avro_type]
        return avro_arrow_type(named[avro_type], named) if avro_type in named else None
    if not isinstance(avro_type, dict):
        return None
    kind = avro_type.get("type")
    if kind in ("record", "error", "enum", "fixed") and avro_type.get("name"):
        named[avro_type["name"]] = avro_type
        if avro_type.get("namespace") and "." not in avro_type["name"]:
            named[f"{avro_type['namespace']}.{avro_type['name']}"] = avro_type
    logical = avro_type.get("logicalType")
    if logical == "decimal" and kind in ("bytes", "fixed"):
        return pa.decimal128(int(avro_type.get("precision", 38)), int(avro_type.get("scale", 0)))
    if logical in _AVRO_LOGICAL:
        return _AVRO_LOGICAL[logical]
    if kind == "enum":
        return pa.string()
    if kind == "fixed":
        return pa.binary()
    if kind in ("record", "error", "array", "map"):
        return None
    return avro_arrow_type(kind, named)


def _avro_fields(schema, path: str) -> list[tuple[str, pa.DataType | None]]:
    """(name, Arrow type) of each field of an Avro file's record schema."""
    if not isinstance(schema, dict) or schema.get("type") != "record":
        raise FileReadError(f"{path}: the Avro file's schema is not a record (its rows have no named columns); "
                            f"write records, one field per column")
    named: dict = {}
    avro_arrow_type(schema, named)
    return [(f["name"], avro_arrow_type(f["type"], named)) for f in schema.get("fields", [])]


def _avro_batch(records: list[dict], fields: list[tuple[str, pa.DataType | None]], path: str) -> pa.RecordBatch:
    arrays = []
    for name, t in fields:
        values = [r.get(name) for r in records]
        try:
            arrays.append(pa.array(values, type=t) if t is not None else pa.array(values))
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as err:
            raise FileReadError(f"{path}: Avro field {name!r} cannot be one column ({err})") from None
    return pa.RecordBatch.from_arrays(arrays, names=[n for n, _ in fields])


def _not_avro(path: str, err: BaseException) -> FileReadError:
    text = str(err) or type(err).__name__
    return FileReadError(f"{path}: not a readable Avro object container file ({text[:200]}); check the file (a "
                         f"truncated copy, another format named .avro)")


_AVRO_MAGIC = b"Obj\x01"


def _avro_magic(fh, path: str) -> None:
    """A ``FileReadError`` naming ``path`` unless it starts with Avro's magic bytes; ``fh`` is left at its start."""
    head = fh.read(len(_AVRO_MAGIC))
    if head != _AVRO_MAGIC:
        shown = "it is empty" if not head else f"it starts with {head!r}"
        raise FileReadError(f"{path}: not an Avro object container file ({shown}, not Avro's {_AVRO_MAGIC!r}); "
                            f"check the file, or name it after its format (.parquet, .csv, .jsonl)")
    fh.seek(0)


def _safe_schema(schema, path: str) -> None:
    """A ``FileReadError`` naming ``path`` when its writer schema is one fastavro cannot decode safely
    (``connectors.avro_schema``): checked from the header, before any record is decoded."""
    try:
        check_avro_schema(schema)
    except AvroSchemaError as err:
        raise FileReadError(f"{path}: refused: its Avro schema {err}; a table's rows are records of columns") from None


def _avro_records(fh, path: str, columns: Sequence[str] | None, batch_rows: int, limit: int | None = None
                  ) -> Iterator[pa.RecordBatch]:
    """The file's rows as record batches (of ``columns`` the file has, in the file's types; all its fields
    without ``columns``); an unreadable file or block is a ``FileReadError`` naming the file."""
    _avro_magic(fh, path)
    try:
        reader = fastavro.reader(fh)  # the header only: records are decoded as they are iterated
        _safe_schema(reader.writer_schema, path)
        fields = _avro_fields(reader.writer_schema, path)
    except FileReadError:
        raise
    except Exception as err:  # noqa: BLE001 - whatever fastavro raises on a bad header: the file's fault
        raise _not_avro(path, err) from None
    if columns:
        wanted = set(columns)
        fields = [f for f in fields if f[0] in wanted]
    records: list[dict] = []
    n = 0
    try:
        for record in reader:
            records.append(record)
            n += 1
            if len(records) >= batch_rows:
                yield _avro_batch(records, fields, path)
                records = []
            if limit is not None and n >= limit:
                break
    except FileReadError:
        raise
    except Exception as err:  # noqa: BLE001 - a truncated or corrupt block
        raise _not_avro(path, err) from None
    if records or n == 0:
        yield _avro_batch(records, fields, path)


def avro_head(path: str, rows: int = 10_000) -> pa.Table:
    """The first ``rows`` rows of an Avro file, typed from its schema (an empty table of its columns when it has
    none); a file that is not Avro is a ``FileReadError`` naming it."""
    with FileSystems.open(path) as fh:
        return pa.Table.from_batches(list(_avro_records(fh, path, None, rows, limit=rows)))


def check_avro_file(path: str) -> int:
    """Reads every block of an Avro file (its framing and sync markers; records stay undecoded): the number of
    records, or a ``FileReadError`` naming a file that is not Avro, is truncated or corrupt."""
    n = 0
    with FileSystems.open(path) as fh:
        _avro_magic(fh, path)
        try:
            blocks = fastavro.block_reader(fh)
            _safe_schema(blocks.writer_schema, path)
            for block in blocks:
                n += block.num_records
        except FileReadError:
            raise
        except Exception as err:  # noqa: BLE001 - whatever fastavro raises: the file's fault
            raise _not_avro(path, err) from None
    return n

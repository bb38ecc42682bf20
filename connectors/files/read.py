"""Files of any of the four formats, each told apart by its name (``units.file_format``), or all of one declared
format: ``ReadFromFiles`` in Beam, ``iter_unit`` / ``read_unit`` outside it."""
from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import pyarrow as pa
import pyarrow.csv as pacsv

from connectors.files.avroio import read_avro
from connectors.files.csvio import read_csv
from connectors.files.jsonio import read_json_lines
from connectors.files.parquetio import read_parquet
from connectors.files.units import (
    BLOCK_BYTES,
    MAX_RECORD_BYTES,
    FileUnit,
    ReadUnits,
    ReadUnitsFn,
    no_dead_letters,
    read_items,
)
from connectors.rows import DeadLetter

__all__ = ["READERS", "ReadFromFiles", "iter_unit", "read_unit"]

#: Each format's reader (a new format: a module with its reader and ``ReadFromX``, and its entry here).
READERS = {"parquet": read_parquet, "avro": read_avro, "csv": read_csv, "jsonl": read_json_lines}


def read_any(fh, unit: FileUnit, **options) -> Iterator[tuple]:
    """The reader of a unit of any format: its format's."""
    return READERS[unit.fmt](fh, unit, **options)


def iter_unit(unit: FileUnit, *, columns: Sequence[str] | None = None, batch_rows: int = 65_536,
              with_source: bool = False, csv_convert: pacsv.ConvertOptions | None = None,
              column_types: Mapping[str, pa.DataType] | None = None, block_bytes: int = BLOCK_BYTES,
              max_record_bytes: int = MAX_RECORD_BYTES) -> Iterator[pa.RecordBatch | DeadLetter]:
    """Record batches of one unit (at most ``batch_rows`` rows each) and a ``DeadLetter`` for each
    row that cannot be read or does not fit its declared type."""
    return read_items(unit, read_any, columns=columns, batch_rows=batch_rows, with_source=with_source,
                      csv_convert=csv_convert, column_types=column_types, block_bytes=block_bytes,
                      max_record_bytes=max_record_bytes)


def read_unit(unit: FileUnit, *, columns: Sequence[str] | None = None, batch_rows: int = 65_536,
              with_source: bool = False, csv_convert: pacsv.ConvertOptions | None = None,
              column_types: Mapping[str, pa.DataType] | None = None, block_bytes: int = BLOCK_BYTES,
              max_record_bytes: int = MAX_RECORD_BYTES) -> Iterator[pa.RecordBatch]:
    """Record batches of one unit; a row that cannot be read is a ``FileReadError`` naming file and line
    (use ``ReadFromFiles(..., with_errors=True)`` to get such rows as dead letters instead)."""
    return no_dead_letters(iter_unit(unit, columns=columns, batch_rows=batch_rows, with_source=with_source,
                                     csv_convert=csv_convert, column_types=column_types, block_bytes=block_bytes,
                                     max_record_bytes=max_record_bytes))


class _ReadFilesFn(ReadUnitsFn):
    reader = staticmethod(read_any)


class ReadFromFiles(ReadUnits):
    """Parquet, Avro, CSV and JSON-lines files as ``pyarrow.RecordBatch``es, each file's format from its name
    unless ``file_format`` declares one (the options of ``units.ReadUnits``)."""

    read_fn = _ReadFilesFn

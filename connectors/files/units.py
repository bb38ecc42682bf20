"""What every file format shares: the units of reading work (a whole file, or one Parquet row group), declared
column types applied a column at a time, the record bound's dead letters, and the Beam machinery that lists the
units of file patterns, spreads them and reads each (``ReadUnits``: the base of ``ReadFromFiles`` and of each
format's ``ReadFromX``).

A format's reader (``csvio.read_csv``, ``jsonio.read_json_lines``, ``avroio.read_avro``, ``parquetio.read_parquet``)
turns an open file into ``("rows", batch, row numbers)`` and ``("bad", line, payload, reason)`` items;
``read_items`` turns those into record batches (typed, selected, with their source) and ``DeadLetter``s.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import NamedTuple

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
from apache_beam.io.filesystems import FileSystems

from connectors.deadletter import ERRS
from connectors.paths import origins
from connectors.rows import SOURCE_FILE, SOURCE_ROW, DeadLetter, parse_numbers

#: The longest CSV record or JSON line read (``--max-record-bytes``); a longer one is a dead letter.
MAX_RECORD_BYTES = 8 << 20
#: Bytes read at a time from a text file.
BLOCK_BYTES = 4 << 20
#: Bytes of an oversized record kept as its dead letter's payload.
SAMPLE_BYTES = 1024

_FORMATS = {".parquet": "parquet", ".pq": "parquet", ".avro": "avro", ".csv": "csv", ".jsonl": "jsonl",
            ".ndjson": "jsonl", ".json": "jsonl"}

#: A format's reader: ``(open file, unit, **read options) -> items`` (see the module doc).
Reader = Callable[..., Iterator[tuple]]


class FileReadError(ValueError):
    """A file (or a row of it) cannot be read; the message names the file and line."""


class FileUnit(NamedTuple):
    """One unit of reading work: a whole CSV/JSON-lines/Avro file or one Parquet row group."""

    path: str
    fmt: str
    row_group: int | None  # Parquet only
    first_row: int  # row number of the unit's first row within its file


def file_format(path: str, declared: str | None = None) -> str:
    if declared:
        if declared not in ("parquet", "avro", "csv", "jsonl"):
            raise ValueError(f"unknown file format {declared!r}: use parquet, avro, csv or jsonl")
        return declared
    name = path.lower()
    for suffix in (".gz", ".bz2", ".zst"):
        name = name.removesuffix(suffix)
    for ext, fmt in _FORMATS.items():
        if name.endswith(ext):
            return fmt
    raise ValueError(f"cannot tell the format of {path!r} from its name; pass file_format="
                     f"'parquet', 'avro', 'csv' or 'jsonl'")


def list_units(path: str, fmt: str) -> list[FileUnit]:
    if fmt != "parquet":
        return [FileUnit(path, fmt, None, 0)]
    with FileSystems.open(path) as fh:
        meta = pq.ParquetFile(fh).metadata
    units, first = [], 0
    for i in range(meta.num_row_groups):
        units.append(FileUnit(path, fmt, i, first))
        first += meta.row_group(i).num_rows
    return units


def numbered(unit: FileUnit, batches: Iterator[pa.RecordBatch]) -> Iterator[tuple]:
    """The ``("rows", batch, row indices)`` items of a columnar unit (Parquet, Avro): rows numbered from the
    unit's first row, empty batches left out."""
    first = unit.first_row
    for batch in batches:
        if batch.num_rows == 0:
            continue
        rows = np.arange(first, first + batch.num_rows)
        first += batch.num_rows
        yield ("rows", batch, rows)


def oversized(sample: bytes, size: int, bound: int, what: str) -> tuple[str, str]:
    """(payload, reason) of the dead letter of a record longer than the bound: its start and its size."""
    payload = sample[:SAMPLE_BYTES].decode("utf-8", errors="replace")
    return (f"{payload}... ({size:,} bytes)",
            f"{what} is larger than {bound:,} bytes (--max-record-bytes); it was skipped, not read")


def _with_source(batch: pa.RecordBatch, path: str, rows: np.ndarray) -> pa.RecordBatch:
    files = pa.DictionaryArray.from_arrays(pa.array(np.zeros(batch.num_rows, dtype=np.int32)),
                                           pa.array([path]))
    return (batch.append_column(SOURCE_FILE, files.cast(pa.string()))
            .append_column(SOURCE_ROW, pa.array(np.asarray(rows, dtype=np.int64))))


# ---------------------------------------------------------------------------------------------
# Declared types: a column at a time, rows whose value does not fit are flagged
# ---------------------------------------------------------------------------------------------
def _to_integer(col: pa.Array, t: pa.DataType, target: pa.DataType, name: str
                ) -> tuple[pa.Array, np.ndarray | None, str]:
    """Text or numbers -> an integer type: a value that is not a number, not whole (1.5), out of
    the type's range, or (read through float64) beyond 2**53 where it would be rounded, flags its
    row: never truncated, wrapped or rounded silently. Plain integers written as text are exact."""
    reason = f"column {name!r} holds a value that is not a whole number in the range of {target}"
    if pa.types.is_integer(t):
        kept, unfit = _integer_in_range(col, target)
        return kept, unfit, reason
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        text = pc.utf8_trim_whitespace(col.cast(pa.string()))
        plain = pc.fill_null(pc.match_substring_regex(text, r"^[+-]?\d{1,18}$"), False)  # exact in int64
        none = pa.scalar(None, pa.string())
        exact = pc.cast(pc.if_else(plain, text, none), pa.int64())
        values, bad = parse_numbers(pc.if_else(plain, none, text))  # 1e3, 7.0, 1.5, x, 19+ digits
        merged = pc.if_else(plain, exact, _whole_numbers(values, bad, pa.int64()))
        kept, unfit = _integer_in_range(merged, target)
        return kept, bad | unfit, reason
    if pa.types.is_floating(t) or pa.types.is_decimal(t) or pa.types.is_boolean(t):
        bad = np.zeros(len(col), dtype=bool)
        kept = _whole_numbers(pc.cast(col, pa.float64()), bad, target)
        return kept, bad, reason
    raise FileReadError(f"column {name!r} has type {t}, which cannot be read as the declared {target}")


def _whole_numbers(values: pa.Array, bad: np.ndarray, target: pa.DataType) -> pa.Array:
    """float64 -> ``target``; a value that is not whole, out of range or past 2**53 becomes null and
    is marked in ``bad`` (in place)."""
    info = np.iinfo(target.to_pandas_dtype())
    x = values.to_numpy(zero_copy_only=False).astype(np.float64)  # nulls -> NaN
    with np.errstate(invalid="ignore"):
        unfit = ~np.isnan(x) & ((x != np.floor(x)) | (x < float(info.min)) | (x >= float(info.max) + 1.0)
                                | (np.abs(x) > 2.0 ** 53))
    bad |= unfit
    return pc.cast(pc.if_else(pa.array(unfit), pa.scalar(None, pa.float64()), values), target, safe=False)


def _integer_in_range(col: pa.Array, target: pa.DataType) -> tuple[pa.Array, np.ndarray]:
    """An integer array as ``target``, compared as integers (not through float64): out of range -> null, marked."""
    info, have = np.iinfo(target.to_pandas_dtype()), np.iinfo(col.type.to_pandas_dtype())
    unfit = np.zeros(len(col), dtype=bool)
    for outside, bound in ((pc.less, info.min), (pc.greater, info.max)):
        if have.min < bound < have.max:
            hit = pc.fill_null(outside(col, pa.scalar(int(bound), col.type)), False)
            unfit |= np.asarray(hit.to_numpy(zero_copy_only=False), dtype=bool)
    return pc.cast(pc.if_else(pa.array(unfit), pa.scalar(None, col.type), col), target, safe=False), unfit


def _conform(col: pa.Array, target: pa.DataType, name: str) -> tuple[pa.Array, np.ndarray | None, str]:
    """``col`` as ``target``; (array, rows whose value does not fit or None, reason)."""
    t = col.type
    if pa.types.is_dictionary(t):
        col, t = col.cast(t.value_type), t.value_type
    if pa.types.is_null(t):
        return pa.nulls(len(col), target), None, ""
    if pa.types.is_integer(target) and t != target:
        return _to_integer(col, t, target, name)
    if pa.types.is_floating(target) or pa.types.is_integer(target):
        if pa.types.is_string(t) or pa.types.is_large_string(t):
            values, bad = parse_numbers(col)
            return values.cast(target, safe=False), bad, f"column {name!r} holds a value that is not a number"
        if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t) or pa.types.is_boolean(t):
            return pc.cast(col, target, safe=False), None, ""
    elif pa.types.is_string(target) or pa.types.is_large_string(target):
        if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_integer(t) or \
                pa.types.is_floating(t) or pa.types.is_boolean(t) or pa.types.is_decimal(t) or \
                pa.types.is_temporal(t):
            return pc.cast(col, target), None, ""
    elif t == target:
        return col, None, ""
    raise FileReadError(f"column {name!r} has type {t}, which cannot be read as the declared {target}")


def conform_batch(batch: pa.RecordBatch, types: Mapping[str, pa.DataType], where: str
                   ) -> tuple[pa.RecordBatch, np.ndarray, list[str]]:
    """Declared columns converted (missing ones null); (batch, rejected mask, reason per row)."""
    bad = np.zeros(batch.num_rows, dtype=bool)
    reasons = [""] * batch.num_rows
    names = batch.schema.names
    for name, target in types.items():
        if target is None:
            continue
        if name not in names:
            batch = batch.append_column(name, pa.nulls(batch.num_rows, target))
            names = batch.schema.names
            continue
        try:
            values, fails, reason = _conform(batch.column(name), target, name)
        except FileReadError as err:
            raise FileReadError(f"{where}: {err}") from None
        if fails is not None and fails.any():
            for i in np.flatnonzero(fails & ~bad):
                reasons[i] = reason
            bad |= fails
        batch = batch.set_column(names.index(name), name, values)
    return batch, bad, reasons



# ---------------------------------------------------------------------------------------------
# One unit of work
# ---------------------------------------------------------------------------------------------
def read_items(unit: FileUnit, reader: Reader, *, columns: Sequence[str] | None = None, batch_rows: int = 65_536,
               with_source: bool = False, csv_convert: pacsv.ConvertOptions | None = None,
               column_types: Mapping[str, pa.DataType] | None = None, block_bytes: int = BLOCK_BYTES,
               max_record_bytes: int = MAX_RECORD_BYTES, source_names: Mapping[str, str] | None = None
               ) -> Iterator[pa.RecordBatch | DeadLetter]:
    """Record batches of one unit read by ``reader`` (at most ``batch_rows`` rows each) and a ``DeadLetter``
    for each row that cannot be read or does not fit its declared type. ``source_names``: the name a file goes
    by in sources (a downloaded copy's URL: ``connectors.paths.origins``), else its path."""
    types = dict(column_types) if column_types else None
    where = (source_names or {}).get(unit.path, unit.path)
    with FileSystems.open(unit.path) as fh:
        for item in reader(fh, unit, columns=columns, types=types, batch_rows=batch_rows, csv_convert=csv_convert,
                           block_bytes=block_bytes, max_record_bytes=max_record_bytes):
            if item[0] == "bad":
                _, line, text, reason = item
                yield DeadLetter(text, f"{where}:{line if line is not None else '?'}", reason)
            else:
                _, batch, rows = item
                yield from _finish(batch, rows, types, columns, with_source, where)


def _finish(batch: pa.RecordBatch, rows: np.ndarray, types, columns, with_source: bool, where: str):
    """Declared types applied, columns selected, source added; rejected rows as dead letters."""
    if types:
        original = batch
        batch, bad, reasons = conform_batch(batch, types, where)
        if bad.any():
            idx = np.flatnonzero(bad)
            payloads = original.take(pa.array(idx)).to_pylist()
            for i, payload in zip(idx, payloads):
                yield DeadLetter(payload, f"{where}:{int(rows[i])}", reasons[i])
            keep = pa.array(~bad)
            batch, rows = batch.filter(keep), rows[~bad]
    if columns:
        missing = [c for c in columns if c not in batch.schema.names]
        if missing:
            raise FileReadError(f"{where}: has no column(s) {', '.join(missing)}; it has "
                                f"{', '.join(batch.schema.names)}")
        batch = batch.select(list(columns))
    if batch.num_rows:
        yield _with_source(batch, where, rows) if with_source else batch


def no_dead_letters(items: Iterator[pa.RecordBatch | DeadLetter]) -> Iterator[pa.RecordBatch]:
    """The batches of ``items``; a rejected row is a ``FileReadError`` naming its file and line."""
    for item in items:
        if isinstance(item, DeadLetter):
            raise FileReadError(f"{item.source}: {item.reason}: {str(item.payload)[:200]}")
        yield item


class ListUnitsFn(beam.DoFn):
    """File patterns -> the ``FileUnit``s of every file they match (in path order)."""

    def __init__(self, file_format: str | None):
        self._format = file_format

    def process(self, pattern: str) -> Iterator[FileUnit]:
        matched = FileSystems.match([pattern])[0].metadata_list
        if not matched:
            raise FileNotFoundError(f"no file matches {pattern!r}")
        for meta in sorted(matched, key=lambda m: m.path):
            yield from list_units(meta.path, file_format(meta.path, self._format))


class ReadUnitsFn(beam.DoFn):
    """A unit -> its record batches (and, ``with_errors``, its dead letters on ``ERRS``), read by ``reader``:
    each format's ``_ReadXFn`` names its own."""

    reader: Reader

    def __init__(self, with_errors: bool, **read_kwargs):
        self._errors, self._kwargs = with_errors, read_kwargs

    def process(self, unit: FileUnit) -> Iterator[pa.RecordBatch]:
        items = read_items(unit, type(self).reader, **self._kwargs)
        if not self._errors:
            yield from no_dead_letters(items)
            return
        for item in items:
            yield beam.pvalue.TaggedOutput(ERRS, item) if isinstance(item, DeadLetter) else item


class ReadUnits(beam.PTransform):
    """Reads files matching one or more patterns as ``pyarrow.RecordBatch``es, a unit at a time (the base of
    ``ReadFromFiles`` and each format's ``ReadFromX``: a subclass sets ``read_fn``, its ``ReadUnitsFn``, and a
    format's own ``fixed_format``).

    Args:
      file_patterns: a path or glob (any Beam filesystem), or a list of them.
      file_format: ``"parquet"``, ``"avro"``, ``"csv"`` or ``"jsonl"``; by default from each file's suffix.
      columns: read only these columns.
      batch_rows: the most rows in one batch.
      with_source: add ``_source_file`` and ``_source_row`` columns (the row's file and its line
        in a text file, or its row index in a Parquet file), so later steps can name a bad row's source.
      column_types: declared Arrow types of columns (None for a column: keep what is read); text
        files are then read in blocks of ``block_bytes`` and a value that does not fit rejects its row.
      with_errors: return ``(batches, errs)``, ``errs`` holding a ``DeadLetter`` (source
        ``file:line``) per rejected row; without it a rejected row fails the read, naming file and line.
      max_record_bytes: the longest CSV record or JSON line read; a longer one is rejected (a dead
        letter holding its first KiB and its size), never held in memory whole.
    """

    read_fn: type[ReadUnitsFn]
    fixed_format: str | None = None

    def __init__(self, file_patterns: str | Sequence[str], *, file_format: str | None = None,
                 columns: Sequence[str] | None = None, batch_rows: int = 65_536,
                 with_source: bool = False, csv_convert: pacsv.ConvertOptions | None = None,
                 column_types: Mapping[str, pa.DataType] | None = None, with_errors: bool = False,
                 block_bytes: int = BLOCK_BYTES, max_record_bytes: int = MAX_RECORD_BYTES):
        super().__init__()
        if self.fixed_format and file_format not in (None, self.fixed_format):
            raise ValueError(f"{type(self).__name__} reads {self.fixed_format} files, not {file_format}: use "
                             f"ReadFromFiles(file_format={file_format!r})")
        self._patterns = [file_patterns] if isinstance(file_patterns, str) else list(file_patterns)
        self._format = file_format or self.fixed_format
        self._errors = with_errors
        self._read = {"columns": columns, "batch_rows": batch_rows, "with_source": with_source,
                      "csv_convert": csv_convert, "column_types": dict(column_types) if column_types else None,
                      "block_bytes": block_bytes, "max_record_bytes": int(max_record_bytes),
                      # files downloaded from an object store go by their URL in sources (worked out here, in the
                      # process that downloaded them: workers elsewhere get the names with the DoFn)
                      "source_names": origins(self._patterns) or None}
        if self._read["max_record_bytes"] < 1:
            raise ValueError(f"max_record_bytes must be at least 1, not {max_record_bytes}")

    def expand(self, pbegin):
        units = (pbegin
                 | "Patterns" >> beam.Create(self._patterns)
                 | "ListUnits" >> beam.ParDo(ListUnitsFn(self._format))
                 | "SpreadUnits" >> beam.Reshuffle())
        read = beam.ParDo(self.read_fn(self._errors, **self._read))
        if self._errors:
            return units | "ReadUnits" >> read.with_outputs(ERRS, main="rows")
        return units | "ReadUnits" >> read

"""Parquet, CSV and JSON-lines files as Arrow record batches in Beam.

``ReadFromFiles`` splits its work by file and, for Parquet, by row group: each (file, row
group) is one element after a ``Reshuffle``, so a runner reads them in parallel. Elements are
``pyarrow.RecordBatch``es, never rows: on the FnApiRunner a row costs ~3 µs per step, a batch
of thousands of rows about 50 µs.

Text files and bad input. With ``column_types`` (declared types, e.g. ``{"x": pa.float64()}``)
CSV and JSON-lines files are read in blocks (``block_bytes``) and every declared column is
converted to its type in Arrow, a column at a time: a value that does not fit (a word in a
numeric column on line 3,000,000) rejects its row, not the file. Rows that cannot be read at
all (a CSV record with the wrong number of fields, a malformed JSON line) are rejected too.
With ``with_errors=True`` rejected rows are ``DeadLetter``s on the ``errs`` output, their
source ``file:line``; without it the read stops with a ``FileReadError`` naming the file and
line. CSV values may hold quoted newlines (lines are still counted right). A header that
repeats a column name is a ``FileReadError`` naming the file and the names.

Record bounds. A CSV record (quoted newlines included) or a JSON line may be up to
``max_record_bytes`` long (default ``MAX_RECORD_BYTES``, 8 MiB), whatever the block size: a
longer one is a dead letter naming its file and line (its payload: the first KiB), skipped
without being held in memory. A CSV header longer than the bound is a ``FileReadError`` saying so.
CSV files with declared types are cut into blocks at record ends (a newline outside quotes:
RFC 4180 quoting; a quote inside an unquoted field is not supported) and each block is parsed
on its own, so no record ever straddles two blocks.

``_source_row`` (``with_source=True``) is the row's line number in its file (1-based, the
line where the record starts) for CSV and JSON-lines, and its row index (0-based) for Parquet.
"""
from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import NamedTuple

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.json as pajson
import pyarrow.parquet as pq
from apache_beam.io.filesystems import FileSystems

from connectors.deadletter import ERRS, DeadLetter

__all__ = ["ReadFromFiles", "FileUnit", "FileReadError", "file_format", "list_units", "read_unit", "iter_unit",
           "csv_header", "parse_numbers", "SOURCE_FILE", "SOURCE_ROW", "CSV_NULLS", "MAX_RECORD_BYTES",
           "BLOCK_BYTES", "record_end", "read_csv_header"]

#: Columns added by ``with_source=True``: where each row came from (for dead letters).
SOURCE_FILE = "_source_file"
SOURCE_ROW = "_source_row"
#: Strings read as null in CSV files (R's ``NA`` among them).
CSV_NULLS = ["", "NA", "N/A", "null", "NULL", "NaN", "nan"]

#: The longest CSV record or JSON line read (``--max-record-bytes``); a longer one is a dead letter.
MAX_RECORD_BYTES = 8 << 20
#: Bytes read at a time from a text file.
BLOCK_BYTES = 4 << 20
#: Bytes of an oversized record kept as its dead letter's payload.
_SAMPLE_BYTES = 1024

_FORMATS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".jsonl": "jsonl",
            ".ndjson": "jsonl", ".json": "jsonl"}
_NUMBER = r"^[-+]?(\d+\.?\d*([eE][-+]?\d+)?|\.\d+([eE][-+]?\d+)?|(?i:inf|infinity|nan))$"


class FileReadError(ValueError):
    """A file (or a row of it) cannot be read; the message names the file and line."""


class FileUnit(NamedTuple):
    """One unit of reading work: a whole CSV/JSON-lines file or one Parquet row group."""

    path: str
    fmt: str
    row_group: int | None  # Parquet only
    first_row: int  # row number of the unit's first row within its file


def file_format(path: str, declared: str | None = None) -> str:
    if declared:
        if declared not in ("parquet", "csv", "jsonl"):
            raise ValueError(f"unknown file format {declared!r}: use parquet, csv or jsonl")
        return declared
    name = path.lower()
    for suffix in (".gz", ".bz2", ".zst"):
        name = name.removesuffix(suffix)
    for ext, fmt in _FORMATS.items():
        if name.endswith(ext):
            return fmt
    raise ValueError(f"cannot tell the format of {path!r} from its name; pass file_format="
                     f"'parquet', 'csv' or 'jsonl'")


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


def _with_source(batch: pa.RecordBatch, path: str, rows: np.ndarray) -> pa.RecordBatch:
    files = pa.DictionaryArray.from_arrays(pa.array(np.zeros(batch.num_rows, dtype=np.int32)),
                                           pa.array([path]))
    return (batch.append_column(SOURCE_FILE, files.cast(pa.string()))
            .append_column(SOURCE_ROW, pa.array(np.asarray(rows, dtype=np.int64))))


# ---------------------------------------------------------------------------------------------
# Declared types: a column at a time, rows whose value does not fit are flagged
# ---------------------------------------------------------------------------------------------
def parse_numbers(col: pa.Array) -> tuple[pa.Array, np.ndarray]:
    """Strings -> float64 and a mask of the non-null values that are not numbers (-> null)."""
    col = pc.utf8_trim_whitespace(col.cast(pa.string()))
    ok = pc.match_substring_regex(col, _NUMBER)
    values = pc.cast(pc.if_else(ok, col, pa.scalar(None, pa.string())), pa.float64())
    bad = np.asarray(pc.and_(pc.is_valid(col), pc.invert(pc.fill_null(ok, False))).to_numpy(zero_copy_only=False),
                     dtype=bool)
    return values, bad


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


def _conform_batch(batch: pa.RecordBatch, types: Mapping[str, pa.DataType], where: str
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
# CSV
# ---------------------------------------------------------------------------------------------
def record_end(buf: bytes | memoryview, quoted: bool = False) -> int:
    """The index just past the last newline of ``buf`` that ends a CSV record (outside quotes, when
    ``buf`` starts at a record start; inside, when ``quoted``), or -1 when there is none."""
    a = np.frombuffer(buf, dtype=np.uint8)
    newlines = np.flatnonzero(a == 10)
    if newlines.size == 0:
        return -1
    quotes = np.flatnonzero(a == 34)
    before = np.searchsorted(quotes, newlines) + (1 if quoted else 0)  # quotes before each newline
    ends = newlines[(before & 1) == 0]
    return int(ends[-1]) + 1 if ends.size else -1


def _first_record_end(buf: bytes, quoted: bool) -> tuple[int, bool]:
    """(index past the first record-ending newline or -1, whether ``buf``'s end lies inside quotes)."""
    a = np.frombuffer(buf, dtype=np.uint8)
    newlines = np.flatnonzero(a == 10)
    quotes = np.flatnonzero(a == 34)
    if newlines.size:
        before = np.searchsorted(quotes, newlines) + (1 if quoted else 0)
        ends = newlines[(before & 1) == 0]
        if ends.size:
            return int(ends[0]) + 1, False
    return -1, bool((quotes.size + (1 if quoted else 0)) & 1)


def read_csv_header(fh, path: str, max_record_bytes: int = MAX_RECORD_BYTES) -> tuple[list[str], bytes]:
    """The header's names and the bytes read past it; a header longer than the bound is a ``FileReadError``."""
    buf = b""
    while True:
        chunk = fh.read(min(BLOCK_BYTES, max_record_bytes + 1))
        buf += chunk
        cut, _ = _first_record_end(buf, False)
        if cut >= 0 or not chunk:
            break
        if len(buf) > max_record_bytes:
            raise FileReadError(f"{path}: the header (line 1) is longer than {max_record_bytes:,} bytes without "
                                f"ending (a header of that size, or an unclosed quote); raise --max-record-bytes "
                                f"if the header really is that long")
    head, rest = (buf[:cut], buf[cut:]) if cut >= 0 else (buf, b"")
    if len(head) > max_record_bytes:
        raise FileReadError(f"{path}: the header (line 1) is {len(head):,} bytes, longer than {max_record_bytes:,} "
                            f"(--max-record-bytes); raise it if the header really is that long")
    text = head.decode("utf-8-sig", errors="replace").rstrip("\r\n")
    csv.field_size_limit(max(csv.field_size_limit(), len(text) + 1))  # a long name is a name, not an error
    names = next(csv.reader(io.StringIO(text)), []) if text else []
    if not names:
        raise FileReadError(f"{path}: the file is empty: a CSV file needs a header line naming its columns")
    seen: dict[str, list[int]] = {}
    for i, n in enumerate(names):
        seen.setdefault(n, []).append(i + 1)
    dup = {n: pos for n, pos in seen.items() if len(pos) > 1}
    if dup:
        said = "; ".join(f"{n!r} (columns {', '.join(map(str, pos))})" for n, pos in dup.items())
        raise FileReadError(f"{path}: the header repeats column names: {said}. Give every column its own "
                            f"name in line 1 of the file")
    return names, rest


def csv_header(path: str, max_record_bytes: int = MAX_RECORD_BYTES) -> list[str]:
    """The header's column names (a header of any size up to ``max_record_bytes``); a name given
    twice, an empty file or a longer header is a ``FileReadError``."""
    with FileSystems.open(path) as fh:
        return read_csv_header(fh, path, max_record_bytes)[0]


def _oversized(sample: bytes, size: int, bound: int, what: str) -> tuple[str, str]:
    """(payload, reason) of the dead letter of a record longer than the bound: its start and its size."""
    payload = sample[:_SAMPLE_BYTES].decode("utf-8", errors="replace")
    return (f"{payload}... ({size:,} bytes)",
            f"{what} is larger than {bound:,} bytes (--max-record-bytes); it was skipped, not read")


def _csv_blocks(fh, rest: bytes, block_bytes: int, max_record_bytes: int) -> Iterator[tuple]:
    """("block", bytes, first line) of whole records, and ("bad", line, payload, reason) for a
    record longer than the bound (read on to its end without holding it)."""
    buf, line = rest, 2
    while True:
        chunk = fh.read(block_bytes)
        buf = buf + chunk if buf else chunk
        if not chunk:
            if buf.strip():
                if len(buf) > max_record_bytes:
                    yield ("bad", line, *_oversized(buf, len(buf), max_record_bytes, "CSV record"))
                else:
                    yield ("block", buf if buf.endswith(b"\n") else buf + b"\n", line)
            return
        cut = record_end(buf)
        if cut > 0:
            block, buf = buf[:cut], buf[cut:]
            yield ("block", block, line)
            line += block.count(b"\n")
        if len(buf) <= max_record_bytes:
            continue
        # one record longer than the bound: read on to its end, keeping only its start
        sample, size, newlines = buf[:_SAMPLE_BYTES], len(buf), buf.count(b"\n")
        quoted = bool(buf.count(b'"') & 1)
        buf = b""
        while True:
            chunk = fh.read(block_bytes)
            if not chunk:
                break
            end, quoted = _first_record_end(chunk, quoted)
            if end >= 0:
                size += end
                newlines += chunk.count(b"\n", 0, end)
                buf = chunk[end:]
                break
            size += len(chunk)
            newlines += chunk.count(b"\n")
        yield ("bad", line, *_oversized(sample, size, max_record_bytes, "CSV record"))
        line += newlines
        if not chunk:
            return


class _CsvLines:
    """Line numbers of CSV records: pyarrow reports the record number of a rejected row (header
    = record 1); values with quoted newlines make a record span several lines."""

    def __init__(self, first_record: int = 2, extra: int = 0):
        self.next_record, self.extra = first_record, extra
        self.invalid: dict[int, str] = {}
        self.unnumbered: list[str] = []

    def reject(self, row) -> str:
        if row.number is None:
            self.unnumbered.append(row.text)
        else:
            self.invalid[int(row.number)] = row.text
        return "skip"

    def assign(self, newlines: np.ndarray) -> tuple[np.ndarray, list[tuple[int, str]]]:
        """Lines of the next ``len(newlines)`` accepted records, and the rejected ones among them."""
        k = len(newlines)
        pending = sorted(n for n in self.invalid if n >= self.next_record)
        m = 0
        while m < len(pending) and pending[m] < self.next_record + k + m:
            m += 1
        records = np.arange(self.next_record, self.next_record + k + m, dtype=np.int64)
        is_bad = np.isin(records, np.asarray(pending[:m], dtype=np.int64))
        per_record = np.zeros(k + m, dtype=np.int64)
        per_record[~is_bad] = newlines
        per_record[is_bad] = [self.invalid[int(r)].count("\n") for r in records[is_bad]]
        lines = records + self.extra + np.cumsum(per_record) - per_record
        self.extra += int(per_record.sum())
        self.next_record += k + m
        rejected = [(int(lines[i]), self.invalid.pop(int(records[i]))) for i in np.flatnonzero(is_bad)]
        return lines[~is_bad], rejected

    def rest(self) -> list[tuple[int | None, str]]:
        out: list[tuple[int | None, str]] = []
        for number in sorted(self.invalid):
            out.append((number + self.extra, self.invalid[number]))
            self.extra += self.invalid[number].count("\n")
        self.invalid = {}
        out += [(None, text) for text in self.unnumbered]
        self.unnumbered = []
        return out


def _newlines(batch: pa.RecordBatch) -> np.ndarray:
    total = np.zeros(batch.num_rows, dtype=np.int64)
    for col in batch.columns:
        if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
            total += pc.fill_null(pc.count_substring(col, "\n"), 0).to_numpy(zero_copy_only=False)
    return total


def _csv_items(fh, path: str, types: Mapping[str, pa.DataType] | None, convert: pacsv.ConvertOptions | None,
               batch_rows: int, block_bytes: int, max_record_bytes: int = MAX_RECORD_BYTES) -> Iterator[tuple]:
    """("rows", batch, lines) and ("bad", line, payload, reason) items of one CSV file."""
    names, rest = read_csv_header(fh, path, max_record_bytes)
    n_fields = len(names)
    if types is None:
        # No declared types: a whole-file read infers each column's type from all of it (a
        # streaming reader decides on the first block and fails on a later "NA").
        lines = _CsvLines(first_record=1, extra=1)  # record 1 is line 2: the header is not a record here
        parse = pacsv.ParseOptions(newlines_in_values=True, invalid_row_handler=lines.reject)
        opts = convert or pacsv.ConvertOptions(null_values=CSV_NULLS, strings_can_be_null=True)
        try:
            table = pacsv.read_csv(io.BytesIO(rest + fh.read()), read_options=pacsv.ReadOptions(
                use_threads=False, column_names=names), parse_options=parse, convert_options=opts)
        except pa.ArrowInvalid as err:
            raise FileReadError(f"{path}: cannot be read as CSV: {err}") from None
        yield from _csv_batches(table, lines, batch_rows, n_fields)
        return
    # Declared types: every column read as text, in blocks cut at record ends, converted by
    # ``_conform_batch``: nothing is inferred from a block, and no record straddles two blocks.
    opts = pacsv.ConvertOptions(column_types={n: pa.string() for n in names}, null_values=CSV_NULLS,
                                strings_can_be_null=True, quoted_strings_can_be_null=True)
    for item in _csv_blocks(fh, rest, block_bytes, max_record_bytes):
        if item[0] == "bad":
            yield item
            continue
        _, block, first_line = item
        lines = _CsvLines(first_record=1, extra=first_line - 1)
        parse = pacsv.ParseOptions(newlines_in_values=True, invalid_row_handler=lines.reject)
        try:
            table = pacsv.read_csv(io.BytesIO(block), read_options=pacsv.ReadOptions(
                use_threads=False, column_names=names, block_size=len(block) + 64), parse_options=parse,
                convert_options=opts)
        except pa.ArrowInvalid as err:
            raise FileReadError(f"{path}: cannot be read as CSV after line {first_line - 1}: {err}") from None
        yield from _csv_batches(table, lines, batch_rows, n_fields)


def _csv_batches(table: pa.Table, lines: _CsvLines, batch_rows: int, n_fields: int) -> Iterator[tuple]:
    for batch in table.to_batches(max_chunksize=batch_rows):
        for start in range(0, batch.num_rows, batch_rows):
            part = batch.slice(start, batch_rows)
            line_numbers, rejected = lines.assign(_newlines(part))
            for line, text in rejected:
                yield ("bad", line, text, _field_count_reason(text, n_fields))
            if part.num_rows:
                yield ("rows", part, line_numbers)
    for line, text in lines.rest():
        yield ("bad", line, text, _field_count_reason(text, n_fields))


def _field_count_reason(text: str, expected: int) -> str:
    try:
        found = len(next(csv.reader(io.StringIO(text))))
    except (csv.Error, StopIteration):
        found = "another number of"
    return f"CSV row has {found} fields, the header has {expected}"


# ---------------------------------------------------------------------------------------------
# JSON lines
# ---------------------------------------------------------------------------------------------
def _json_value(value, target: pa.DataType | None):
    """One JSON value as ``target`` (Python), or raise ValueError saying why it does not fit."""
    if value is None or target is None:
        return value
    if pa.types.is_floating(target) or pa.types.is_integer(target):
        if isinstance(value, bool):
            return float(value)
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            parsed, bad = parse_numbers(pa.array([value]))
            if not bad[0]:
                return parsed[0].as_py()
        raise ValueError("holds a value that is not a number")
    if pa.types.is_string(target) or pa.types.is_large_string(target):
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, (int, float, str)):
            return pc.cast(pa.array([value]), pa.string())[0].as_py() if not isinstance(value, str) else value
        raise ValueError("holds an object or array, not a value")
    return value


def _json_rows_slow(lines: list[bytes], line_numbers: list[int], columns: Sequence[str] | None,
                    types: Mapping[str, pa.DataType] | None):
    """Line by line with ``json``: the rows that parse, and (line, text, reason) for the rest."""
    rows, kept, bad = [], [], []
    wanted = list(columns) if columns else None
    for raw, line in zip(lines, line_numbers):
        text = raw.decode("utf-8", errors="replace")
        try:
            obj = json.loads(raw)
        except Exception as err:  # noqa: BLE001 - JSON, encoding, recursion depth: all the row's fault
            bad.append((line, text, f"malformed JSON line: {type(err).__name__}: {str(err)[:200]}"))
            continue
        if not isinstance(obj, dict):
            bad.append((line, text, f"JSON line is a {type(obj).__name__}, not an object"))
            continue
        row = {}
        try:
            for key in (wanted or obj.keys()):
                target = (types or {}).get(key)
                try:
                    row[key] = _json_value(obj.get(key), target)
                except ValueError as err:
                    raise ValueError(f"column {key!r} {err}") from None
        except ValueError as err:
            bad.append((line, text, str(err)))
            continue
        rows.append(row)
        kept.append(line)
    return rows, kept, bad


def _json_table(rows: list[dict], types: Mapping[str, pa.DataType] | None, columns, path: str) -> pa.Table:
    names = list(columns) if columns else list(dict.fromkeys(k for r in rows for k in r))
    arrays = []
    for name in names:
        values = [r.get(name) for r in rows]
        target = (types or {}).get(name)
        try:
            arrays.append(pa.array(values, type=target) if target is not None else pa.array(values))
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as err:
            raise FileReadError(f"{path}: column {name!r} mixes types that cannot form one column ({err}); "
                                f"declare its type") from None
    return pa.Table.from_arrays(arrays, names=names)


def _json_items(fh, path: str, columns: Sequence[str] | None, types: Mapping[str, pa.DataType] | None,
                batch_rows: int, block_bytes: int, max_record_bytes: int = MAX_RECORD_BYTES) -> Iterator[tuple]:
    """Blocks of whole lines; a line longer than ``max_record_bytes`` is a dead letter, read past
    without being held (never concatenated, never parsed)."""
    rest, first_line = b"", 1
    while True:
        chunk = fh.read(block_bytes)
        data = rest + chunk if rest else chunk
        if not chunk:
            block, rest = data, b""
        else:
            cut = data.rfind(b"\n") + 1
            block, rest = (data[:cut], data[cut:]) if cut else (b"", data)
        if block:
            lines = block.split(b"\n")
            if lines and lines[-1] == b"":
                lines.pop()
            numbers, texts = [], []
            for i, raw in enumerate(lines):
                if len(raw) > max_record_bytes:
                    yield ("bad", first_line + i, *_oversized(raw, len(raw), max_record_bytes, "JSON line"))
                elif raw.strip():
                    numbers.append(first_line + i)
                    texts.append(raw)
            first_line += len(lines)
            if texts:
                yield from _json_block(texts, numbers, path, columns, types, batch_rows)
        if not chunk:
            return
        if len(rest) > max_record_bytes:  # a line longer than the bound: skip to its end
            sample, size = rest[:_SAMPLE_BYTES], len(rest)
            rest = b""
            while chunk := fh.read(block_bytes):
                end = chunk.find(b"\n")
                if end >= 0:
                    size += end
                    rest = chunk[end + 1:]
                    break
                size += len(chunk)
            yield ("bad", first_line, *_oversized(sample, size, max_record_bytes, "JSON line"))
            first_line += 1
            if not chunk:
                return


def _json_block(texts: list[bytes], numbers: list[int], path: str, columns, types, batch_rows: int):
    table = None
    try:
        table = pajson.read_json(io.BytesIO(b"\n".join(texts) + b"\n"),
                                 read_options=pajson.ReadOptions(use_threads=False,
                                                                 block_size=sum(map(len, texts)) + len(texts) + 64))
        if table.num_rows != len(texts):
            table = None
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        table = None
    if table is None:
        rows, kept, bad = _json_rows_slow(texts, numbers, columns, types)
        for line, text, reason in bad:
            yield ("bad", line, text, reason)
        if not rows:
            return
        table, line_numbers = _json_table(rows, types, columns, path), np.asarray(kept, dtype=np.int64)
    else:
        line_numbers = np.asarray(numbers, dtype=np.int64)
        if columns:
            present = set(table.schema.names)
            table = pa.Table.from_arrays(
                [table.column(c) if c in present else pa.nulls(table.num_rows) for c in columns], names=list(columns))
    for start in range(0, table.num_rows, batch_rows):
        part = table.slice(start, batch_rows).combine_chunks()
        batch = part.to_batches()[0] if part.num_rows else None
        if batch is not None:
            yield ("rows", batch, line_numbers[start: start + batch.num_rows])


# ---------------------------------------------------------------------------------------------
# One unit of work
# ---------------------------------------------------------------------------------------------
def iter_unit(unit: FileUnit, *, columns: Sequence[str] | None = None, batch_rows: int = 65_536,
              with_source: bool = False, csv_convert: pacsv.ConvertOptions | None = None,
              column_types: Mapping[str, pa.DataType] | None = None, block_bytes: int = BLOCK_BYTES,
              max_record_bytes: int = MAX_RECORD_BYTES) -> Iterator[pa.RecordBatch | DeadLetter]:
    """Record batches of one unit (at most ``batch_rows`` rows each) and a ``DeadLetter`` for each
    row that cannot be read or does not fit its declared type."""
    types = dict(column_types) if column_types else None
    where = unit.path
    with FileSystems.open(unit.path) as fh:
        if unit.fmt == "parquet":
            pf = pq.ParquetFile(fh)
            first = unit.first_row
            for batch in pf.iter_batches(batch_size=batch_rows, row_groups=[unit.row_group],
                                         columns=list(columns) if columns else None):
                if batch.num_rows == 0:
                    continue
                rows = np.arange(first, first + batch.num_rows)
                first += batch.num_rows
                yield from _finish(batch, rows, types, columns, with_source, where)
            return
        items = (_csv_items(fh, unit.path, types, csv_convert, batch_rows, block_bytes, max_record_bytes)
                 if unit.fmt == "csv" else
                 _json_items(fh, unit.path, columns, types, batch_rows, block_bytes, max_record_bytes))
        for item in items:
            if item[0] == "bad":
                _, line, text, reason = item
                yield DeadLetter(text, f"{unit.path}:{line if line is not None else '?'}", reason)
            else:
                _, batch, lines = item
                yield from _finish(batch, lines, types, columns, with_source, where)


def _finish(batch: pa.RecordBatch, rows: np.ndarray, types, columns, with_source: bool, where: str):
    """Declared types applied, columns selected, source added; rejected rows as dead letters."""
    if types:
        original = batch
        batch, bad, reasons = _conform_batch(batch, types, where)
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


def read_unit(unit: FileUnit, *, columns: Sequence[str] | None = None, batch_rows: int = 65_536,
              with_source: bool = False, csv_convert: pacsv.ConvertOptions | None = None,
              column_types: Mapping[str, pa.DataType] | None = None, block_bytes: int = BLOCK_BYTES,
              max_record_bytes: int = MAX_RECORD_BYTES) -> Iterator[pa.RecordBatch]:
    """Record batches of one unit; a row that cannot be read is a ``FileReadError`` naming file and line
    (use ``ReadFromFiles(..., with_errors=True)`` to get such rows as dead letters instead)."""
    for item in iter_unit(unit, columns=columns, batch_rows=batch_rows, with_source=with_source,
                          csv_convert=csv_convert, column_types=column_types, block_bytes=block_bytes,
                          max_record_bytes=max_record_bytes):
        if isinstance(item, DeadLetter):
            raise FileReadError(f"{item.source}: {item.reason}: {str(item.payload)[:200]}")
        yield item


class _ListUnitsFn(beam.DoFn):
    def __init__(self, file_format: str | None):
        self._format = file_format

    def process(self, pattern: str) -> Iterator[FileUnit]:
        matched = FileSystems.match([pattern])[0].metadata_list
        if not matched:
            raise FileNotFoundError(f"no file matches {pattern!r}")
        for meta in sorted(matched, key=lambda m: m.path):
            yield from list_units(meta.path, file_format(meta.path, self._format))


class _ReadUnitFn(beam.DoFn):
    def __init__(self, with_errors: bool, **read_kwargs):
        self._errors, self._kwargs = with_errors, read_kwargs

    def process(self, unit: FileUnit) -> Iterator[pa.RecordBatch]:
        if not self._errors:
            yield from read_unit(unit, **self._kwargs)
            return
        for item in iter_unit(unit, **self._kwargs):
            yield beam.pvalue.TaggedOutput(ERRS, item) if isinstance(item, DeadLetter) else item


class ReadFromFiles(beam.PTransform):
    """Reads files matching one or more patterns as ``pyarrow.RecordBatch``es.

    Args:
      file_patterns: a path or glob (any Beam filesystem), or a list of them.
      file_format: ``"parquet"``, ``"csv"`` or ``"jsonl"``; by default from each file's suffix.
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

    def __init__(self, file_patterns: str | Sequence[str], *, file_format: str | None = None,
                 columns: Sequence[str] | None = None, batch_rows: int = 65_536,
                 with_source: bool = False, csv_convert: pacsv.ConvertOptions | None = None,
                 column_types: Mapping[str, pa.DataType] | None = None, with_errors: bool = False,
                 block_bytes: int = BLOCK_BYTES, max_record_bytes: int = MAX_RECORD_BYTES):
        super().__init__()
        self._patterns = [file_patterns] if isinstance(file_patterns, str) else list(file_patterns)
        self._format = file_format
        self._errors = with_errors
        self._read = {"columns": columns, "batch_rows": batch_rows, "with_source": with_source,
                      "csv_convert": csv_convert, "column_types": dict(column_types) if column_types else None,
                      "block_bytes": block_bytes, "max_record_bytes": int(max_record_bytes)}
        if self._read["max_record_bytes"] < 1:
            raise ValueError(f"max_record_bytes must be at least 1, not {max_record_bytes}")

    def expand(self, pbegin):
        units = (pbegin
                 | "Patterns" >> beam.Create(self._patterns)
                 | "ListUnits" >> beam.ParDo(_ListUnitsFn(self._format))
                 | "SpreadUnits" >> beam.Reshuffle())
        read = beam.ParDo(_ReadUnitFn(self._errors, **self._read))
        if self._errors:
            return units | "ReadUnits" >> read.with_outputs(ERRS, main="rows")
        return units | "ReadUnits" >> read

"""CSV files: a header naming the columns, RFC 4180 quoting (values may hold quoted newlines; lines are still
counted right). ``ReadFromCsv`` reads them in Beam (``ReadFromFiles`` too, by the file name).

Without declared types a file is read whole and each column's type inferred from all of it. With declared types
it is cut into blocks at record ends (a newline outside quotes; a quote inside an unquoted field is not supported),
every column read as text and converted (``units.conform_batch``), so no record straddles two blocks. A record
(quoted newlines included) longer than ``max_record_bytes`` is a dead letter, read past without being held; a
record with the wrong number of fields is one too. A header longer than the bound, or one that repeats a column
name, is a ``FileReadError``.
"""
from __future__ import annotations

import csv
import io
from collections.abc import Iterator, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
from apache_beam.io.filesystems import FileSystems

from connectors.files.units import (
    BLOCK_BYTES,
    MAX_RECORD_BYTES,
    SAMPLE_BYTES,
    FileReadError,
    FileUnit,
    ReadUnits,
    ReadUnitsFn,
    oversized,
)

__all__ = ["CSV_NULLS", "ReadFromCsv", "csv_header", "read_csv", "read_csv_header", "record_end"]

#: Strings read as null in CSV files (R's ``NA`` among them).
CSV_NULLS = ["", "NA", "N/A", "null", "NULL", "NaN", "nan"]


def read_csv(fh, unit: FileUnit, *, types: Mapping[str, pa.DataType] | None = None,
             csv_convert: pacsv.ConvertOptions | None = None, batch_rows: int = 65_536, block_bytes: int = BLOCK_BYTES,
             max_record_bytes: int = MAX_RECORD_BYTES, **_) -> Iterator[tuple]:
    """The reader of a CSV unit (``units.Reader``)."""
    return _csv_items(fh, unit.path, types, csv_convert, batch_rows, block_bytes, max_record_bytes)


class _ReadCsvFn(ReadUnitsFn):
    reader = staticmethod(read_csv)


class ReadFromCsv(ReadUnits):
    """CSV files as ``pyarrow.RecordBatch``es (the options of ``units.ReadUnits``; ``csv_convert``: pyarrow's
    convert options when no types are declared)."""

    read_fn = _ReadCsvFn
    fixed_format = "csv"


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


def _record_ends(buf: bytes) -> np.ndarray:
    """The index just past each newline of ``buf`` that ends a CSV record (``buf`` starts at a record start)."""
    a = np.frombuffer(buf, dtype=np.uint8)
    newlines = np.flatnonzero(a == 10)
    quotes = np.flatnonzero(a == 34)
    return newlines[(np.searchsorted(quotes, newlines) & 1) == 0] + 1


def _bounded_records(block: bytes, line: int, max_record_bytes: int) -> Iterator[tuple]:
    """``block`` (whole records) as ("block", bytes, first line) items, with each record longer than the bound
    (its bytes without the newline that ends it) a ("bad", line, payload, reason) item in its place."""
    ends = _record_ends(block)
    if not ends.size or ends[-1] != len(block):
        ends = np.append(ends, len(block))  # the file's last record, without a newline
    starts = np.r_[0, ends[:-1]]
    sizes = ends - starts - (np.frombuffer(block, dtype=np.uint8)[ends - 1] == 10)
    too_long = np.flatnonzero(sizes > max_record_bytes)
    if not too_long.size:
        yield ("block", block, line)
        return
    at = 0
    for i in too_long:
        start, end = int(starts[i]), int(ends[i])
        if start > at:
            yield ("block", block[at:start], line)
            line += block.count(b"\n", at, start)
        yield ("bad", line, *oversized(block[start:start + SAMPLE_BYTES], int(sizes[i]), max_record_bytes,
                                         "CSV record"))
        line += block.count(b"\n", start, end)
        at = end
    if at < len(block):
        yield ("block", block[at:], line)


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
    size = len(head) - head.endswith(b"\n")  # its bytes without the newline that ends it, as a record's
    if size > max_record_bytes:
        raise FileReadError(f"{path}: the header (line 1) is {size:,} bytes, longer than {max_record_bytes:,} "
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


def _csv_blocks(fh, rest: bytes, block_bytes: int, max_record_bytes: int) -> Iterator[tuple]:
    """("block", bytes, first line) of whole records, and ("bad", line, payload, reason) for a
    record longer than the bound (read on to its end without holding it)."""
    buf, line = rest, 2
    while True:
        chunk = fh.read(block_bytes)
        buf = buf + chunk if buf else chunk
        if not chunk:
            if buf.strip():
                yield from _bounded_records(buf if buf.endswith(b"\n") else buf + b"\n", line, max_record_bytes)
            return
        cut = record_end(buf)
        if cut > 0:  # whole records; one longer than the bound (it ended in this chunk) is a dead letter
            block, buf = buf[:cut], buf[cut:]
            yield from _bounded_records(block, line, max_record_bytes)
            line += block.count(b"\n")
        if len(buf) <= max_record_bytes:
            continue
        # one record longer than the bound: read on to its end, keeping only its start
        sample, size, newlines = buf[:SAMPLE_BYTES], len(buf), buf.count(b"\n")
        quoted = bool(buf.count(b'"') & 1)
        buf = b""
        while True:
            chunk = fh.read(block_bytes)
            if not chunk:
                break
            end, quoted = _first_record_end(chunk, quoted)
            if end >= 0:
                size += end - 1  # its bytes without the newline that ends it, as everywhere
                newlines += chunk.count(b"\n", 0, end)
                buf = chunk[end:]
                break
            size += len(chunk)
            newlines += chunk.count(b"\n")
        yield ("bad", line, *oversized(sample, size, max_record_bytes, "CSV record"))
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

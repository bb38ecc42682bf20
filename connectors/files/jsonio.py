"""JSON-lines files: one object per line. ``ReadFromJsonLines`` reads them in Beam (``ReadFromFiles`` too, by the
file name: ``.jsonl``, ``.ndjson``, ``.json``).

Blocks of whole lines are parsed by pyarrow; a block it refuses is read line by line, so a malformed line, a line
that is not an object, or a value that does not fit its declared type rejects its row, not the file. A line longer
than ``max_record_bytes`` is a dead letter, read past without being held (never concatenated, never parsed).
"""
from __future__ import annotations

import io
import json
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pajson

from connectors.files.units import (
    BLOCK_BYTES,
    MAX_RECORD_BYTES,
    SAMPLE_BYTES,
    FileReadError,
    FileUnit,
    ReadUnits,
    ReadUnitsFn,
    oversized,
    parse_numbers,
)

__all__ = ["ReadFromJsonLines", "read_json_lines"]


def read_json_lines(fh, unit: FileUnit, *, columns: Sequence[str] | None = None,
                    types: Mapping[str, pa.DataType] | None = None, batch_rows: int = 65_536,
                    block_bytes: int = BLOCK_BYTES, max_record_bytes: int = MAX_RECORD_BYTES, **_) -> Iterator[tuple]:
    """The reader of a JSON-lines unit (``units.Reader``)."""
    return _json_items(fh, unit.path, columns, types, batch_rows, block_bytes, max_record_bytes)


class _ReadJsonLinesFn(ReadUnitsFn):
    reader = staticmethod(read_json_lines)


class ReadFromJsonLines(ReadUnits):
    """JSON-lines files as ``pyarrow.RecordBatch``es (the options of ``units.ReadUnits``)."""

    read_fn = _ReadJsonLinesFn
    fixed_format = "jsonl"


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
                    yield ("bad", first_line + i, *oversized(raw, len(raw), max_record_bytes, "JSON line"))
                elif raw.strip():
                    numbers.append(first_line + i)
                    texts.append(raw)
            first_line += len(lines)
            if texts:
                yield from _json_block(texts, numbers, path, columns, types, batch_rows)
        if not chunk:
            return
        if len(rest) > max_record_bytes:  # a line longer than the bound: skip to its end
            sample, size = rest[:SAMPLE_BYTES], len(rest)
            rest = b""
            while chunk := fh.read(block_bytes):
                end = chunk.find(b"\n")
                if end >= 0:
                    size += end
                    rest = chunk[end + 1:]
                    break
                size += len(chunk)
            yield ("bad", first_line, *oversized(sample, size, max_record_bytes, "JSON line"))
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

"""A micro-batch of JSON events at a time: one pyarrow JSON read, validated with compute kernels
(``kernel_valid``), equal to ``pipelines.stream.events.parse_event`` + ``events_table`` row by row; a group the
reader or the kernels reject is split and read again, the smallest groups event by event, so a bad event is a
dead letter of its own. ``parse_rows`` checks rows another format decoded (Avro, Protobuf) the same way."""
from __future__ import annotations

import io
import json
import math
from collections.abc import Sequence

import pyarrow as pa
import pyarrow.compute as pc

from connectors.deadletter import DeadLetter
from pipelines.stream.events import (
    DEFAULT_BOUNDS,
    EventField,
    EventSchema,
    ParseBounds,
    as_text,
    as_times,
    events_table,
    parse_event,
    validate_event,
)

_SMALLEST_GROUP = 16  # a rejected group this small is parsed row by row instead of split again


def _fast_candidate(payload, bounds: ParseBounds) -> bool:
    """Whether the JSON reader may read this payload as exactly one row that ``parse_event`` would
    judge alike; anything else goes row by row (multi-line values, empty ones, too large or
    possibly too deep ones, anything that is not one object)."""
    if not isinstance(payload, bytes) or len(payload) > bounds.max_event_bytes:
        return False
    if b"\n" in payload or b"\r" in payload:
        return False
    if not payload.isascii():  # the JSON reader does not check UTF-8; json.loads does
        try:
            payload.decode("utf-8")
        except UnicodeDecodeError:
            return False
    body = payload.strip()
    return (body[:1] == b"{" and body[-1:] == b"}"
            and payload.count(b"{") + payload.count(b"[") <= bounds.max_json_depth)


def _read_options(schema: EventSchema):
    import pyarrow.json as pj

    explicit = pa.schema([(f.name, f.read_type) for f in schema.fields if f.read_type is not None])
    inferred = any(f.read_type is None for f in schema.fields)
    return pj.ParseOptions(explicit_schema=explicit, unexpected_field_behavior="infer" if inferred else "ignore")


def _inferred_ok(col: pa.ChunkedArray, f: EventField) -> bool:
    """Whether a column the reader inferred holds only types the field accepts (as one type)."""
    t = col.type
    if pa.types.is_null(t) or pa.types.is_string(t):
        return pa.types.is_null(t) or str in f.types
    if pa.types.is_boolean(t):
        return bool in f.types
    if pa.types.is_integer(t):
        return int in f.types
    if pa.types.is_floating(t):
        return float in f.types
    return False  # e.g. a timestamp the reader made of text: row by row


def kernel_valid(table: pa.Table, schema: EventSchema, bounds: ParseBounds, *,
                 null_is_present: bool = False) -> pa.ChunkedArray:
    """Rows every check of ``parse_event`` passes, judged column by column; the others are left
    to ``parse_event`` to name their reason. ``null_is_present``: a null is a field present with a
    null value (typed formats, whose decoders give every field they have), not a missing key."""
    ok = pa.chunked_array([pa.array([True] * table.num_rows)])
    int_bound = math.floor(bounds.max_abs_number)
    for f in schema.fields:
        if f.name not in table.column_names:
            if f.required:  # no row has it
                return pa.chunked_array([pa.array([False] * table.num_rows)])
            continue
        col = table.column(f.name)
        present = pc.is_valid(col)
        if (f.required and not null_is_present) or not f.nullable:  # JSON's reader cannot tell null from missing
            ok = pc.and_(ok, present)
        if f.read_type is None and not _inferred_ok(col, f):
            ok = pc.and_(ok, pc.invert(present))
            continue
        if pa.types.is_floating(col.type):
            good = pc.and_(pc.invert(pc.or_(pc.is_nan(col), pc.is_inf(col))),
                           pc.less_equal(pc.abs(col), bounds.max_abs_number))
        elif pa.types.is_integer(col.type):
            good = pc.and_(pc.less_equal(col, int_bound), pc.greater_equal(col, -int_bound))
        elif f.time_format:
            good = pc.is_valid(pc.strptime(col, format=f.time_format, unit="s", error_is_null=True))
        else:
            continue
        ok = pc.and_(ok, pc.fill_null(good, True))
    return ok


def _normalize(table: pa.Table, schema: EventSchema) -> pa.Table:
    """The reader's columns (only rows ``kernel_valid`` kept) -> the events-table fields."""
    columns = {}
    for f in schema.fields:
        if f.name not in table.column_names:
            columns[f.name] = pa.nulls(table.num_rows, f.table_type)
            continue
        col = table.column(f.name)
        if f.read_type is None:
            col = as_text(col, f)
        elif f.time_format:
            col = as_times(col, f)
        columns[f.name] = col.cast(f.table_type)
    return pa.table(columns)


def _read_json(payloads: list[bytes], indices: list[int], schema: EventSchema, bounds: ParseBounds,
               good: list[tuple[list[int], pa.Table]], slow: list[int]) -> None:
    """Read ``indices`` in one call; a group the reader rejects is split in halves until small."""
    import pyarrow.json as pj

    try:
        table = pj.read_json(io.BytesIO(b"\n".join(payloads[i] for i in indices)), parse_options=_read_options(schema))
        if table.num_rows != len(indices):
            raise ValueError("not one row per payload")
        table.validate(full=True)  # e.g. invalid UTF-8 in a string
        valid = kernel_valid(table, schema, bounds).to_numpy(zero_copy_only=False)
        kept = [i for i, v in zip(indices, valid) if v]
        normalized = _normalize(table.filter(pa.array(valid)), schema) if kept else None
    except Exception:  # noqa: BLE001 - a broken or mistyped event somewhere in the group
        if len(indices) <= _SMALLEST_GROUP:
            slow.extend(indices)
            return
        half = len(indices) // 2
        _read_json(payloads, indices[:half], schema, bounds, good, slow)
        _read_json(payloads, indices[half:], schema, bounds, good, slow)
        return
    slow.extend(i for i, v in zip(indices, valid) if not v)
    if kept:
        good.append((kept, normalized))


def _with_sources(table: pa.Table, sources: list[tuple[str, int, int]], schema: EventSchema) -> pa.Table:
    partitions = pa.array([p for _, p, _ in sources], pa.int64())
    offsets = pa.array([o for _, _, o in sources], pa.int64())
    topics = pa.array([t for t, _, _ in sources], pa.string())
    text = pc.binary_join_element_wise(topics, pc.cast(partitions, pa.string()), pc.cast(offsets, pa.string()), "/")
    table = table.append_column("source", text).append_column("src_partition", partitions) \
        .append_column("src_offset", offsets)
    return table.cast(schema.table_schema())


def parse_batch(payloads: Sequence[bytes | None], sources: Sequence[tuple[str, int, int]], schema: EventSchema,
                bounds: ParseBounds = DEFAULT_BOUNDS) -> tuple[pa.Table | None, list[DeadLetter]]:
    """A micro-batch of raw events -> (events table as ``events_table`` builds it, dead letters).

    The batch's JSON values are read in one pyarrow call and checked with compute kernels;
    only values the kernels cannot vouch for (and those in a group the reader rejects) are
    parsed row by row by ``parse_event``, which names each reject's reason. The result equals
    ``parse_event`` + ``events_table`` row by row, in the order of ``payloads``. Never raises on
    the content of an event.
    """
    payloads, sources = list(payloads), list(sources)
    fast = [i for i, p in enumerate(payloads) if _fast_candidate(p, bounds)]
    slow = sorted(set(range(len(payloads))) - set(fast))
    good: list[tuple[list[int], pa.Table]] = []
    if fast:
        _read_json(payloads, fast, schema, bounds, good, slow)
    return _assemble(payloads, sources, schema, good, slow,
                     lambda i, src: parse_event(payloads[i], src, schema, bounds))


def _assemble(payloads: list, sources: list, schema: EventSchema, good: list[tuple[list[int], pa.Table]],
              slow: list[int], check) -> tuple[pa.Table | None, list[DeadLetter]]:
    """The kernels' rows (``good``) and the others checked one at a time (``check(i, source)``: an event dict
    or its dead letter) -> (events table in payload order, dead letters in payload order)."""
    letters: list[tuple[int, DeadLetter]] = []
    parsed_idx, parsed = [], []
    for i in sorted(slow):
        t, p, o = sources[i]
        out = check(i, f"{t}/{p}/{o}")
        if isinstance(out, DeadLetter):
            letters.append((i, out))
        else:
            parsed_idx.append(i)
            parsed.append(out)
    tables, order = [], []
    for indices, table in good:
        tables.append(_with_sources(table, [sources[i] for i in indices], schema))
        order += indices
    if parsed:
        try:
            tables.append(events_table(parsed, [sources[i] for i in parsed_idx], schema))
            order += parsed_idx
        except Exception:  # noqa: BLE001 - find the event(s) that cannot become a row
            for i, event in zip(parsed_idx, parsed):
                try:
                    tables.append(events_table([event], [sources[i]], schema))
                    order.append(i)
                except Exception as err:  # noqa: BLE001
                    t, p, o = sources[i]
                    letters.append((i, DeadLetter(payloads[i], f"{t}/{p}/{o}",
                                                  f"unparseable event: {type(err).__name__}: {str(err)[:500]}")))
    letters.sort(key=lambda pair: pair[0])
    if not tables:
        return None, [letter for _, letter in letters]
    table = pa.concat_tables(tables)
    if order != sorted(order):
        table = table.take(pc.sort_indices(pa.array(order)))
    return table, [letter for _, letter in letters]


def parse_rows(rows: Sequence[dict | DeadLetter], payloads: Sequence[bytes | None],
               sources: Sequence[tuple[str, int, int]], schema: EventSchema, bounds: ParseBounds = DEFAULT_BOUNDS,
               *, absent_is_null: bool = False) -> tuple[pa.Table | None, list[DeadLetter]]:
    """Events another format decoded (a dict of field values per payload, or the payload's dead letter) ->
    (events table, dead letters), as ``parse_batch`` makes of JSON: the rows are checked with the same
    kernels in one table, and those the kernels cannot vouch for one at a time by ``validate_event``,
    which names each reject's reason. Never raises on the content of an event."""
    rows, payloads, sources = list(rows), list(payloads), list(sources)
    fast = [i for i, r in enumerate(rows) if isinstance(r, dict)]
    required = [f.name for f in schema.fields if f.required]
    slow: list[int] = [i for i, r in enumerate(rows) if not isinstance(r, dict)]
    good: list[tuple[list[int], pa.Table]] = []
    if fast:
        try:
            read = pa.schema([(f.name, f.read_type or pa.string()) for f in schema.fields])
            table = pa.Table.from_pylist([rows[i] for i in fast], schema=read)
            complete = all(n in rows[i] for i in fast for n in required)  # a null is a value then
            valid = kernel_valid(table, schema, bounds, null_is_present=complete or absent_is_null
                                 ).to_numpy(zero_copy_only=False)
            kept = [i for i, v in zip(fast, valid) if v]
            if kept:
                good.append((kept, _normalize(table.filter(pa.array(valid)), schema)))
            slow += [i for i, v in zip(fast, valid) if not v]
        except Exception:  # noqa: BLE001 - a value of another type somewhere: one at a time
            slow += fast

    def check(i: int, source: str):
        row = rows[i]
        if isinstance(row, DeadLetter):
            return row
        try:
            return validate_event(row, payloads[i], source, schema, bounds, absent_is_null=absent_is_null)
        except Exception as err:  # noqa: BLE001 - the content of one event must never stop the pipeline
            return DeadLetter(payloads[i], source, f"unparseable event: {type(err).__name__}: {str(err)[:500]}")

    return _assemble(payloads, sources, schema, good, slow, check)


def foreign_keys(payloads: Sequence[bytes | None], schema: EventSchema, sample: int = 20) -> list[str] | None:
    """The keys of an event of another table, when every JSON object among the first ``sample``
    payloads has none of ``schema``'s fields (events meant for another dataset); else None."""
    names, example, objects = set(schema.names), None, 0
    for payload in payloads[:sample]:
        try:
            event = json.loads(payload) if payload is not None else None
        except Exception:  # noqa: BLE001 - a broken event is its own dead letter
            continue
        if not isinstance(event, dict) or not event:  # an empty object says nothing about its table
            continue
        if names & set(event):
            return None
        objects += 1
        example = example or sorted(event)
    return example if objects else None

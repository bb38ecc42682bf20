"""Flight events as JSON on Kafka: what ``flowtrain replay`` produces and the stream pipeline parses.

An event is one row of the flights table (the raw columns the features read) as a JSON object,
``time_hour`` as ISO-8601 UTC. Parsing checks presence and type of every field; whatever fails
becomes a ``DeadLetter`` with the reason. Impossible values (a negative distance, a cancelled
flight without arrival delay) are the feature code's own checks, shared with the batch ETL.

Parsing never raises on the content of an event: it has bounds (``ParseBounds``: event size,
JSON nesting depth, number magnitude) and anything else that goes wrong with one event
(recursion, overflow, encoding, ...) is that event's dead letter, not the pipeline's failure.
"""
from __future__ import annotations

import datetime as dt
import json
import math
import random
from dataclasses import dataclass
from typing import Iterator

import pyarrow as pa
import pyarrow.compute as pc

from connectors.deadletter import DeadLetter
from pipelines.flights.features import HOUR_TYPE, RAW_COLUMNS

#: field -> accepted JSON types; None in the tuple means the field may be null.
_INT, _NUM, _STR = (int,), (int, float), (str,)
FIELDS: dict[str, tuple] = {
    "year": _INT, "month": _INT, "day": _INT, "hour": _INT, "minute": _INT,
    "sched_dep_time": _INT, "sched_arr_time": _INT, "carrier": _STR, "flight": _INT,
    "tailnum": (str, type(None)), "origin": _STR, "dest": _STR, "distance": _NUM,
    "time_hour": _STR, "arr_delay": (int, float, type(None)),
}
assert set(FIELDS) == set(RAW_COLUMNS)

EVENT_SCHEMA = pa.schema([
    ("year", pa.int64()), ("month", pa.int64()), ("day", pa.int64()), ("hour", pa.int64()),
    ("minute", pa.int64()), ("sched_dep_time", pa.int64()), ("sched_arr_time", pa.int64()),
    ("carrier", pa.string()), ("flight", pa.int64()), ("tailnum", pa.string()), ("origin", pa.string()),
    ("dest", pa.string()), ("distance", pa.float64()), ("time_hour", pa.string()), ("arr_delay", pa.float64()),
    ("source", pa.string()), ("src_partition", pa.int64()), ("src_offset", pa.int64()),
])

MALFORMED_KINDS = ("broken JSON", "missing field", "wrong type", "NaN", "impossible value")


@dataclass(frozen=True)
class ParseBounds:
    """Limits on one raw event; an event beyond one is a dead letter naming the bound.

    The defaults are far above a flight event (~300 bytes, depth 1, numbers < 10^5) and far
    below what hurts: a 1 MiB event, 32 levels of JSON, and numbers exact in a float64.
    """

    max_event_bytes: int = 1024 * 1024  # --max-event-bytes
    max_depth: int = 32  # --max-json-depth: nesting levels of objects and arrays
    max_abs_number: float = float(2 ** 53)  # --max-abs-number: |x| of any numeric field

    def __post_init__(self):
        for name in ("max_event_bytes", "max_depth", "max_abs_number"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"ParseBounds({name}={value!r}): must be a number > 0")


DEFAULT_BOUNDS = ParseBounds()


def _depth_exceeds(value, limit: int) -> bool:
    """Whether objects/arrays nest deeper than ``limit`` levels (iterative: no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def _magnitude(value) -> str:
    if isinstance(value, int) and value.bit_length() > 60:
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"
    return f"{value:.6g}"


def events_from_table(flights: pa.Table) -> Iterator[dict]:
    """Rows in event-time order (scheduled departure: time_hour, then minute), as JSON-able dicts."""
    order = pc.sort_indices(flights, sort_keys=[("time_hour", "ascending"), ("minute", "ascending")])
    table = flights.take(order).select(RAW_COLUMNS)
    hours = pc.strftime(pc.cast(table.column("time_hour"), HOUR_TYPE), format="%Y-%m-%dT%H:%M:%SZ")
    table = table.set_column(table.schema.get_field_index("time_hour"), "time_hour", hours)
    for batch in table.to_batches(max_chunksize=10_000):
        yield from batch.to_pylist()


def malform(event: dict, kind: str, rng: random.Random) -> bytes:
    """One bad event of the given kind (for demos and tests)."""
    if kind == "broken JSON":
        return json.dumps(event)[: rng.randint(5, 40)].encode()
    bad = dict(event)
    if kind == "missing field":
        bad.pop(rng.choice(["carrier", "origin", "distance", "sched_dep_time"]))
    elif kind == "wrong type":
        bad["distance"] = "far"
    elif kind == "NaN":
        bad["distance"] = float("nan")
    elif kind == "impossible value":
        bad["distance"] = -abs(bad.get("distance") or 100.0)
    return json.dumps(bad, allow_nan=True).encode()


def parse_event(payload: bytes | None, source: str, bounds: ParseBounds = DEFAULT_BOUNDS) -> dict | DeadLetter:
    """A valid-shaped event dict, or a dead letter saying what is wrong with it. Never raises."""
    try:
        return _parse_event(payload, source, bounds)
    except Exception as err:  # noqa: BLE001 - the content of one event must never stop the pipeline
        return DeadLetter(payload, source, f"unparseable event: {type(err).__name__}: {str(err)[:500]}")


def _parse_event(payload, source: str, bounds: ParseBounds) -> dict | DeadLetter:
    if payload is None:
        return DeadLetter(payload, source, "broken JSON: the record has no value")
    if len(payload) > bounds.max_event_bytes:
        return DeadLetter(payload, source, f"event too large: {len(payload):,} bytes, more than "
                                           f"max_event_bytes {bounds.max_event_bytes:,}")
    try:
        event = json.loads(payload)
    except RecursionError:
        return DeadLetter(payload, source, f"too deeply nested JSON: more levels than the parser can take "
                                           f"(max_depth {bounds.max_depth})")
    except UnicodeDecodeError as err:
        return DeadLetter(payload, source, f"broken JSON: not UTF-8 ({err})")
    except (TypeError, ValueError) as err:
        return DeadLetter(payload, source, f"broken JSON: {err}")
    if not isinstance(event, dict):
        return DeadLetter(payload, source, f"broken JSON: expected an object, got {type(event).__name__}")
    if _depth_exceeds(event, bounds.max_depth):
        return DeadLetter(payload, source, f"too deeply nested JSON: more than max_depth {bounds.max_depth} levels")
    missing = [f for f in FIELDS if f not in event]
    if missing:
        return DeadLetter(payload, source, f"missing field(s): {', '.join(missing)}")
    for name, types in FIELDS.items():
        value = event[name]
        if isinstance(value, bool) or not isinstance(value, types):
            return DeadLetter(payload, source, f"wrong type: field {name!r} is {type(value).__name__}, "
                                               f"expected {' or '.join(t.__name__ for t in types if t is not type(None))}")
        if isinstance(value, float) and not math.isfinite(value):
            return DeadLetter(payload, source, f"NaN: field {name!r} is {value}")
        if isinstance(value, (int, float)) and abs(value) > bounds.max_abs_number:
            return DeadLetter(payload, source, f"number out of range: field {name!r} is {_magnitude(value)}, "
                                               f"beyond max_abs_number {bounds.max_abs_number:.6g}")
    try:
        dt.datetime.strptime(event["time_hour"], "%Y-%m-%dT%H:%M:%SZ")
    except ValueError:
        return DeadLetter(payload, source,
                          f"wrong type: field 'time_hour' is not an ISO time ({event['time_hour'][:100]!r})")
    return event


def events_table(events: list[dict], sources: list[tuple[str, int, int]]) -> pa.Table:
    """Parsed events -> a raw-columns Arrow table with their Kafka sources, time_hour as UTC."""
    rows = [{**e, "source": f"{t}/{p}/{o}", "src_partition": p, "src_offset": o}
            for e, (t, p, o) in zip(events, sources)]
    table = pa.Table.from_pylist(rows, schema=EVENT_SCHEMA)
    hours = pc.strptime(table.column("time_hour"), format="%Y-%m-%dT%H:%M:%SZ", unit="s")
    hours = pc.assume_timezone(hours, "UTC") if hasattr(pc, "assume_timezone") else hours
    return table.set_column(table.schema.get_field_index("time_hour"), "time_hour", pc.cast(hours, HOUR_TYPE))



# ---------------------------------------------------------------------------------------------
# A micro-batch at a time: one pyarrow JSON read, validated with compute kernels
# ---------------------------------------------------------------------------------------------
#: The JSON fields as the reader types them (the event columns without their sources).
_JSON_SCHEMA = pa.schema([EVENT_SCHEMA.field(name) for name in RAW_COLUMNS])
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
            and payload.count(b"{") + payload.count(b"[") <= bounds.max_depth)


def _kernel_valid(table: pa.Table, bounds: ParseBounds) -> pa.ChunkedArray:
    """Rows every check of ``parse_event`` passes, judged column by column; the others are left
    to ``parse_event`` to name their reason."""
    ok = pa.chunked_array([pa.array([True] * table.num_rows)])
    for name in RAW_COLUMNS:  # the reader cannot tell null from missing: parse_event tells them apart
        ok = pc.and_(ok, pc.is_valid(table.column(name)))
    int_bound = math.floor(bounds.max_abs_number)
    for name in RAW_COLUMNS:
        col = table.column(name)
        if pa.types.is_floating(col.type):
            good = pc.and_(pc.invert(pc.or_(pc.is_nan(col), pc.is_inf(col))),
                           pc.less_equal(pc.abs(col), bounds.max_abs_number))
        elif pa.types.is_integer(col.type):
            good = pc.and_(pc.less_equal(col, int_bound), pc.greater_equal(col, -int_bound))
        else:
            continue
        ok = pc.and_(ok, pc.fill_null(good, True))
    hours = pc.strptime(table.column("time_hour"), format="%Y-%m-%dT%H:%M:%SZ", unit="s", error_is_null=True)
    return pc.and_(ok, pc.is_valid(hours))


def _read_json(payloads: list[bytes], indices: list[int], bounds: ParseBounds,
               good: list[tuple[list[int], pa.Table]], slow: list[int]) -> None:
    """Read ``indices`` in one call; a group the reader rejects is split in halves until small."""
    import io

    import pyarrow.json as pj

    try:
        table = pj.read_json(io.BytesIO(b"\n".join(payloads[i] for i in indices)),
                             parse_options=pj.ParseOptions(explicit_schema=_JSON_SCHEMA,
                                                           unexpected_field_behavior="ignore"))
        if table.num_rows != len(indices):
            raise ValueError("not one row per payload")
        table.validate(full=True)  # e.g. invalid UTF-8 in a string
    except Exception:  # noqa: BLE001 - a broken or mistyped event somewhere in the group
        if len(indices) <= _SMALLEST_GROUP:
            slow.extend(indices)
            return
        half = len(indices) // 2
        _read_json(payloads, indices[:half], bounds, good, slow)
        _read_json(payloads, indices[half:], bounds, good, slow)
        return
    valid = _kernel_valid(table, bounds).to_numpy(zero_copy_only=False)
    kept = [i for i, v in zip(indices, valid) if v]
    slow.extend(i for i, v in zip(indices, valid) if not v)
    if kept:
        good.append((kept, table.filter(pa.array(valid)).select(RAW_COLUMNS)))


def parse_batch(payloads: list[bytes | None], sources: list[tuple[str, int, int]],
                bounds: ParseBounds = DEFAULT_BOUNDS) -> tuple[pa.Table | None, list[DeadLetter]]:
    """A micro-batch of raw events -> (events table as ``events_table`` builds it, dead letters).

    The batch's JSON values are read in one pyarrow call and checked with compute kernels;
    only values the kernels cannot vouch for (and those in a group the reader rejects) are
    parsed row by row by ``parse_event``, which names each reject's reason. The result equals
    ``parse_event`` + ``events_table`` row by row (a test holds the two equal on every
    malformed kind), in the order of ``payloads``. Never raises on the content of an event.
    """
    fast = [i for i, p in enumerate(payloads) if _fast_candidate(p, bounds)]
    slow = sorted(set(range(len(payloads))) - set(fast))
    good: list[tuple[list[int], pa.Table]] = []
    if fast:
        _read_json(payloads, fast, bounds, good, slow)
    letters: list[tuple[int, DeadLetter]] = []
    parsed_idx, parsed = [], []
    for i in sorted(slow):
        t, p, o = sources[i]
        out = parse_event(payloads[i], f"{t}/{p}/{o}", bounds)
        if isinstance(out, DeadLetter):
            letters.append((i, out))
        else:
            parsed_idx.append(i)
            parsed.append(out)
    tables, order = [], []
    for indices, table in good:
        tables.append(_with_sources(table, [sources[i] for i in indices]))
        order += indices
    if parsed:
        try:
            tables.append(events_table(parsed, [sources[i] for i in parsed_idx]))
            order += parsed_idx
        except Exception:  # noqa: BLE001 - find the event(s) that cannot become a row
            for i, event in zip(parsed_idx, parsed):
                try:
                    tables.append(events_table([event], [sources[i]]))
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


def _with_sources(table: pa.Table, sources: list[tuple[str, int, int]]) -> pa.Table:
    """Raw columns read by the JSON reader -> the ``events_table`` layout."""
    partitions = pa.array([p for _, p, _ in sources], pa.int64())
    offsets = pa.array([o for _, _, o in sources], pa.int64())
    topics = pa.array([t for t, _, _ in sources], pa.string())
    text = pc.binary_join_element_wise(topics, pc.cast(partitions, pa.string()), pc.cast(offsets, pa.string()), "/")
    table = table.append_column("source", text).append_column("src_partition", partitions) \
        .append_column("src_offset", offsets)
    hours = pc.strptime(table.column("time_hour"), format="%Y-%m-%dT%H:%M:%SZ", unit="s")
    hours = pc.assume_timezone(hours, "UTC") if hasattr(pc, "assume_timezone") else hours
    table = table.set_column(table.schema.get_field_index("time_hour"), "time_hour", pc.cast(hours, HOUR_TYPE))
    return table.cast(pa.schema([f if f.name != "time_hour" else pa.field("time_hour", HOUR_TYPE)
                                 for f in EVENT_SCHEMA]))

"""Flight events as JSON on Kafka: what ``flowtrain replay`` produces and the stream pipeline parses.

An event is one row of the flights table (the raw columns the features read) as a JSON object,
``time_hour`` as ISO-8601 UTC. Parsing checks presence and type of every field; whatever fails
becomes a ``DeadLetter`` with the reason. Impossible values (a negative distance, a cancelled
flight without arrival delay) are the feature code's own checks, shared with the batch ETL.
"""
from __future__ import annotations

import datetime as dt
import json
import math
import random
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


def parse_event(payload: bytes | None, source: str) -> dict | DeadLetter:
    """A valid-shaped event dict, or a dead letter saying what is wrong with it."""
    try:
        event = json.loads(payload)
    except (TypeError, ValueError) as err:
        return DeadLetter(payload, source, f"broken JSON: {err}")
    if not isinstance(event, dict):
        return DeadLetter(payload, source, f"broken JSON: expected an object, got {type(event).__name__}")
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
    try:
        dt.datetime.strptime(event["time_hour"], "%Y-%m-%dT%H:%M:%SZ")
    except ValueError:
        return DeadLetter(payload, source, f"wrong type: field 'time_hour' is not an ISO time ({event['time_hour']!r})")
    return event


def events_table(events: list[dict], sources: list[tuple[str, int, int]]) -> pa.Table:
    """Parsed events -> a raw-columns Arrow table with their Kafka sources, time_hour as UTC."""
    rows = [{**e, "source": f"{t}/{p}/{o}", "src_partition": p, "src_offset": o}
            for e, (t, p, o) in zip(events, sources)]
    table = pa.Table.from_pylist(rows, schema=EVENT_SCHEMA)
    hours = pc.strptime(table.column("time_hour"), format="%Y-%m-%dT%H:%M:%SZ", unit="s")
    hours = pc.assume_timezone(hours, "UTC") if hasattr(pc, "assume_timezone") else hours
    return table.set_column(table.schema.get_field_index("time_hour"), "time_hour", pc.cast(hours, HOUR_TYPE))


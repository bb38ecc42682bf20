"""Flight events as JSON on Kafka: what ``flowtrain replay`` produces and the stream pipeline parses.

An event is one row of the flights table (the raw columns the features read) as a JSON object,
``time_hour`` as ISO-8601 UTC. The generic event parser (``pipelines.stream.events``) checks
presence and type of every field of ``FLIGHT_EVENTS``; whatever fails becomes a ``DeadLetter``
with the reason. Impossible values (a negative distance) are the feature code's own checks,
shared with the batch ETL. ``arr_delay`` may be null: a flight that has not landed (or never
will) is an unlabelled event, scored but not trained on.
"""
from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence

import pyarrow as pa
import pyarrow.compute as pc

from connectors.deadletter import DeadLetter
from pipelines.flights.features import HOUR_TYPE, IMPOSSIBLE_DISTANCE, RAW_COLUMNS
from pipelines.stream import events as E
from pipelines.stream import parse as stream_parse
from pipelines.stream.events import DEFAULT_BOUNDS, ISO_Z, EventField, EventSchema, ParseBounds

#: field -> accepted JSON types; None in the tuple means the field may be null.
_INT, _NUM, _STR = (int,), (int, float), (str,)
FIELDS: dict[str, tuple] = {
    "year": _INT, "month": _INT, "day": _INT, "hour": _INT, "minute": _INT,
    "sched_dep_time": _INT, "sched_arr_time": _INT, "carrier": _STR, "flight": _INT,
    "tailnum": (str, type(None)), "origin": _STR, "dest": _STR, "distance": _NUM,
    "time_hour": _STR, "arr_delay": (int, float, type(None)),
}
assert set(FIELDS) == set(RAW_COLUMNS)


def _field(name: str, types: tuple) -> EventField:
    accepted = tuple(t for t in types if t is not type(None))
    arrow = pa.string() if accepted == _STR else pa.int64() if accepted == _INT else pa.float64()
    return EventField(name, accepted, arrow, required=True, nullable=type(None) in types,
                      time_format=ISO_Z if name == "time_hour" else None)


#: Every field required (null allowed for tailnum and arr_delay), time_hour an ISO UTC hour.
FLIGHT_EVENTS = EventSchema(tuple(_field(name, FIELDS[name]) for name in RAW_COLUMNS))
EVENT_SCHEMA = FLIGHT_EVENTS.table_schema()
assert EVENT_SCHEMA.field("time_hour").type == HOUR_TYPE

#: The kinds of bad events ``malform`` makes (``flowtrain replay --malformed`` on the demo): each is the kind its dead
#: letter is counted under (``connectors.deadletter.reason_kind``), as the generic replay's kinds are
#: (``pipelines.stream.replay.MALFORMED_KINDS``), so a replay's count of a kind and the dead letters of it are one name.
MALFORMED_KINDS = ("broken JSON", "missing field(s)", "wrong type", "NaN", "infinite", "not UTF-8",
                   IMPOSSIBLE_DISTANCE)


def events_from_table(flights: pa.Table) -> Iterator[dict]:
    """Rows in event-time order (scheduled departure: time_hour, then minute), as JSON-able dicts."""
    order = pc.sort_indices(flights, sort_keys=[("time_hour", "ascending"), ("minute", "ascending")])
    table = flights.take(order).select(RAW_COLUMNS)
    hours = pc.strftime(pc.cast(table.column("time_hour"), HOUR_TYPE), format=ISO_Z)
    table = table.set_column(table.schema.get_field_index("time_hour"), "time_hour", hours)
    for batch in table.to_batches(max_chunksize=10_000):
        yield from batch.to_pylist()


def malform(event: dict, kind: str, rng: random.Random) -> bytes:
    """One bad event of the given kind (for demos and tests)."""
    if kind == "broken JSON":
        return json.dumps(event)[: rng.randint(5, 40)].encode()
    bad = dict(event)
    if kind == "missing field(s)":
        bad.pop(rng.choice(["carrier", "origin", "distance", "sched_dep_time"]))
    elif kind == "wrong type":
        bad["distance"] = "far"
    elif kind in ("NaN", "infinite"):
        bad["distance"] = float("nan") if kind == "NaN" else float("inf")
    elif kind == "not UTF-8":
        return b'{"_bytes": "\xff\xfe", ' + json.dumps(bad, allow_nan=True).encode()[1:]
    elif kind == IMPOSSIBLE_DISTANCE:
        bad["distance"] = -abs(bad.get("distance") or 100.0)
    else:
        raise ValueError(f"no malformed kind {kind!r}: the kinds are {', '.join(MALFORMED_KINDS)}")
    return json.dumps(bad, allow_nan=True).encode()


def parse_event(payload: bytes | None, source: str, bounds: ParseBounds = DEFAULT_BOUNDS) -> dict | DeadLetter:
    """``pipelines.stream.events.parse_event`` with the flights' fields."""
    return E.parse_event(payload, source, FLIGHT_EVENTS, bounds)


def events_table(events: list[dict], sources: list[tuple[str, int, int]]) -> pa.Table:
    """Parsed events -> a raw-columns Arrow table with their Kafka sources, time_hour as UTC."""
    return E.events_table(events, sources, FLIGHT_EVENTS)


def parse_batch(payloads: Sequence[bytes | None], sources: Sequence[tuple[str, int, int]],
                bounds: ParseBounds = DEFAULT_BOUNDS) -> tuple[pa.Table | None, list[DeadLetter]]:
    """``pipelines.stream.parse.parse_batch`` with the flights' fields."""
    return stream_parse.parse_batch(payloads, sources, FLIGHT_EVENTS, bounds)

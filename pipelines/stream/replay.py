"""A table's rows as JSON events, for ``flowtrain replay --input FILES``.

Files are read with the batch ETL's readers (``connectors.files``: CSV, Parquet, JSON lines),
ordered by an event-time column when one is given, and written as JSON objects keyed by column
name: times as ISO-8601 UTC text, nulls and non-finite floats as null. ``malform_event`` makes
bad events of every kind the stream pipeline rejects, ``drop_label`` an unlabelled one.
"""
from __future__ import annotations

import base64
import datetime as dt
import decimal
import json
import math
import random
from collections.abc import Iterator, Sequence

import numpy as np
import pyarrow as pa

from connectors.files import file_format, list_units, read_unit
from pipelines.stream.events import DEFAULT_BOUNDS, ISO_Z, EventSchema, ParseBounds
from pipelines.tabular.times import time_seconds

#: The bad events ``--malformed`` makes, in turn: each one a dead letter naming its reason.
#: The kinds of bad events ``malform_event`` makes (``flowtrain replay --malformed``): each is the kind its dead letter
#: is counted under (``connectors.deadletter.reason_kind``: its reason starts with the kind), so a replay's count of
#: a kind and the pipeline's dead letters of that kind are one name.
MALFORMED_KINDS = ("broken JSON", "missing field(s)", "wrong type", "NaN", "infinite", "too deeply nested JSON",
                   "not UTF-8", "event too large")


def read_files(paths: Sequence[str], columns: Sequence[str] | None = None) -> pa.Table:
    """The rows of every file (CSV, Parquet, JSON lines; any Beam filesystem), in file order."""
    from pipelines.tabular.preflight import expand_inputs

    tables = []
    for path in expand_inputs(paths):
        batches = [b for unit in list_units(path, file_format(path)) for b in read_unit(unit, columns=columns)]
        if batches:
            tables.append(pa.Table.from_batches(batches))
    if not tables:
        raise ValueError(f"--input {' '.join(paths)}: no rows")
    return pa.concat_tables(tables, promote_options="permissive")


def order_by_time(table: pa.Table, time_column: str | None, time_format: str | None = None
                  ) -> tuple[pa.Table, np.ndarray | None]:
    """Rows in event-time order (stable; rows without a time last) and each row's time in ms."""
    if not time_column:
        return table, None
    if time_column not in table.column_names:
        raise ValueError(f"--time-column {time_column!r} is not a column; the input has "
                         f"{', '.join(table.column_names)}")
    seconds = time_seconds(table.column(time_column).combine_chunks(), time_format)
    if not np.isfinite(seconds).any():
        raise ValueError(f"--time-column {time_column!r}: no value is a time (ISO date or timestamp, "
                         f"YYYY/MM/DD or epoch seconds)")
    key = np.where(np.isfinite(seconds), seconds, np.inf)
    order = np.argsort(key, kind="stable")
    ms = np.where(np.isfinite(seconds), seconds * 1000.0, np.nan)[order]
    return table.take(pa.array(order)), ms


def _json_value(value):
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dt.datetime):
        if value.tzinfo is not None:
            value = value.astimezone(dt.timezone.utc).replace(tzinfo=None)
        return value.strftime(ISO_Z)
    if isinstance(value, dt.date):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if isinstance(value, dict):
        return {k: _json_value(v) for k, v in value.items()}
    return str(value)


def table_events(table: pa.Table) -> Iterator[dict]:
    """Each row as a JSON-able dict keyed by column name."""
    for batch in table.to_batches(max_chunksize=10_000):
        for row in batch.to_pylist():
            yield {k: _json_value(v) for k, v in row.items()}


def drop_label(event: dict, label: str) -> dict:
    """The event without its label: an unlabelled event (scored, not trained on)."""
    return {k: v for k, v in event.items() if k != label}


def malform_event(event: dict, kind: str, rng: random.Random, schema: EventSchema | None = None,
                  bounds: ParseBounds = DEFAULT_BOUNDS) -> bytes:
    """One bad event of the given kind (``MALFORMED_KINDS``), each a dead letter for the stream
    pipeline with ``bounds`` (``event too large`` exceeds ``bounds.max_event_bytes``; ``too deeply nested JSON``
    nests deeper than ``bounds.max_json_depth``). ``schema`` says which fields are required and numeric;
    without it the event's own numbers and keys are used."""
    numbers = [k for k, v in event.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if schema is not None:
        numbers = [f.name for f in schema.fields if float in f.types and str not in f.types and f.name in event]
        required = [f.name for f in schema.fields if f.required and f.name in event]
    else:
        required = list(event)
    bad = dict(event)
    if kind == "broken JSON":
        return json.dumps(event)[: rng.randint(5, 40)].encode()
    if kind == "missing field(s)" and required:
        bad.pop(rng.choice(required))
    elif kind in ("NaN", "infinite") and numbers:
        bad[rng.choice(numbers)] = float("nan") if kind == "NaN" else float("inf")
    elif kind == "too deeply nested JSON":
        nested: object = 1
        for _ in range(bounds.max_json_depth + 1):
            nested = [nested]
        bad["_nested"] = nested
    elif kind == "not UTF-8":
        return b'{"_bytes": "\xff\xfe", ' + json.dumps(bad, allow_nan=True).encode()[1:]
    elif kind == "event too large":
        bad["_padding"] = "x" * (bounds.max_event_bytes + 1)
    else:  # "wrong type", and the kinds above when the event has no field for them
        target = rng.choice(numbers) if numbers else (rng.choice(required) if required else "_")
        bad[target] = "not a number" if target in numbers else {"nested": "object"}
    return json.dumps(bad, allow_nan=True).encode()


def event_keys(events: Iterator[dict], key_column: str | None) -> Iterator[tuple[dict, bytes | None]]:
    """(event, Kafka key): the key column's value as text, or None (round robin over partitions)."""
    for event in events:
        if key_column is None:
            yield event, None
        else:
            value = event.get(key_column)
            yield event, (b"" if value is None else str(value).encode())


def kafka_timestamps(ms: np.ndarray | None, i: int) -> int | None:
    if ms is None or not np.isfinite(ms[i]) or ms[i] < 0:  # Kafka has no time before 1970
        return None
    return int(ms[i])


__all__ = ["MALFORMED_KINDS", "read_files", "order_by_time", "table_events", "drop_label", "malform_event",
           "event_keys", "kafka_timestamps"]

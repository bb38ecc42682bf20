"""JSON events on Kafka for any dataset: which fields an event has, parsing and validating them.

An event is one row of a table as a JSON object whose keys are the table's column names. An
``EventSchema`` says which fields an event must or may have and of which JSON types; for a
``flowtrain batch`` dataset it comes from the dataset's spec (``event_schema``), for a domain
with raw fields of its own (a dataset preset's, as the demo's) from that domain's adapter.

Parsing checks presence and type of every field; whatever fails becomes a ``DeadLetter`` with a
reason naming the field. Parsing never raises on the content of an event: it has bounds
(``ParseBounds``, declared with the event options in ``pipelines.stream.options``: event size, JSON nesting
depth, number magnitude) and anything else that goes
wrong with one event (recursion, overflow, encoding, ...) is that event's dead letter, not the
pipeline's failure. ``pipelines.stream.parse.parse_batch`` parses a micro-batch in one pyarrow JSON read
checked with compute kernels and equals ``parse_event`` + ``events_table`` row by row.

The events table: one column per field, in the schema's order, typed by ``EventField.arrow``
(a field without one holds its value as text: a category or class label keeps the text the
batch ETL's readers give it: ``"UA"``, ``3`` -> ``"3"``, ``true`` -> ``"true"``); a field with a
``time_format`` becomes ``timestamp[s, UTC]``; then ``source`` (``topic/partition/offset``),
``src_partition`` and ``src_offset``.
"""
from __future__ import annotations

import datetime as dt
import json
import math
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from connectors.dataset_spec import EPOCH_FORMATS, FeatureSpec
from connectors.deadletter import DeadLetter
from pipelines.stream.options import DEFAULT_BOUNDS, ParseBounds

#: A field's time as an events-table column.
TIME_TYPE = pa.timestamp("s", tz="UTC")
ISO_Z = "%Y-%m-%dT%H:%M:%SZ"
SOURCE_COLUMNS = ("source", "src_partition", "src_offset")


@dataclass(frozen=True)
class EventField:
    """One field of an event.

    ``types``: the JSON types accepted (``int``, ``float``, ``str``, ``bool``; ``bool`` only when
    listed). ``arrow``: the events-table type; None keeps the value as text (any accepted type).
    ``required``: the key must be present. ``nullable``: the value may be null (an absent key of a
    field that is not required is null too). ``time_format``: text that must parse with this
    ``strptime`` format, stored as ``timestamp[s, UTC]``. ``time_text``: a time column kept as
    text (the batch code reads it), which the JSON reader is told is text (numbers there are
    parsed row by row), so that the reader never turns it into a timestamp of its own.
    """

    name: str
    types: tuple
    arrow: pa.DataType | None = None
    required: bool = True
    nullable: bool = False
    time_format: str | None = None
    time_text: bool = False

    @property
    def table_type(self) -> pa.DataType:
        if self.time_format:
            return TIME_TYPE
        return self.arrow if self.arrow is not None else pa.string()

    @property
    def read_type(self) -> pa.DataType | None:
        """The type the JSON reader is told (None: it infers, and the column is made text)."""
        return pa.string() if self.time_format or self.time_text else self.arrow


@dataclass(frozen=True)
class EventSchema:
    fields: tuple[EventField, ...]

    def __post_init__(self):
        names = [f.name for f in self.fields]
        if len(set(names)) != len(names) or set(names) & set(SOURCE_COLUMNS):
            raise ValueError(f"EventSchema: field names must be unique and not {SOURCE_COLUMNS}: {names}")

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.fields]

    @property
    def required(self) -> list[str]:
        return [f.name for f in self.fields if f.required]

    def field(self, name: str) -> EventField:
        return next(f for f in self.fields if f.name == name)

    def table_schema(self) -> pa.Schema:
        return pa.schema([(f.name, f.table_type) for f in self.fields]
                         + [("source", pa.string()), ("src_partition", pa.int64()), ("src_offset", pa.int64())])


_NUMBER = (int, float)
_ANY_VALUE = (str, int, float, bool)


def event_schema(spec: FeatureSpec) -> EventSchema:
    """The events of a dataset: its spec's input columns as JSON fields.

    Numeric features: a number, key required (null: the batch ETL's "missing" dead letter).
    Optional numerics and categories: may be absent or null (the training mean, the
    out-of-vocabulary code). The label: may be absent or null (an unlabelled event, scored but
    not trained on): a number for regression and ``positive_above``, else any class value. The
    time column: key required, text or a number, read by the batch ETL's time code.
    """
    fields: list[EventField] = []
    numeric_label = spec.task == "regression" or spec.positive_above is not None
    fields.append(EventField(spec.label, _NUMBER if numeric_label else _ANY_VALUE,
                             pa.float64() if numeric_label else None, required=False, nullable=True))
    fields += [EventField(c, _NUMBER, pa.float64(), required=True, nullable=True) for c in spec.numeric]
    fields += [EventField(c, _NUMBER, pa.float64(), required=False, nullable=True) for c in spec.optional_numeric]
    fields += [EventField(c, _ANY_VALUE, None, required=False, nullable=True) for c in spec.categorical]
    # ID columns: text or a number, may be absent or null (the ID table's fallback vector)
    fields += [EventField(c, _ANY_VALUE, None, required=False, nullable=True) for c in spec.id_columns]
    # --weight-column: a number; may be absent or null in an unlabelled event (scored only), a labelled event
    # without a valid weight is a dead letter (the batch ETL's check)
    if spec.weight_column:
        fields.append(EventField(spec.weight_column, _NUMBER, pa.float64(), required=False, nullable=True))
    if spec.time_column and spec.time_column not in {f.name for f in fields}:
        epoch = spec.time_format in EPOCH_FORMATS  # numbers: inferred by the reader, then text
        fields.append(EventField(spec.time_column, (str, int, float), None, required=True, nullable=True,
                                 time_text=not epoch))
    return EventSchema(tuple(fields))


# ---------------------------------------------------------------------------------------------
# One event at a time
# ---------------------------------------------------------------------------------------------
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


def _time_reason(fmt: str) -> str:
    return "an ISO time" if fmt == ISO_Z else f"a time of format {fmt!r}"


def parse_event(payload: bytes | None, source: str, schema: EventSchema,
                bounds: ParseBounds = DEFAULT_BOUNDS) -> dict | DeadLetter:
    """A valid-shaped event dict, or a dead letter saying what is wrong with it. Never raises."""
    try:
        return _parse_event(payload, source, schema, bounds)
    except Exception as err:  # noqa: BLE001 - the content of one event must never stop the pipeline
        return DeadLetter(payload, source, f"unparseable event: {type(err).__name__}: {str(err)[:500]}")


def _parse_event(payload, source: str, schema: EventSchema, bounds: ParseBounds) -> dict | DeadLetter:
    if payload is None:
        return DeadLetter(payload, source, "broken JSON: the record has no value")
    if len(payload) > bounds.max_event_bytes:
        return DeadLetter(payload, source, f"event too large: {len(payload):,} bytes, more than "
                                           f"max_event_bytes {bounds.max_event_bytes:,}")
    try:
        event = json.loads(payload)
    except RecursionError:
        return DeadLetter(payload, source, f"too deeply nested JSON: more levels than the parser can take "
                                           f"(max_json_depth {bounds.max_json_depth})")
    except UnicodeDecodeError as err:
        return DeadLetter(payload, source, f"not UTF-8: {err}")
    except (TypeError, ValueError) as err:
        return DeadLetter(payload, source, f"broken JSON: {err}")
    if not isinstance(event, dict):
        return DeadLetter(payload, source, f"broken JSON: expected an object, got {type(event).__name__}")
    if _depth_exceeds(event, bounds.max_json_depth):
        return DeadLetter(payload, source, f"too deeply nested JSON: more than max_json_depth {bounds.max_json_depth} levels")
    return validate_event(event, payload, source, schema, bounds)


def validate_event(event: dict, payload, source: str, schema: EventSchema, bounds: ParseBounds = DEFAULT_BOUNDS,
                   *, absent_is_null: bool = False) -> dict | DeadLetter:
    """A decoded event (a dict of field values, from any event format) checked as ``parse_event`` checks a
    JSON object: required fields present, types, NaN/inf, number bounds, times. ``payload`` is what a dead
    letter keeps. ``absent_is_null``: a format without null (Protobuf) gives an absent field as null."""
    missing = [] if absent_is_null else [f.name for f in schema.fields if f.required and f.name not in event]
    if missing:
        return DeadLetter(payload, source, f"missing field(s): {', '.join(missing)}")
    for f in schema.fields:
        if f.name not in event:
            continue
        value = event[f.name]
        if value is None and f.nullable:
            continue
        if (isinstance(value, bool) and bool not in f.types) or not isinstance(value, f.types):
            return DeadLetter(payload, source, f"wrong type: field {f.name!r} is {type(value).__name__}, "
                                               f"expected {' or '.join(t.__name__ for t in f.types)}")
        if isinstance(value, float) and not math.isfinite(value):
            return DeadLetter(payload, source, f"{'NaN' if math.isnan(value) else 'infinite'}: field {f.name!r} is "
                                               f"{value}")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) > bounds.max_abs_number:
            return DeadLetter(payload, source, f"number out of range: field {f.name!r} is {_magnitude(value)}, "
                                               f"beyond max_abs_number {bounds.max_abs_number:.6g}")
    for f in schema.fields:
        if f.time_format and event.get(f.name) is not None:
            try:
                dt.datetime.strptime(event[f.name], f.time_format)
            except ValueError:
                return DeadLetter(payload, source, f"wrong type: field {f.name!r} is not {_time_reason(f.time_format)} "
                                                   f"({event[f.name][:100]!r})")
    return {f.name: event.get(f.name) for f in schema.fields}


def text_value(value) -> str | None:
    """A JSON value as the text the batch readers give a category (Arrow's casts, as ``as_text``)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    return pc.cast(pa.array([float(value)], pa.float64()), pa.string())[0].as_py()


def as_text(col: pa.Array | pa.ChunkedArray, f: EventField) -> pa.Array | pa.ChunkedArray:
    """A column the JSON reader inferred -> the text ``events_table`` holds for the same values."""
    t = col.type
    if pa.types.is_string(t):
        return col
    if pa.types.is_null(t):
        return pa.nulls(len(col), pa.string())
    return pc.cast(col, pa.string())


def as_times(col, f: EventField):
    """A text column of times written as ``f.time_format`` -> ``timestamp[s, UTC]``."""
    hours = pc.strptime(col, format=f.time_format, unit="s")
    hours = pc.assume_timezone(hours, "UTC") if hours.type.tz is None else hours
    return pc.cast(hours, TIME_TYPE)


def events_table(events: list[dict], sources: list[tuple[str, int, int]], schema: EventSchema) -> pa.Table:
    """Parsed events -> the events table with their Kafka sources (see the module doc)."""
    columns = {}
    for f in schema.fields:
        values = [e.get(f.name) for e in events]
        if f.arrow is None:
            values = [text_value(v) for v in values]
        columns[f.name] = pa.array(values, f.read_type or pa.string())
        if f.time_format:
            columns[f.name] = as_times(columns[f.name], f)
    columns["source"] = pa.array([f"{t}/{p}/{o}" for t, p, o in sources], pa.string())
    columns["src_partition"] = pa.array([p for _, p, _ in sources], pa.int64())
    columns["src_offset"] = pa.array([o for _, _, o in sources], pa.int64())
    return pa.table(columns, schema=schema.table_schema())

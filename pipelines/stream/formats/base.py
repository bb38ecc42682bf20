"""What every event format is (``EventFormat``: encode, decode with dead letters, the dataset's schema text, the
writer's schema resolved to the dataset's fields) and the value conversions the schema-typed formats share."""
from __future__ import annotations

import json
from collections.abc import Sequence

import pyarrow as pa

from connectors.deadletter import DeadLetter
from pipelines.stream.events import DEFAULT_BOUNDS, EventSchema, ParseBounds
from pipelines.stream.events import text_value as _as_text
from pipelines.stream.formats.plans import PlanCache, Retry
from pipelines.stream.formats.registry import PROTOBUF, RegistryError, RegistryUnavailable, SchemaRegistry
from pipelines.stream.formats.schemas import (
    BOOLEAN_TYPES,
    INTEGER_TYPES,
    NUMERIC_TYPES,
    SchemaField,
    field_type,
)
from pipelines.stream.formats.wire import WireError, frame, unframe
from pipelines.stream.parse import parse_rows

#: The longest writer schema text read (characters): a registry may hold any text; a table's schema is a few KB.
MAX_SCHEMA_CHARS = 1 << 20


class EventFormat:
    """One format: ``encode`` (producer), ``decode`` (pipeline, scorer), ``schema_text`` (the dataset's schema)."""

    name = ""
    registry_type = ""

    def __init__(self, events: EventSchema, *, schema_text: str | None = None, registry: SchemaRegistry | None = None,
                 subject: str | None = None, record: str = "Event"):
        self.events, self.registry, self.subject, self.record = events, registry, subject, record
        self.schema_text = self.dataset_schema_text()
        self.writer_text = schema_text if schema_text is not None else self.schema_text
        self._writer_id: int | None = None
        self._plans = PlanCache()

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_plans"] = None  # a copy (a DoFn's) builds its own decoders
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._plans = PlanCache()

    # --- the interface -------------------------------------------------------------------------------
    def dataset_schema_text(self) -> str:
        raise NotImplementedError

    def encode(self, event: dict) -> bytes:
        """An event (a dict keyed by field name) as a record value, in the writer's schema."""
        payload = self.encode_payload(event)
        if self.registry is None:
            return payload
        if self._writer_id is None:
            self._writer_id = self.register()
        return frame(self._writer_id, payload, (0,) if self.registry_type == PROTOBUF else None)

    def register(self) -> int:
        """Registers the writer's schema under ``subject``; its id."""
        if self.registry is None or not self.subject:
            raise ValueError("registering a schema needs --schema-registry and a subject")
        return self.registry.register(self.subject, self.writer_text, self.registry_type)

    def decode(self, payloads: Sequence[bytes | None], sources: Sequence[tuple[str, int, int]],
               bounds: ParseBounds = DEFAULT_BOUNDS) -> tuple[pa.Table | None, list[DeadLetter]]:
        """Record values -> (events table, dead letters), as ``parse_batch`` for JSON. Never raises on content."""
        rows: list = []
        for payload, (t, p, o) in zip(payloads, sources):
            out = self._decode_one(payload, bounds)
            rows.append(out if isinstance(out, dict) else DeadLetter(payload, f"{t}/{p}/{o}", out))
        return parse_rows(rows, payloads, sources, self.events, bounds, absent_is_null=self.registry_type == PROTOBUF)

    def foreign_keys(self, payloads: Sequence[bytes | None]) -> list[str] | None:
        """The keys of another table's events (JSON only: typed formats resolve by schema)."""
        return None

    # --- decoding ------------------------------------------------------------------------------------
    def _decode_one(self, payload, bounds: ParseBounds) -> dict | str:
        """The reader's fields of one value, or the reason it is a dead letter."""
        if payload is None:
            return f"undecodable {self.name}: the record has no value"
        if len(payload) > bounds.max_event_bytes:
            return f"event too large: {len(payload):,} bytes, more than max_event_bytes {bounds.max_event_bytes:,}"
        try:
            if self.registry is not None:
                schema_id, indexes, body = unframe(payload, protobuf=self.registry_type == PROTOBUF)
                if indexes is not None and len(indexes) != 1:  # not kept: any number of these is one answer
                    return (f"schema id {schema_id}: message indexes {list(indexes)} name a nested message; events "
                            f"are top-level messages of the schema")
                key = (schema_id, indexes)
            else:
                key, body = None, payload
            plan = self.plan_for(key)
            if isinstance(plan, str):
                return plan
            return plan(body)
        except WireError as err:
            return str(err)
        except EOFError:
            return f"undecodable {self.name}: truncated payload ({len(payload)} bytes)"
        except Exception as err:  # noqa: BLE001 - the content of one event must never stop the pipeline
            return f"undecodable {self.name}: {type(err).__name__}: {str(err)[:300]}"

    def check_writer(self) -> str | None:
        """Why events written with the writer's schema (``--schema-file``) cannot give the dataset's fields, or None."""
        plan = self._plan(None)
        return plan if isinstance(plan, str) else None

    def plan_for(self, key):
        """The kept plan of ``key`` (``_plan``'s answer, kept by ``PlanCache``: bounded, a ``Retry`` briefly)."""
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plan(key)
            self._plans.put(key, plan)
        return plan

    def _plan(self, key):
        """A decoder of the writer's schema (``key``: registry id and indexes; None: the schema file's) or the
        reason its events are dead letters (a ``Retry`` when asking again later may give another answer). Never
        raises: whatever the registry answers, however the schema is written, it is a reason."""
        where = "the writer's schema" if key is None else f"schema id {key[0]}"
        try:
            if key is None:
                text = self.writer_text
            else:
                schema_id, indexes = key
                try:
                    found = self.registry.schema(schema_id)
                except (RegistryError, RegistryUnavailable) as err:
                    return Retry(f"{where}: {err}")
                if found is None:
                    return Retry(f"unknown schema id {schema_id}: the schema registry {self.registry.url} does not "
                                 f"know it")
                kind, text = found
                if kind != self.registry_type:
                    return f"schema id {schema_id} is {kind}, not {self.registry_type} (--event-format {self.name})"
            if len(text) > MAX_SCHEMA_CHARS:
                return (f"{where}: a schema of {len(text):,} characters, more than {MAX_SCHEMA_CHARS:,}; a table's "
                        f"schema is a few KB")
            return self._decoder(text, key[1] if key else None, where)
        except ValueError as err:
            return f"{where}: {err}"
        except RecursionError:
            return f"{where}: nested too deeply to be read (a table's schema is flat)"
        except Exception as err:  # noqa: BLE001 - a schema no decoder can be built of: its events' reason
            return f"{where}: no decoder can be built ({type(err).__name__}: {str(err)[:300]})"

    def _resolve(self, writer: list[SchemaField], where: str) -> dict[str, SchemaField]:
        """The writer's fields by name; ValueError naming the dataset's fields it lacks or types it cannot give."""
        by_name = {f.name: f for f in writer}
        missing = [f.name for f in self.events.fields if f.required and f.name not in by_name]
        if missing:
            raise ValueError(f"drops required field(s) {', '.join(missing)} (the dataset needs them)")
        for f in self.events.fields:
            w = by_name.get(f.name)
            if w is None:
                continue
            want = field_type(f)
            ok = (w.type in NUMERIC_TYPES if want == "double" else w.type in INTEGER_TYPES if want == "long"
                  else w.type in BOOLEAN_TYPES if want == "boolean" else True)
            if not ok or (want == "string" and w.type not in NUMERIC_TYPES | BOOLEAN_TYPES | {"string"}):
                raise ValueError(f"field {f.name!r} is {w.type}, the dataset needs {want}")
        return by_name

    def _decoder(self, text: str, indexes, where: str):
        raise NotImplementedError

    def encode_payload(self, event: dict) -> bytes:
        raise NotImplementedError


def converter(target: str):
    """Writer value -> the reader's (dataset's) value, for the reader type ``target``."""
    if target == "double":
        return lambda v: None if v is None else float(v)
    if target == "long":
        return lambda v: None if v is None else int(v)
    if target == "boolean":
        return lambda v: None if v is None else bool(v)
    return _as_text


def writer_value(name: str, wtype: str, value):
    """An event's value as the writer's schema types it (ValueError naming the column otherwise)."""
    if value is None:
        return None
    try:
        if wtype in ("double", "float"):
            return float(value)
        if wtype in INTEGER_TYPES:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError("not a whole number")
            return int(value)
        if wtype in BOOLEAN_TYPES:
            return bool(value)
        return _as_text(value) if not isinstance(value, (dict, list)) else json.dumps(value)
    except (TypeError, ValueError) as err:
        raise ValueError(f"column {name!r}: {value!r} is not a {wtype}, the writer's schema's type ({err})") from None

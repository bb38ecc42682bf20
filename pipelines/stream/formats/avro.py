"""Avro events (``--event-format avro``): the record schema of the dataset's fields, or the writer's (``--schema-file``,
the registry's by id), binary-encoded records resolved to the dataset's fields by name."""
from __future__ import annotations

import io
import json

from connectors.avro_schema import AvroSchemaError, check_avro_schema
from connectors.deadletter import DeadLetter
from pipelines.stream.events import DEFAULT_BOUNDS, EventSchema, ParseBounds
from pipelines.stream.formats.base import EventFormat, converter, writer_value
from pipelines.stream.formats.registry import AVRO
from pipelines.stream.formats.schemas import (
    avro_schema,
    field_type,
    fields_of_avro,
)
from pipelines.stream.formats.wire import WireError, unframe
from pipelines.stream.parse import parse_rows


class AvroFormat(EventFormat):
    """Avro binary (fastavro), schemaless without a registry; decoded with the writer's schema and resolved to
    the dataset's fields by name (a field the writer added is skipped, one it removed is null, an int or long
    is widened to the dataset's double, a number becomes the text a category holds, as JSON's does)."""

    name = "avro"
    registry_type = AVRO

    def dataset_schema_text(self) -> str:
        return json.dumps(avro_schema(self.events, self.record))

    def _writer(self):
        if getattr(self, "_writer_encode", None) is None:
            schema = json.loads(self.writer_text)
            self._writer_encode = _avro_record_encoder(schema)
        return self._writer_encode

    def encode_payload(self, event: dict) -> bytes:
        return self._writer()(event)

    def decode(self, payloads, sources, bounds: ParseBounds = DEFAULT_BOUNDS):
        """As ``EventFormat.decode``; the values of one writer schema are decoded as one Avro block."""
        rows: list = [None] * len(payloads)
        groups: dict = {}
        for i, payload in enumerate(payloads):
            if payload is None or len(payload) > bounds.max_event_bytes:
                rows[i] = self._decode_one(payload, bounds)  # the reason
                continue
            if self.registry is not None:
                try:
                    schema_id, _, body = unframe(payload)
                except WireError as err:
                    rows[i] = str(err)
                    continue
                groups.setdefault((schema_id, None), []).append((i, body))
            else:
                groups.setdefault(None, []).append((i, payload))
        for key, items in groups.items():
            plan = self.plan_for(key)
            if isinstance(plan, str):
                for i, _ in items:
                    rows[i] = plan
                continue
            try:
                outs = plan.many([body for _, body in items])
            except Exception as err:  # noqa: BLE001 - the content of events must never stop the pipeline
                outs = [f"undecodable avro: {type(err).__name__}: {str(err)[:300]}"] * len(items)
            for (i, _), out in zip(items, outs):
                rows[i] = out
        for i, (payload, (t, p, o)) in enumerate(zip(payloads, sources)):
            if not isinstance(rows[i], dict):
                rows[i] = DeadLetter(payload, f"{t}/{p}/{o}", rows[i])
        return parse_rows(rows, payloads, sources, self.events, bounds)

    def _decoder(self, text: str, indexes, where: str):
        try:
            writer = json.loads(text)
            check_avro_schema(writer)  # before fastavro's C decoder ever sees a value of it
            fields = fields_of_avro(writer)
        except AvroSchemaError as err:
            raise ValueError(f"refused: the Avro schema {err}") from None
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"not an Avro record schema ({err})") from None
        by_name = self._resolve(fields, where)
        return _AvroReader(writer, by_name, self.events, where)


#: Put before each value in a decoding block and checked after: a value that is not exactly one record
#: (truncated, trailing bytes) shifts what follows, and the block is decoded value by value instead.
_SENTINEL = b"\xa7\x1fflowtrain\x00"


class _AvroReader:
    """Decodes values of one writer schema: ``one(body)`` -> the dataset's fields (dict) or a reason;
    ``many(bodies)``: the same for a list, in one Avro block read (fastavro's reader) when every value is
    exactly one record, else one at a time."""

    def __init__(self, writer: dict, by_name: dict, events: EventSchema, where: str):
        import fastavro

        self.where = where
        self.w = fastavro.parse_schema(writer)
        fields = [{"name": "_flowtrain_sentinel", "type": {"type": "fixed", "name": "FlowtrainSentinel",
                                                           "size": len(_SENTINEL)}}] + list(writer["fields"])
        wrapped = fastavro.parse_schema({**writer, "fields": fields})
        head = io.BytesIO()
        fastavro.writer(head, wrapped, [])
        self.header, self.sync = head.getvalue(), head.getvalue()[-16:]
        self.convert = [(f.name, converter(field_type(f))) for f in events.fields
                        if f.name in by_name and _avro_scalar(by_name[f.name].type) != field_type(f)]

    def _fix(self, record: dict) -> dict:
        for name, conv in self.convert:
            record[name] = conv(record.get(name))
        return record

    def one(self, body: bytes) -> dict | str:
        import fastavro

        bio = io.BytesIO(body)
        try:
            record = fastavro.schemaless_reader(bio, self.w, None)
        except EOFError:
            return f"undecodable avro: truncated payload ({len(body)} bytes)"
        except Exception as err:  # noqa: BLE001 - the content of one event must never stop the pipeline
            return f"undecodable avro: {type(err).__name__}: {str(err)[:300]}"
        if bio.tell() != len(body):
            return f"undecodable avro: {len(body) - bio.tell()} byte(s) after the record ({self.where})"
        return self._fix(record)

    def many(self, bodies: list[bytes]) -> list:
        import fastavro

        if len(bodies) < 4:
            return [self.one(b) for b in bodies]
        data = b"".join(_SENTINEL + b for b in bodies)
        block = self.header + _long(len(bodies)) + _long(len(data)) + data + self.sync
        try:
            records = list(fastavro.reader(io.BytesIO(block)))
        except Exception:  # noqa: BLE001 - a broken value somewhere: one at a time names it
            return [self.one(b) for b in bodies]
        if len(records) != len(bodies) or any(r.pop("_flowtrain_sentinel") != _SENTINEL for r in records):
            return [self.one(b) for b in bodies]
        last = self.one(bodies[-1])  # trailing bytes after the last value shift nothing: checked alone
        if not isinstance(last, dict):
            records[-1] = last
        return [self._fix(r) if isinstance(r, dict) else r for r in records] if self.convert else records


def _avro_scalar(t: str) -> str:
    """A writer's type as the reader type whose Python values it gives as they are."""
    return {"int": "long", "float": "double"}.get(t, t)


def _long(n: int) -> bytes:
    """An Avro long (zig-zag varint)."""
    n = (n << 1) ^ (n >> 63)
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _avro_record_encoder(schema: dict):
    """event dict -> Avro binary of a record of scalar (or nullable scalar) fields, written here (fastavro's
    ``schemaless_writer`` parses its schema on every call); another schema is written by fastavro."""
    import struct

    parts = []
    for f in schema.get("fields", []):
        t = f["type"]
        branches = t if isinstance(t, list) else [t]
        scalars = [b for b in branches if b != "null"]
        if len(scalars) != 1 or not isinstance(scalars[0], str) or scalars[0] not in (
                "double", "float", "long", "int", "string", "boolean", "bytes"):
            parts = None
            break
        null_at = _long(branches.index("null")) if "null" in branches else None
        value_at = _long(branches.index(scalars[0])) if isinstance(t, list) else b""
        parts.append((f["name"], scalars[0], null_at, value_at))
    if parts is None:
        import fastavro

        parsed, fields = fastavro.parse_schema(schema), fields_of_avro(schema)

        def encode_any(event: dict) -> bytes:
            buf = io.BytesIO()
            fastavro.schemaless_writer(buf, parsed, {f.name: writer_value(f.name, f.type, event.get(f.name))
                                                     for f in fields})
            return buf.getvalue()

        return encode_any
    double, single = struct.Struct("<d").pack, struct.Struct("<f").pack

    def encode(event: dict) -> bytes:
        out = []
        for name, wtype, null_at, value_at in parts:
            value = writer_value(name, wtype, event.get(name))
            if value is None:
                if null_at is None:
                    raise ValueError(f"column {name!r} is null, but the writer's schema's {wtype} has no null")
                out.append(null_at)
                continue
            out.append(value_at)
            if wtype == "double":
                out.append(double(value))
            elif wtype == "float":
                out.append(single(value))
            elif wtype in ("long", "int"):
                out.append(_long(value))
            elif wtype == "boolean":
                out.append(b"\x01" if value else b"\x00")
            else:
                raw = value if isinstance(value, bytes) else value.encode("utf-8")
                out.append(_long(len(raw)) + raw)
        return b"".join(out)

    return encode

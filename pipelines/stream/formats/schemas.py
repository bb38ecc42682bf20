"""The event fields of a dataset (``EventSchema``) as an Avro record schema and a Protobuf message, and back.

Every field is nullable: Avro ``["null", T]`` (a field that need not be present has ``"default": null``),
Protobuf ``optional`` (proto2: an absent field is null). ``T`` is ``double`` for a numeric field (the label
of a regression, numeric features) and ``string`` for the rest (categories, a class label, a time as text):
the text JSON events give the same values (``pipelines.stream.events.text_value``).

Back (``fields_of_avro``, ``fields_of_proto``): a writer's schema as ``SchemaField``s (name, type,
whether a reader may fill it in), to resolve it to the dataset's fields by name.
"""
from __future__ import annotations

import json
import re
from typing import NamedTuple

import pyarrow as pa

from pipelines.stream.events import EventSchema

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: Avro/Protobuf scalar types flowtrain reads as numbers (by widening) and as text.
INTEGER_TYPES = {"int", "long", "int32", "int64", "uint32", "uint64", "sint32", "sint64", "fixed32", "fixed64",
                 "sfixed32", "sfixed64"}
NUMERIC_TYPES = INTEGER_TYPES | {"float", "double"}
BOOLEAN_TYPES = {"boolean", "bool"}


class SchemaField(NamedTuple):
    name: str
    type: str  # the scalar type: double, long, string, ... (a union's non-null branch)
    has_default: bool  # Avro: a default; Protobuf: always (an absent field is null)
    number: int = 0  # Protobuf field number


def _check_names(events: EventSchema, what: str) -> None:
    bad = [n for n in events.names if not _NAME.match(n)]
    if bad:
        raise ValueError(f"column {bad[0]!r} is not a valid {what} field name (letters, digits, _; not first a digit): "
                         f"rename it in the dataset to use --event-format {what.lower()}")


def record_name(name: str) -> str:
    """A dataset name as an Avro record / Protobuf message name."""
    cleaned = re.sub(r"[^A-Za-z0-9_]", "_", name or "Event")
    return cleaned if _NAME.match(cleaned) else f"E{cleaned}"


def field_type(f) -> str:
    """The type of an event field in both formats: ``double`` (a number), ``long`` (an integer field),
    ``boolean``/``bool``, else ``string`` (text, or any value kept as text)."""
    if f.arrow is None or f.time_format:
        return "string"
    if pa.types.is_floating(f.arrow):
        return "double"
    if pa.types.is_integer(f.arrow):
        return "long"
    if pa.types.is_boolean(f.arrow):
        return "boolean"
    return "string"


def proto_type(avro: str) -> str:
    return {"long": "int64", "boolean": "bool"}.get(avro, avro)


def avro_schema(events: EventSchema, name: str = "Event") -> dict:
    """The Avro record schema of the events (a JSON-able dict)."""
    _check_names(events, "Avro")
    fields = []
    for f in events.fields:
        spec = {"name": f.name, "type": ["null", field_type(f)]}
        if not f.required:
            spec["default"] = None
        fields.append(spec)
    return {"type": "record", "name": record_name(name), "namespace": "flowtrain", "fields": fields}


def proto_text(events: EventSchema, name: str = "Event") -> str:
    """The ``.proto`` file (proto2, one message) of the events."""
    _check_names(events, "Protobuf")
    lines = ['syntax = "proto2";', "package flowtrain;", "", f"message {record_name(name)} {{"]
    lines += [f"  optional {proto_type(field_type(f))} {f.name} = {i};" for i, f in enumerate(events.fields, 1)]
    return "\n".join(lines + ["}", ""])


def _avro_branch(t) -> tuple[str, bool]:
    """(scalar type, nullable) of an Avro field type."""
    if isinstance(t, list):
        others = [b for b in t if b != "null"]
        if len(others) != 1:
            return "union", "null" in t
        return _avro_branch(others[0])[0], "null" in t
    if isinstance(t, dict):
        return str(t.get("logicalType") or t.get("type")), False
    return str(t), t == "null"


def fields_of_avro(schema: dict | str) -> list[SchemaField]:
    """A writer's Avro record schema -> its fields."""
    if isinstance(schema, str):
        schema = json.loads(schema)
    if not isinstance(schema, dict) or schema.get("type") != "record":
        raise ValueError("not an Avro record schema")
    return [SchemaField(f["name"], _avro_branch(f["type"])[0], "default" in f) for f in schema["fields"]]


#: One token of a ``.proto`` file: white space, a line comment, the start of a block comment, a string, a name
#: (dots allowed) or a number, else one character. Matched at one position at a time: linear in the text.
_TOKEN = re.compile(r"""\s+|//[^\n]*|/\*|"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|[\w.]+|\S""")
_LABELS = ("optional", "required", "repeated")


def _proto_tokens(text: str) -> list[str]:
    """The tokens of a ``.proto`` text, comments and white space left out (one pass)."""
    out, pos, n = [], 0, len(text)
    while pos < n:
        m = _TOKEN.match(text, pos)
        tok = m.group()
        if tok == "/*":
            end = text.find("*/", pos + 2)
            if end < 0:
                raise ValueError("a /* comment that never ends")
            pos = end + 2
            continue
        pos = m.end()
        if not tok[0].isspace() and not tok.startswith("//"):
            out.append(tok)
    return out


def _skip_block(toks: list[str], i: int) -> int:
    """The index after the block whose ``{`` is at or after ``i`` (nested blocks included)."""
    depth = 0
    while i < len(toks):
        if toks[i] == "{":
            depth += 1
        elif toks[i] == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise ValueError("a { without its }")


def _skip_statement(toks: list[str], i: int) -> int:
    """The index after the statement at ``i`` (up to its ``;``, or a block it opens)."""
    while i < len(toks):
        if toks[i] == ";":
            return i + 1
        if toks[i] == "{":
            return _skip_block(toks, i)
        if toks[i] == "}":
            return i
        i += 1
    return i


def _message_fields(name: str, toks: list[str], i: int) -> tuple[list[SchemaField], int]:
    """The scalar fields of the message whose body starts after the ``{`` at ``i - 1``; the index after its ``}``.
    Nested definitions (messages, enums) are skipped; a ``oneof``'s fields are the message's."""
    fields: list[SchemaField] = []
    depth = 1  # inside the message (2: inside one of its oneofs)
    while i < len(toks):
        t = toks[i]
        if t == "}":
            depth -= 1
            i += 1
            if depth == 0:
                return fields, i
        elif t in ("message", "enum", "extend", "service", "group"):
            i = _skip_block(toks, i)
        elif t == "oneof" and depth == 1 and i + 2 < len(toks) and toks[i + 2] == "{":
            depth, i = 2, i + 3
        elif t in ("option", "reserved", "extensions", ";", "map"):
            i = _skip_statement(toks, i)
        else:
            j = i + (t in _LABELS)
            stmt = toks[j: j + 5]
            if len(stmt) == 5 and stmt[2] == "=" and stmt[3].isdigit() and stmt[4] in (";", "[") \
                    and re.fullmatch(r"\w+", stmt[1]):
                if t == "repeated":
                    raise ValueError(f"message {name}: field {stmt[1]!r} is repeated; events hold one value per field")
                fields.append(SchemaField(stmt[1], stmt[0], True, int(stmt[3])))
            i = _skip_statement(toks, i)
    raise ValueError(f"message {name}: a {{ without its }}")


def proto_messages(text: str) -> list[tuple[str, list[SchemaField]]]:
    """The top-level messages of a ``.proto`` file, in order (their scalar fields: what flowtrain writes and
    reads; the wire format's message index ``[i]`` is the i-th). Linear in the text's length."""
    toks = _proto_tokens(text)
    found, i = [], 0
    while i < len(toks):
        if toks[i] == "message" and i + 2 < len(toks) and toks[i + 2] == "{":
            name = toks[i + 1]
            fields, i = _message_fields(name, toks, i + 3)
            found.append((name, fields))
        else:
            i = _skip_statement(toks, i) if toks[i] != "}" else i + 1
    if not found:
        raise ValueError("no message in the .proto text")
    return found


def fields_of_proto(text: str, index: int = 0) -> list[SchemaField]:
    """A writer's ``.proto`` -> the fields of its message number ``index`` (the wire format's first index)."""
    messages = proto_messages(text)
    if not 0 <= index < len(messages):
        raise ValueError(f"message index {index}: the schema has {len(messages)} message(s)")
    return messages[index][1]

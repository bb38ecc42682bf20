"""Avro schemas that fastavro can decode without unbounded native recursion, checked before it sees any data.

fastavro's decoder recurses in C once per nesting level of a value: a recursive record (valid Avro: a record
holding ``["null", "Self"]``) lets one small value nest thousands deep, and at about 6,000 levels in one event
(36 KB) or 20,000 in a container file the process ends with SIGSEGV, which no ``except`` catches (NOTES.md).
A table row never needs either, so ``check_avro_schema`` refuses, when a schema is first seen:

* a **recursive named type**: a record that holds itself, directly or through other types;
* **nesting deeper than** ``MAX_AVRO_DEPTH`` levels of records, arrays and maps (a named type used by name
  counts with its own depth), which also bounds the values a schema allows.

An ``AvroSchemaError`` (a ``ValueError``) names the type and the path to it; the event formats make it a dead
letter naming the schema id (or one line naming ``--schema-file``), the container file reader one line naming
the file. The walk is linear in the schema's size and stops at the bound (no Python recursion past it).
"""
from __future__ import annotations

__all__ = ["MAX_AVRO_DEPTH", "AvroSchemaError", "check_avro_schema"]

#: The most levels of records, arrays and maps inside one another a schema may have (a table row has 1).
MAX_AVRO_DEPTH = 32

_PRIMITIVES = {"null", "boolean", "int", "long", "float", "double", "bytes", "string"}
_NAMED = ("record", "error", "enum", "fixed")


class AvroSchemaError(ValueError):
    """A schema whose values fastavro could not decode safely; the message names the type and why."""


def _full_name(name: str, namespace: str | None) -> str:
    return name if "." in name or not namespace else f"{namespace}.{name}"


class _Walk:
    def __init__(self):
        self.depth_of: dict[str, int] = {}  # named type -> the nesting depth of its values (closed types)
        self.open: list[str] = []  # named types being defined (the path from the root)

    def depth(self, t, namespace: str | None, level: int) -> int:
        """Levels of nesting of the values of ``t`` (0: a primitive), its definitions registered; ``level``:
        the levels above it."""
        if level > MAX_AVRO_DEPTH:
            raise AvroSchemaError(f"nests more than {MAX_AVRO_DEPTH} levels of records, arrays and maps "
                                  f"(at {' > '.join(self.open[-3:]) or 'the root'}); a table row needs one")
        if isinstance(t, list):  # a union: its deepest branch
            if any(isinstance(b, list) for b in t):
                raise AvroSchemaError("has a union inside a union (not Avro)")
            return max((self.depth(b, namespace, level) for b in t), default=0)
        if isinstance(t, str):
            if t in _PRIMITIVES:
                return 0
            name = _full_name(t, namespace)
            name = name if name in self.depth_of or name in self.open else t
            if name in self.open:
                cycle = self.open[self.open.index(name):] + [name]
                raise AvroSchemaError(f"is recursive: {' > '.join(cycle)} (a record that holds itself lets a value "
                                      f"nest without bound; a table row cannot)")
            inner = self.depth_of.get(name, 0)  # an unknown name: fastavro's parse names it
            if level + inner > MAX_AVRO_DEPTH:
                raise AvroSchemaError(f"nests more than {MAX_AVRO_DEPTH} levels of records, arrays and maps "
                                      f"(through {name}); a table row needs one")
            return inner
        if not isinstance(t, dict):
            return 0
        kind = t.get("type")
        if kind in _NAMED and isinstance(t.get("name"), str):
            ns = t.get("namespace") if isinstance(t.get("namespace"), str) else namespace
            name = _full_name(t["name"], ns)
            if name in self.open:
                raise AvroSchemaError(f"is recursive: {' > '.join(self.open[self.open.index(name):] + [name])}")
            if kind not in ("record", "error"):
                self.depth_of[name] = 0
                return 0
            self.open.append(name)
            fields = t.get("fields") if isinstance(t.get("fields"), list) else []
            ns_inner = name.rpartition(".")[0] or None
            inner = 1 + max((self.depth(f.get("type"), ns_inner, level + 1) for f in fields if isinstance(f, dict)),
                            default=0)
            self.open.pop()
            self.depth_of[name] = inner
            return inner
        if kind == "array":
            return 1 + self.depth(t.get("items"), namespace, level + 1)
        if kind == "map":
            return 1 + self.depth(t.get("values"), namespace, level + 1)
        if isinstance(kind, (str, list, dict)) and kind != t:  # {"type": "long", "logicalType": ...}, or nested
            return self.depth(kind, namespace, level + 1)
        return 0


def check_avro_schema(schema) -> int:
    """The nesting depth of ``schema``'s values (a parsed Avro schema: dict, list or str); an
    ``AvroSchemaError`` when it is recursive or nests deeper than ``MAX_AVRO_DEPTH`` (module doc)."""
    return _Walk().depth(schema, None, 0)

"""Features over time, declared: ``--aggregate KEY:COLUMN:AGGS:WINDOWS`` and ``--join TABLE:KEY[:VALID_FROM]``.

- ``parse_aggregate("card:amount:count,sum,mean:10m,1h,life")`` -> an ``Aggregation``; ``KEY`` is one column or
  several joined with ``+`` (``card+merchant``); ``COLUMN`` a column or ``*`` (the key's events: ``count`` only);
  ``AGGS`` of :data:`AGGREGATIONS` and ``lastK`` (``last3``); ``WINDOWS`` ``Ns``/``Nm``/``Nh``/``Nd`` (whole
  seconds) or ``life`` (since the key was first seen).
- ``parse_join("merchants.parquet:merchant:valid_from")`` -> a ``Join``: the table's other columns, prefixed
  ``KEY_``, as of each event's time (the row with the greatest ``VALID_FROM`` at or before it); without
  ``VALID_FROM`` a static lookup.
- Feature names (``Aggregation.names``): ``KEY_COLUMN_AGG_WINDOW`` (``card_amount_sum_1d``), ``KEY_count_WINDOW``
  for ``*``, lastK as K columns ``KEY_COLUMN_lastK_WINDOW_1`` (the most recent) .. ``_K``; a key of several
  columns is named with ``_`` (``card_merchant_amount_sum_1d``); ``KEY_seen`` is 1 when the key had an event
  before (docs/features.md).

A bad declaration is a ``DeclarationError``: one line naming the declaration, the bad part and what is allowed.
Stdlib only: the command line's ``--help`` imports this.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from connectors.errors import FlowtrainError

#: The aggregations, besides ``lastK`` (``last1`` .. ``last100``).
AGGREGATIONS = ("count", "sum", "mean", "min", "max", "std", "distinct", "last")
#: The aggregations that need numbers.
NUMERIC = frozenset({"sum", "mean", "min", "max", "std"})
#: The longest lastK.
MAX_LAST_K = 100
#: Seconds per window unit.
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
#: The window "since the key was first seen".
LIFE = "life"
#: ``*`` as COLUMN: the key's events.
EVENTS = "*"

_WINDOW = re.compile(r"^([1-9][0-9]{0,8})([smhd])$")
_LAST_K = re.compile(r"^last([1-9][0-9]*)$")
_NAME = re.compile(r"^[^:+,\s]+$")


class DeclarationError(FlowtrainError):
    """A bad ``--aggregate`` / ``--join`` (or YAML ``aggregations:`` / ``joins:``): one line naming the bad part."""


@dataclass(frozen=True)
class Window:
    """A window: its name as declared (``10m``, ``life``) and its length in seconds (None: ``life``)."""

    name: str
    seconds: int | None

    @property
    def micros(self) -> int | None:
        return None if self.seconds is None else self.seconds * 1_000_000


def parse_window(text: str, *, where: str = "") -> Window:
    t = str(text).strip().lower()
    if t == LIFE:
        return Window(LIFE, None)
    m = _WINDOW.match(t)
    if not m:
        raise DeclarationError(f"{where}window {text!r}: expected Ns, Nm, Nh or Nd (a whole number >= 1 of seconds, "
                               f"minutes, hours or days, e.g. 10m, 1h, 30d) or life")
    return Window(t, int(m.group(1)) * UNITS[m.group(2)])


def parse_agg(text: str, *, where: str = "") -> str:
    """An aggregation's name (``count``, ``last3``...)."""
    t = str(text).strip().lower()
    if t in AGGREGATIONS:
        return t
    m = _LAST_K.match(t)
    if m and 1 <= int(m.group(1)) <= MAX_LAST_K:
        return t
    raise DeclarationError(f"{where}aggregation {text!r}: expected one of {', '.join(AGGREGATIONS)} or lastK "
                           f"(K from 1 to {MAX_LAST_K}, e.g. last3)")


def last_k(agg: str) -> int:
    """K of ``lastK`` (0 for another aggregation; ``last`` is not lastK: one value, no suffix)."""
    m = _LAST_K.match(agg)
    return int(m.group(1)) if m else 0


def key_name(key: tuple[str, ...]) -> str:
    """A key's name in feature names: its columns joined with ``_``."""
    return "_".join(key)


def parse_key(text: str, *, where: str = "") -> tuple[str, ...]:
    parts = tuple(p.strip() for p in str(text).split("+"))
    if not parts or any(not p or not _NAME.match(p) for p in parts):
        raise DeclarationError(f"{where}key {text!r}: expected a column name, or several joined with + "
                               f"(card+merchant)")
    if len(set(parts)) != len(parts):
        raise DeclarationError(f"{where}key {text!r} names a column twice")
    return parts


@dataclass(frozen=True)
class Aggregation:
    """``KEY:COLUMN:AGGS:WINDOWS``: aggregations of one column (or ``*``, the events) per key over windows."""

    key: tuple[str, ...]
    column: str  # a column, or EVENTS
    aggs: tuple[str, ...]
    windows: tuple[Window, ...]
    text: str = field(default="", compare=False)

    @property
    def key_name(self) -> str:
        return key_name(self.key)

    def feature(self, agg: str, window: Window) -> str:
        """The feature's name (lastK: the prefix of its K columns)."""
        if self.column == EVENTS:
            return f"{self.key_name}_{agg}_{window.name}"
        return f"{self.key_name}_{self.column}_{agg}_{window.name}"

    def names(self) -> list[str]:
        """Every output column, in declaration order: per window, per aggregation (lastK: its K columns)."""
        out = []
        for window in self.windows:
            for agg in self.aggs:
                k = last_k(agg)
                base = self.feature(agg, window)
                out.extend([f"{base}_{i}" for i in range(1, k + 1)] if k else [base])
        return out

    @property
    def longest(self) -> int | None:
        """The longest finite window in microseconds (None when every window is ``life``)."""
        finite = [w.micros for w in self.windows if w.micros is not None]
        return max(finite) if finite else None


def parse_aggregate(value: Any) -> Aggregation:
    """``KEY:COLUMN:AGGS:WINDOWS`` (or a YAML mapping with key, column, aggs, windows) -> ``Aggregation``."""
    if isinstance(value, Mapping):
        unknown = set(value) - {"key", "column", "aggs", "windows"}
        if unknown or not {"key", "column", "aggs", "windows"} <= set(value):
            raise DeclarationError(f"aggregation {dict(value)!r}: expected the keys key, column, aggs, windows")
        joined = [",".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)
                  for v in (value["key"], value["column"], value["aggs"], value["windows"])]
        joined[0] = joined[0].replace(",", "+")
        value = ":".join(joined)
    text = str(value).strip()
    where = f"--aggregate {text}: "
    parts = text.split(":")
    if len(parts) != 4:
        raise DeclarationError(f"{where}expected KEY:COLUMN:AGGS:WINDOWS with 4 parts separated by ':', got "
                               f"{len(parts)} (e.g. card:amount:count,sum,mean:10m,1h,1d)")
    key = parse_key(parts[0], where=where)
    column = parts[1].strip()
    if not column or (column != EVENTS and not _NAME.match(column)):
        raise DeclarationError(f"{where}column {parts[1]!r}: expected a column name or * (the key's events)")
    if column in key:
        raise DeclarationError(f"{where}column {column!r} is the key itself")
    aggs = tuple(parse_agg(a, where=where) for a in parts[2].split(",") if a.strip())
    if not aggs:
        raise DeclarationError(f"{where}no aggregation (expected e.g. count,sum,mean)")
    if column == EVENTS and set(aggs) != {"count"}:
        bad = ", ".join(a for a in aggs if a != "count")
        raise DeclarationError(f"{where}{bad} of * (the key's events): * takes count only; aggregate a column for "
                               f"the others")
    windows = tuple(parse_window(w, where=where) for w in parts[3].split(",") if w.strip())
    if not windows:
        raise DeclarationError(f"{where}no window (expected e.g. 10m,1h,1d,30d or life)")
    _no_repeats(where, "aggregation", aggs)
    lengths: dict[int | None, str] = {}
    for w in windows:
        if w.seconds in lengths:
            raise DeclarationError(f"{where}windows {lengths[w.seconds]} and {w.name} are the same length")
        lengths[w.seconds] = w.name
    return Aggregation(key, column, aggs, windows, text)


def _no_repeats(where: str, what: str, items: Iterable[str]) -> None:
    seen: set[str] = set()
    for item in items:
        if item in seen:
            raise DeclarationError(f"{where}{what} {item} is given twice")
        seen.add(item)


#: ``--join kafka://TOPIC:KEY[:VALID_FROM]``: the table is a topic on the stream's brokers (``pipelines.stream.join_topic``).
TOPIC_SCHEME = "kafka://"


@dataclass(frozen=True)
class Join:
    """``TABLE:KEY[:VALID_FROM]``: the table's other columns, prefixed ``KEY_``, as of each event's time."""

    table: str
    key: tuple[str, ...]
    valid_from: str | None = None
    text: str = field(default="", compare=False)

    @property
    def prefix(self) -> str:
        return key_name(self.key) + "_"

    def column_name(self, column: str) -> str:
        return self.prefix + column


def parse_join(value: Any) -> Join:
    """``TABLE:KEY[:VALID_FROM]`` (TABLE may be a URL such as ``gs://b/t.parquet``) or a YAML mapping with
    table, key and valid_from -> ``Join``."""
    if isinstance(value, Mapping):
        unknown = set(value) - {"table", "key", "valid_from"}
        if unknown or not {"table", "key"} <= set(value):
            raise DeclarationError(f"join {dict(value)!r}: expected the keys table, key and (optionally) valid_from")
        key = value["key"]
        key = "+".join(map(str, key)) if isinstance(key, (list, tuple)) else str(key)
        value = ":".join([str(value["table"]), key] + ([str(value["valid_from"])] if value.get("valid_from") else []))
    text = str(value).strip()
    where = f"--join {text}: "
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = "", text
    parts = rest.split(":")
    if len(parts) not in (2, 3):
        raise DeclarationError(f"{where}expected TABLE:KEY or TABLE:KEY:VALID_FROM (e.g. merchants.parquet:merchant:"
                               f"valid_from)")
    table = (scheme + "://" if sep else "") + parts[0].strip()
    if not parts[0].strip():
        raise DeclarationError(f"{where}no TABLE (a file of the table to join)")
    key = parse_key(parts[1], where=where)
    valid_from = parts[2].strip() if len(parts) == 3 else None
    if valid_from is not None and (not valid_from or not _NAME.match(valid_from) or valid_from in key):
        raise DeclarationError(f"{where}VALID_FROM {parts[2]!r}: expected the name of the table's time column (not "
                               f"the key)")
    return Join(table, key, valid_from, text)


@dataclass(frozen=True)
class Declaration:
    """Every aggregation and join of a job, checked together (no feature name twice)."""

    aggregations: tuple[Aggregation, ...] = ()
    joins: tuple[Join, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.aggregations or self.joins)

    def keys(self) -> list[tuple[str, ...]]:
        """The aggregation keys, each once, in declaration order."""
        out: list[tuple[str, ...]] = []
        for a in self.aggregations:
            if a.key not in out:
                out.append(a.key)
        return out

    def by_key(self, key: tuple[str, ...]) -> tuple[Aggregation, ...]:
        return tuple(a for a in self.aggregations if a.key == key)

    def seen_name(self, key: tuple[str, ...]) -> str:
        return f"{key_name(key)}_seen"

    def aggregate_names(self) -> list[str]:
        """The aggregates' output columns: per key, its ``KEY_seen`` then its aggregations' columns."""
        out = []
        for key in self.keys():
            out.append(self.seen_name(key))
            for a in self.by_key(key):
                out.extend(a.names())
        return out

    def input_columns(self) -> list[str]:
        """The event columns the aggregations and joins read (keys, aggregated columns)."""
        out: list[str] = []
        for a in self.aggregations:
            out.extend(c for c in (*a.key, a.column) if c != EVENTS and c not in out)
        for j in self.joins:
            out.extend(c for c in j.key if c not in out)
        return out


def declare(aggregations: Iterable[Any] = (), joins: Iterable[Any] = ()) -> Declaration:
    """A ``Declaration`` from ``--aggregate`` / ``--join`` values (text or YAML mappings); a
    ``DeclarationError`` for a bad one or a feature named twice."""
    aggs = tuple(v if isinstance(v, Aggregation) else parse_aggregate(v) for v in aggregations)
    js = tuple(v if isinstance(v, Join) else parse_join(v) for v in joins)
    decl = Declaration(aggs, js)
    seen: dict[str, str] = {}
    for a in aggs:
        for name in a.names():
            if name in seen:
                raise DeclarationError(f"--aggregate {a.text}: feature {name} is also made by --aggregate "
                                       f"{seen[name]}")
            seen[name] = a.text
    for key in decl.keys():
        seen.setdefault(decl.seen_name(key), "its key")
    return decl

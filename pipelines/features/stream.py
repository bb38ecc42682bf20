"""Features over time on a stream: one raw partition's events in the order Kafka delivers them, through the same
core as the backfill (``KeyFeatures.advance``), with a watermark, allowed lateness and a durable state.

``StreamFeatures(plan, store).offer(rows, offsets)`` takes a micro-batch of parsed events (offset order) and
returns the events whose aggregates are final, in offset order, with the aggregates and joined columns appended,
and the late ones. ``checkpoint(next_offset)`` then writes the changed key states and the partition's progress in
one transaction (``pipelines.features.store``); the caller commits ``next_offset`` to Kafka only after it.

- **Watermark**: the greatest event time the partition has delivered. An event whose time is more than
  ``allowed_lateness`` behind the watermark at its arrival is *late*: a dead letter (reason ``late``), counted, in
  no aggregate. An event is final once the watermark is ``allowed_lateness`` past it (at once with 0): no event
  that is not late can come before it any more, so its window ``[t - w, t)`` is complete, and the final events are
  applied to the states in time order. Events wait (in the store) until then; with 0 none waits.
- **Offset order out**: an event goes on only when every earlier event of its partition has (final, late or a dead
  letter), so the features topic holds each raw partition's rows in offset order (the trainer's exactly-once
  filter keeps the highest trained offset per raw partition).
- **Exactly once**: the store holds, in one transaction, every key's state, the next offset to read, the
  watermark and the events read but not gone on. A restart (after a kill -9 anywhere) reopens the store and skips
  what it already holds (``read_offset``): the states, the late/final decisions (they depend only on the
  partition's sequence of events) and so every feature value are those of an uninterrupted run, bit for bit; an
  event that went on before the crash but after the last checkpoint goes on again with the same values (the
  trainer drops it by its offset).
- Joins: each join's table as of the event's time (``AsOfTable``), loaded when the stream starts.

The raw topic must be keyed by the aggregation's KEY (``flowtrain replay --key-column``) when it has several
partitions: a key's events then all come through one partition, in order.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines.features.asof import AsOfTable, join_columns
from pipelines.features.columns import MISSING_TIME, encode_keys, key_text, time_micros, values_of
from pipelines.features.core import KeyFeatures
from pipelines.features.declare import EVENTS, Declaration
from pipelines.features.output import empty_features, feature_batch
from pipelines.features.store import StateStore

LATE = "late"
#: The key states' names in the store: the aggregation KEY's index, then the key's text.
_SEP = "\x1e"
_ID = "_offset"


@dataclasses.dataclass(frozen=True)
class StreamPlan:
    """What the stream computes: the declaration, the time column, each aggregated column's kind (the batch
    dataset's: number or text) and the allowed lateness."""

    decl: Declaration
    time_column: str
    time_format: str | None = None
    kinds: tuple[tuple[str, str], ...] = ()
    allowed_lateness_s: float = 0.0

    def kind(self, column: str) -> str:
        return dict(self.kinds).get(column, "number")

    @property
    def lateness_us(self) -> int:
        return int(round(self.allowed_lateness_s * 1_000_000))


def _ipc(table: pa.Table | None) -> bytes:
    if table is None:
        return b""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def _unipc(data: bytes | None) -> pa.Table | None:
    return pa.ipc.open_stream(data).read_all() if data else None


@dataclasses.dataclass
class Offered:
    """``StreamFeatures.offer``'s answer: the rows that go on (offset order, aggregates appended) and the late
    events (their rows and the watermark they came behind)."""

    ready: pa.Table | None
    late: pa.Table | None  # late events and events without a time
    late_watermark: np.ndarray  # the watermark each came behind (MISSING_TIME: it has no time)


class StreamFeatures:
    """One raw partition's features over time (the module doc)."""

    def __init__(self, plan: StreamPlan, store: StateStore | None = None, tables: Sequence[AsOfTable] = ()):
        self.plan, self.store, self.tables = plan, store, list(tables)
        self.groups = [KeyFeatures(plan.decl.by_key(k)) for k in plan.decl.keys()]
        meta = store.meta() if store is not None else {}
        self.started = "read_offset" in meta  # a store that has read: the next offset must follow on
        self.read_offset = int(meta.get("read_offset", b"0"))
        self.watermark = int(meta.get("watermark", str(MISSING_TIME).encode()))
        self.late_events = int(meta.get("late", b"0"))
        self.pending = _unipc(meta.get("pending"))  # events read, not gone on: rows + _offset, in offset order
        self.done = _unipc(meta.get("done"))  # the final ones among them: _offset + aggregates
        self.changed: dict[str, object] = {}
        self.memory: dict[str, object] = {}  # states without a store

    # -- one micro-batch ------------------------------------------------------------------------------
    def offer(self, rows: pa.Table | None, offsets: np.ndarray, *, first: int | None = None,
              last: int | None = None) -> Offered:
        """New parsed events of this partition (``offsets`` increasing), from the micro-batch of records
        ``first..last`` (default: the events' own; the records between that did not parse count as read)."""
        offsets = np.asarray(offsets, dtype=np.int64)
        first = int(offsets[0]) if first is None and len(offsets) else first
        last = int(offsets[-1]) if last is None and len(offsets) else last
        if first is None:
            return Offered(None, None, np.zeros(0, np.int64))
        if first < self.read_offset:
            raise ValueError(f"offset {first} was read before (the store reads on from {self.read_offset})")
        if self.started and first > self.read_offset:
            raise ValueError(f"offsets {self.read_offset}..{first - 1} were never given to the features' state "
                             f"(its store {self.store.path if self.store else ''} is behind the offsets committed): "
                             f"their events would be missing from every aggregate")
        self.read_offset, self.started = last + 1, True
        if rows is None or not rows.num_rows:
            return Offered(self._ready(), None, np.zeros(0, np.int64))
        times = time_micros(rows.column(self.plan.time_column), self.plan.time_format)
        before = np.maximum.accumulate(np.concatenate([[self.watermark], times]))[:-1]
        missing = times == MISSING_TIME  # no time: it cannot be placed (a dead letter too)
        late = missing | ((before != MISSING_TIME) & (times < before - self.plan.lateness_us))
        keep = ~late
        fresh = rows.filter(pa.array(keep)).append_column(_ID, pa.array(offsets[keep]))
        if fresh.num_rows:
            self.watermark = max(self.watermark, int(times[keep].max()))
        self.late_events += int(late.sum())
        self.pending = fresh if self.pending is None else pa.concat_tables([self.pending, fresh.cast(
            self.pending.schema)] if fresh.schema != self.pending.schema else [self.pending, fresh])
        self._finalize()
        return Offered(self._ready(), rows.filter(pa.array(late)) if late.any() else None,
                       np.where(missing[late], MISSING_TIME, before[late]))

    def _finalize(self) -> None:
        """Apply the pending events the watermark has closed (time <= watermark - lateness), in time order."""
        if self.pending is None or not self.pending.num_rows:
            return
        done_ids = set(self.done.column(_ID).to_pylist()) if self.done is not None else set()
        times = time_micros(self.pending.column(self.plan.time_column), self.plan.time_format)
        ids = self.pending.column(_ID).to_numpy()
        closing = (times <= self.watermark - self.plan.lateness_us) & ~np.isin(ids, list(done_ids))
        if not closing.any():
            return
        rows = self.pending.filter(pa.array(closing))
        self.done = pa.concat_tables([t for t in (self.done, self.compute(rows)) if t is not None])

    def compute(self, rows: pa.Table) -> pa.Table:
        """The aggregates and joins of these final events (applied to their keys' states), with ``_offset``."""
        ids = rows.column(_ID).to_numpy()
        times = time_micros(rows.column(self.plan.time_column), self.plan.time_format)
        cols: dict[str, pa.Array] = {_ID: pa.array(ids)}
        for gi, group in enumerate(self.groups):
            keys = key_text(rows, group.key)
            names, codes, has = encode_keys(keys)
            stored = [f"{gi}{_SEP}{k}" for k in names]
            states = self._states(stored)
            by_name = {k: states[s] for k, s in zip(names, stored) if s in states}
            sel = np.flatnonzero(has)
            values = {c: values_of(rows.column(c))[sel] for c in dict.fromkeys(a.column for a in group.column_aggs)
                      if c != EVENTS}
            out = group.advance(names, codes[sel], times[sel], values, by_name)
            for k, s in zip(names, stored):
                if k in by_name:
                    self.changed[s] = by_name[k]
                    if self.store is None:
                        self.memory[s] = by_name[k]
            batch = feature_batch(group, out, self.plan.kind, ids[sel], _ID)
            full = _expand(batch, sel, len(ids), group, self.plan.kind)
            for name in full.column_names:
                if name != _ID:
                    cols[name] = full.column(name)
        if self.tables:
            cols.update(join_columns(self.tables, rows, times))
        return pa.table(cols)

    def _states(self, stored: list[str]) -> dict:
        if self.store is not None:
            found = self.store.load(stored)
        else:
            found = {s: self.memory[s] for s in stored if s in self.memory}
        return {s: self.changed.get(s, st) for s, st in found.items()}

    def _ready(self) -> pa.Table | None:
        """The longest run of final events at the head of the pending ones, with their aggregates; removed."""
        if self.pending is None or not self.pending.num_rows or self.done is None or not self.done.num_rows:
            return None
        done_ids = self.done.column(_ID).to_numpy()
        ids = self.pending.column(_ID).to_numpy()
        final = np.isin(ids, done_ids)
        n = int(np.argmin(final)) if not final.all() else len(ids)
        if n == 0:
            return None
        head, self.pending = self.pending.slice(0, n), self.pending.slice(n)
        order = np.argsort(done_ids, kind="stable")
        at = order[np.searchsorted(done_ids[order], ids[:n])]
        aggs = self.done.take(pa.array(at))
        rest = np.ones(len(done_ids), dtype=bool)
        rest[at] = False
        self.done = self.done.filter(pa.array(rest))
        out = head
        for name in aggs.column_names:
            if name != _ID:
                out = out.append_column(name, aggs.column(name))
        return out

    # -- durability ---------------------------------------------------------------------------------
    def checkpoint(self, *, sent: dict[int, str] | None = None, committed: int | None = None) -> None:
        """The changed states and the progress in one transaction (then the caller may commit the offsets); see
        ``StateStore.save`` for ``sent`` and ``committed``."""
        if self.store is None:
            self.changed = {}
            return
        meta = {"read_offset": str(self.read_offset).encode(), "watermark": str(self.watermark).encode(),
                "late": str(self.late_events).encode(),
                "pending": _ipc(self.pending if self.pending is not None and self.pending.num_rows else None),
                "done": _ipc(self.done if self.done is not None and self.done.num_rows else None)}
        self.store.save(self.changed, meta, sent=sent, committed=committed)
        self.changed = {}

    @property
    def waiting(self) -> int:
        """Events read and held until the watermark closes them (or an earlier one goes on)."""
        return 0 if self.pending is None else self.pending.num_rows


def _expand(batch: pa.RecordBatch, sel: np.ndarray, n: int, group: KeyFeatures, kind) -> pa.Table:
    """A group's features for rows ``sel`` of ``n``, with empty values for the rows without a key."""
    if len(sel) == n:
        return pa.Table.from_batches([batch])
    empty = empty_features(group, kind, n)
    mask = np.zeros(n, dtype=bool)
    mask[sel] = True
    index = np.full(n, -1, dtype=np.int64)
    index[sel] = np.arange(len(sel))
    take = pa.array(index, mask=~mask)
    return pa.table({name: pc.if_else(pa.array(mask), batch.column(name).take(take), col)
                     for name, col in empty.items()})

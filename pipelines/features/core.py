"""The one aggregation code: a per-key, time-ordered state machine over blocks of events, vectorized.

``KeyFeatures(aggregations).advance(keys, codes, times, columns, states)`` computes, for every event of a block,
every aggregate of its key over ``[t - w, t)`` (event time, microseconds), from the block's events plus each key's
``KeyState`` (the points still inside the key's longest window, and the aggregates of the older ones for ``life``
windows), and moves the states past the block. The backfill calls it once per shard of keys with empty states
(``states=None``: nothing kept); the stream calls it per micro-batch of events the watermark has closed, with the
states it keeps in Beam keyed state. The values are the same bit for bit however the events are cut into blocks:

- a window's bounds are searches over sorted times (``[t - w, t)``: the event itself and every event at or after
  ``t`` are outside, ties included);
- sums, means and standard deviations are exact sums (``pipelines.features.exact``) rounded once: functions of the
  window's values, not of their order or of the key's history;
- min and max are selections; distinct counts are counts; ``last`` / ``lastK`` take the latest points by
  ``(time, value)``, so ties at one time are broken by the value, not by arrival.

A key's events in a later block must not be earlier than its state's latest event (``OutOfOrderError``): the
stream hands events over only once its watermark closed them (``pipelines.features.stream``).

Values: a numeric column as float64 with NaN for a missing value (non-finite values count as missing), any other
as an object array of ``str`` with None; a missing value is left out of its column's aggregates (the event still
counts for ``*``). Empty windows: count, sum and distinct 0; mean, min, max, std, last (and lastK's missing
slots) NaN / None. Stdlib and numpy only.
"""
from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from pipelines.features import exact
from pipelines.features.declare import EVENTS, NUMERIC, Aggregation, Window, key_name, last_k


class OutOfOrderError(ValueError):
    """A key's event is earlier than an event its state already holds."""


class ColumnTypeError(ValueError):
    """An aggregation that needs numbers over a column of text."""


def _empty_times() -> np.ndarray:
    return np.zeros(0, np.int64)


@dataclass
class Tail:
    """One series of a key (its events, or one aggregation's values): the points that later events may still see
    (inside the longest finite window of the latest time, and the last K for lastK), in ``(time, value)`` order,
    plus the aggregates of the points evicted before them (kept only where a ``life`` window needs them)."""

    times: np.ndarray = field(default_factory=_empty_times)
    values: np.ndarray | None = None  # None for the events series
    count: int = 0  # evicted points
    scale: int = 0  # of total / squares: exact integers at 2**scale (2**(2*scale))
    total: int = 0
    squares: int = 0
    low: float = math.nan
    high: float = math.nan
    distinct: set | None = None


@dataclass
class KeyState:
    """A key's state: its latest event time, its events' tail, one tail per aggregation of a column."""

    last_time: int | None = None
    events: Tail = field(default_factory=Tail)
    series: list[Tail] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# Window bounds and range queries
# ---------------------------------------------------------------------------------------------
def _bounds(dc: np.ndarray, dt: np.ndarray, qc: np.ndarray, qt: np.ndarray, windows: Sequence[Window]):
    """Per window name, ``(lo, hi)`` into the points (sorted by code, time): the points of the query's key with
    ``t - w <= time < t``; ``life``: from the key's first point. Also ``start`` (each query's key's first point)
    and ``hi``. The searches run over one sorted int64 per point, ``code * stride + time``: times offset from the
    earliest (probes clipped to it), or their ranks where that would overflow."""
    finite = [w for w in windows if w.micros is not None]
    probes = [qt] + [qt - w.micros for w in finite]
    n, at = len(qt), len(dt)
    t0 = min(int(dt.min(initial=qt.min())), int(qt.min()))
    span = max(int(dt.max(initial=qt.max())), int(qt.max())) - t0 + 2
    codes = int(max(dc.max(initial=0), qc.max())) + 1
    if span * codes < (1 << 62):
        stride = np.int64(span)
        d_pos = dt - t0
        q_pos = [np.maximum(p - t0, -1) + 1 for p in probes]  # a probe before every point: position 0
        d_pos = d_pos + 1
    else:
        uniq, inv = np.unique(np.concatenate([dt, *probes]), return_inverse=True)
        stride = np.int64(len(uniq) + 1)
        d_pos = inv[:at]
        q_pos = [inv[at + i * n:at + (i + 1) * n] for i in range(len(probes))]
    comp = dc.astype(np.int64) * stride + d_pos
    base = qc.astype(np.int64) * stride
    hi = np.searchsorted(comp, base + q_pos[0], "left")
    start = np.searchsorted(comp, base, "left")
    out = {"start": start, "hi": hi}
    for i, w in enumerate(finite, 1):
        out[w.name] = (np.searchsorted(comp, base + q_pos[i], "left"), hi)
    for w in windows:
        if w.micros is None:
            out[w.name] = (start, hi)
    return out


class _RangeMinMax:
    """Min and max of ``values[lo:hi]`` for many ranges at once (sparse tables up to the longest range)."""

    def __init__(self, values: np.ndarray, longest: int):
        self.mins, self.maxs = [values], [values]
        k = 1
        while (1 << k) <= longest:
            half = 1 << (k - 1)
            lo_, hi_ = self.mins[-1], self.maxs[-1]
            self.mins.append(np.minimum(lo_[:-half], lo_[half:]))
            self.maxs.append(np.maximum(hi_[:-half], hi_[half:]))
            k += 1

    def query(self, lo: np.ndarray, hi: np.ndarray, which: str) -> np.ndarray:
        out = np.full(len(lo), np.nan)
        length = hi - lo
        has = length > 0
        level = np.zeros(len(lo), np.int64)
        level[has] = np.frexp(length[has].astype(np.float64))[1] - 1
        tables = self.mins if which == "min" else self.maxs
        pick = np.minimum if which == "min" else np.maximum
        for k in np.unique(level[has]):
            sel = has & (level == k)
            table = tables[k]
            out[sel] = pick(table[lo[sel]], table[hi[sel] - (1 << int(k))])
        return out


def _sliding_distinct(ranks: np.ndarray, lo: np.ndarray, hi: np.ndarray, kinds: int) -> np.ndarray:
    """Distinct values of ``ranks[lo:hi]`` per query; ``lo`` and ``hi`` never decrease (queries sorted by key and
    time): one pass adding and removing points."""
    counts = [0] * kinds
    vr, los, his = ranks.tolist(), lo.tolist(), hi.tolist()
    out = [0] * len(los)
    cur_lo = cur_hi = d = 0
    for i, (lo_i, hi_i) in enumerate(zip(los, his)):
        while cur_hi < hi_i:
            v = vr[cur_hi]
            if counts[v] == 0:
                d += 1
            counts[v] += 1
            cur_hi += 1
        while cur_lo < lo_i:
            v = vr[cur_lo]
            counts[v] -= 1
            if counts[v] == 0:
                d -= 1
            cur_lo += 1
        out[i] = d
    return np.asarray(out, dtype=np.int64)


# ---------------------------------------------------------------------------------------------
# The state machine
# ---------------------------------------------------------------------------------------------
def _kind(values: np.ndarray) -> str:
    return "number" if values.dtype.kind == "f" else "text"


def _present(values: np.ndarray) -> np.ndarray:
    if values.dtype.kind == "f":
        return np.isfinite(values)
    return np.not_equal(values, None)


class KeyFeatures:
    """The aggregations of one KEY (``--aggregate`` declarations sharing it): their output columns and the state
    machine computing them (``advance``)."""

    def __init__(self, aggregations: Sequence[Aggregation]):
        keys = {a.key for a in aggregations}
        if len(keys) != 1:
            raise ValueError(f"KeyFeatures takes the aggregations of one key, got {sorted(keys)}")
        self.aggregations = tuple(aggregations)
        self.key = self.aggregations[0].key
        self.seen = f"{key_name(self.key)}_seen"
        self.event_aggs = [a for a in self.aggregations if a.column == EVENTS]
        self.column_aggs = [a for a in self.aggregations if a.column != EVENTS]
        self._event_horizon = max([a.longest or 0 for a in self.event_aggs], default=0)

    def names(self) -> list[str]:
        out = [self.seen]
        for a in self.aggregations:
            out.extend(a.names())
        return out

    def new_state(self) -> KeyState:
        return KeyState(series=[Tail() for _ in self.column_aggs])

    # -- the block --------------------------------------------------------------------------------
    def advance(self, keys: Sequence[Hashable], codes: np.ndarray, times: np.ndarray,
                columns: Mapping[str, np.ndarray], states: dict | None = None, *, keep: bool = True
                ) -> dict[str, np.ndarray]:
        """Every output column for the block's events, in the block's order. ``keys[codes[i]]`` is event i's key,
        ``times[i]`` its time (int64 microseconds), ``columns`` the aggregated columns (see the module doc).
        ``states`` (key -> ``KeyState``): read and moved past the block (new keys added); None: no state kept;
        ``keep=False``: read, not moved (the last block of a backfill)."""
        codes = np.asarray(codes, dtype=np.int64)
        times = np.asarray(times, dtype=np.int64)
        if not len(times):
            return {name: np.zeros(0) for name in self.names()}
        order = np.lexsort((times, codes))
        qc, qt = codes[order], times[order]
        present, first = np.unique(qc, return_index=True)
        last = np.append(first[1:], len(qc)) - 1
        key_states = None
        if states is not None:
            key_states = [states.get(keys[c]) or self.new_state() for c in present]
            for i, st in enumerate(key_states):
                if st.last_time is not None and qt[first[i]] < st.last_time:
                    raise OutOfOrderError(f"key {keys[present[i]]!r}: an event at {int(qt[first[i]])} us is earlier "
                                          f"than its state's latest event at {st.last_time} us")
        sorted_out: dict[str, np.ndarray] = {}
        new_last = qt[last]
        if key_states is not None:
            new_last = np.array([max(int(t), st.last_time if st.last_time is not None else int(t))
                                 for t, st in zip(new_last, key_states)], dtype=np.int64)
        # the events: KEY_seen and the counts of *
        ev_tails = [st.events for st in key_states] if key_states is not None else None
        self._events(present, qc, qt, ev_tails if keep else None, ev_tails, new_last, sorted_out)
        for j, agg in enumerate(self.column_aggs):
            values = np.asarray(columns[agg.column])[order]
            tails = [st.series[j] for st in key_states] if key_states is not None else None
            self._column(agg, present, qc, qt, values, tails if keep else None, tails, new_last, sorted_out)
        if key_states is not None and keep:
            for c, st, t in zip(present, key_states, new_last):
                st.last_time = int(t)
                states[keys[c]] = st
        out = {}
        for name in self.names():
            col = sorted_out[name]
            back = np.empty_like(col)
            back[order] = col
            out[name] = back
        return out

    def _points(self, present, qc, qt, values, tails, *, by_value: bool = False):
        """The series' points, the tails' and the block's, sorted by (code, time), and by value among equal times
        where ``by_value`` (last, lastK); the value ranks of text values (None for numbers)."""
        keep = _present(values) if values is not None else None
        dc, dt = (qc[keep], qt[keep]) if keep is not None else (qc, qt)
        dv = values[keep] if values is not None else None
        merged = tails is not None and any(len(t.times) for t in tails)
        if merged:
            sizes = np.array([len(t.times) for t in tails])
            dc = np.concatenate([np.repeat(present, sizes), dc])
            dt = np.concatenate([*(t.times for t in tails), dt])
            if dv is not None:
                parts = [t.values for t in tails if len(t.times)]
                dv = np.concatenate([*parts, dv]) if dv.dtype.kind == "f" else \
                    np.concatenate([*(p.astype(object) for p in parts), dv])
        ranks = np.unique(dv, return_inverse=True)[1] if dv is not None and dv.dtype.kind != "f" else None
        if dv is not None and by_value:
            order = np.lexsort((dv if ranks is None else ranks, dt, dc))
        elif merged:
            order = np.lexsort((dt, dc))
        else:  # the block alone: already in (code, time) order
            return dc, dt, dv, ranks
        return dc[order], dt[order], (dv[order] if dv is not None else None), \
            (ranks[order] if ranks is not None else None)

    def _events(self, present, qc, qt, moved, tails, new_last, out):
        dc, dt, _, _ = self._points(present, qc, qt, None, tails)
        bounds = _bounds(dc, dt, qc, qt, [w for a in self.event_aggs for w in a.windows])
        idx = np.searchsorted(present, qc)
        base = np.array([t.count for t in tails], dtype=np.int64)[idx] if tails is not None else 0
        out[self.seen] = ((bounds["hi"] - bounds["start"] + base) > 0).astype(np.int64)
        for a in self.event_aggs:
            for w in a.windows:
                lo, hi = bounds[w.name]
                out[a.feature("count", w)] = (hi - lo + (base if w.micros is None else 0)).astype(np.int64)
        if moved is not None:
            self._move(dc, dt, None, present, moved, new_last, self._event_horizon, 0, life=True, sums=None)

    def _column(self, agg: Aggregation, present, qc, qt, values, moved, tails, new_last, out):
        if _kind(values) == "text":
            numeric = [a for a in agg.aggs if a in NUMERIC]
            if numeric:
                raise ColumnTypeError(f"--aggregate {agg.text}: {', '.join(numeric)} need{'s' if len(numeric) == 1 else ''} "
                                      f"numbers and column {agg.column!r} holds text")
        dc, dt, dv, ranks = self._points(present, qc, qt, values, tails,
                                         by_value=any(a.startswith("last") for a in agg.aggs))
        bounds = _bounds(dc, dt, qc, qt, agg.windows)
        idx = np.searchsorted(present, qc)
        life = any(w.micros is None for w in agg.windows)
        base = _Bases(tails, idx) if (tails is not None and life) else None
        need_sums = bool(set(agg.aggs) & {"sum", "mean", "std"})
        scale = max(exact.scale_for(dv), base.scale if base else 0) if need_sums else 0
        ints = exact.to_exact(dv, scale) if need_sums else None
        sums = exact.prefix(ints) if need_sums else None
        squares = exact.prefix(ints * ints) if "std" in agg.aggs else None
        rmm = None
        if {"min", "max"} & set(agg.aggs):
            longest = max(int((bounds[w.name][1] - bounds[w.name][0]).max(initial=0)) for w in agg.windows)
            rmm = _RangeMinMax(dv, longest)
        kinds = ranks if ranks is not None else (np.unique(dv, return_inverse=True)[1] if "distinct" in agg.aggs
                                                 else None)
        for w in agg.windows:
            lo, hi = bounds[w.name]
            is_life = w.micros is None
            n = hi - lo
            if is_life and base is not None:
                n = n + base.count
            s_int = q_int = None
            if need_sums:
                s_int = sums[hi] - sums[lo]
                if is_life and base is not None:
                    s_int = s_int + base.totals(scale)
                if squares is not None:
                    q_int = squares[hi] - squares[lo]
                    if is_life and base is not None:
                        q_int = q_int + base.square_sums(scale)
            for a in agg.aggs:
                name = agg.feature(a, w)
                if a == "count":
                    out[name] = n.astype(np.int64)
                elif a == "sum":
                    out[name] = exact.to_float(s_int, scale)
                elif a == "mean":
                    out[name] = exact.means(s_int, n, scale)
                elif a == "std":
                    out[name] = exact.stds(s_int, q_int, n, scale)
                elif a in ("min", "max"):
                    got = rmm.query(lo, hi, a)
                    if is_life and base is not None:
                        got = (np.fmin if a == "min" else np.fmax)(got, base.low if a == "min" else base.high)
                    out[name] = got
                elif a == "distinct":
                    if is_life:
                        out[name] = self._life_distinct(dc, dv, kinds, lo, hi, present, tails, idx)
                    else:
                        out[name] = _sliding_distinct(kinds, lo, hi, int(kinds.max(initial=-1)) + 1)
                else:  # last, lastK
                    k = last_k(a)
                    cols = [self._nth_last(dv, lo, hi, i) for i in range(1, max(k, 1) + 1)]
                    if k:
                        for i, col in enumerate(cols, 1):
                            out[f"{name}_{i}"] = col
                    else:
                        out[name] = cols[0]
        if moved is not None:
            k_max = max([max(last_k(a), 1) for a in agg.aggs if a.startswith("last")], default=0)
            self._move(dc, dt, dv, present, moved, new_last, agg.longest or 0, k_max, life=life,
                       sums=(sums, squares, scale) if need_sums else None,
                       keep_set="distinct" in agg.aggs)

    @staticmethod
    def _nth_last(dv: np.ndarray, lo: np.ndarray, hi: np.ndarray, i: int) -> np.ndarray:
        pos = hi - i
        has = pos >= lo
        if dv.dtype.kind == "f":
            out = np.full(len(lo), np.nan)
        else:
            out = np.full(len(lo), None, dtype=object)
        out[has] = dv[pos[has]]
        return out

    @staticmethod
    def _life_distinct(dc, dv, kinds, lo, hi, present, tails, idx) -> np.ndarray:
        """Distinct values among the evicted ones (a set per key) and ``dv[lo:hi]``: the base set's size plus the
        first occurrences in the key's points not in it."""
        n_kinds = int(kinds.max(initial=-1)) + 1
        pair = dc.astype(np.int64) * max(n_kinds, 1) + kinds
        first = np.zeros(len(dv), dtype=np.int64)
        firsts = np.unique(pair, return_index=True)[1]
        first[firsts] = 1
        sizes = np.zeros(len(present), dtype=np.int64)
        if tails is not None:
            seg = np.searchsorted(present, dc)
            for j in firsts:
                bs = tails[seg[j]].distinct
                if bs and dv[j] in bs:
                    first[j] = 0
            sizes = np.array([len(t.distinct or ()) for t in tails], dtype=np.int64)
        cum = np.concatenate([[0], np.cumsum(first)])
        return sizes[idx] + cum[hi] - cum[lo]

    @staticmethod
    def _move(dc, dt, dv, present, tails, new_last, horizon: int, k_max: int, *, life: bool, sums,
              keep_set: bool = False) -> None:
        """Each key's tail after the block: the points at or after ``latest - horizon`` (the latest time's points
        always: a later event at that same time must not see them) and the last ``k_max``; the ones before, into
        the evicted aggregates (where a life window needs them)."""
        starts = np.searchsorted(dc, present, "left")
        ends = np.searchsorted(dc, present, "right")
        for j, tail in enumerate(tails):
            s, e = int(starts[j]), int(ends[j])
            cut = s + int(np.searchsorted(dt[s:e], int(new_last[j]) - horizon, "left"))
            cut = min(cut, max(s, e - k_max))
            if life and cut > s:
                tail.count += cut - s
                if dv is not None:
                    if sums is not None:
                        prefix_sums, prefix_squares, scale = sums
                        old = tail.scale
                        tail.scale = max(scale, old)
                        tail.total = exact.rescale(tail.total, old, tail.scale) + \
                            exact.rescale(prefix_sums[cut] - prefix_sums[s], scale, tail.scale)
                        if prefix_squares is not None:
                            tail.squares = exact.rescale(tail.squares, 2 * old, 2 * tail.scale) + \
                                exact.rescale(prefix_squares[cut] - prefix_squares[s], 2 * scale, 2 * tail.scale)
                    if dv.dtype.kind == "f":
                        tail.low = float(np.fmin(tail.low, dv[s:cut].min()))
                        tail.high = float(np.fmax(tail.high, dv[s:cut].max()))
                    if keep_set:
                        tail.distinct = (tail.distinct or set()) | set(dv[s:cut].tolist())
            tail.times = dt[cut:e].copy()
            if dv is not None:
                tail.values = dv[cut:e].copy()


class _Bases:
    """The evicted aggregates of each query's key, for life windows."""

    def __init__(self, tails: Sequence[Tail], idx: np.ndarray):
        self.tails, self.idx = tails, idx
        self.count = np.array([t.count for t in tails], dtype=np.int64)[idx]
        self.scale = max((t.scale for t in tails), default=0)
        self.low = np.array([t.low for t in tails], dtype=np.float64)[idx]
        self.high = np.array([t.high for t in tails], dtype=np.float64)[idx]

    def totals(self, scale: int) -> np.ndarray:
        per = np.empty(len(self.tails), dtype=object)
        per[:] = [exact.rescale(t.total, t.scale, scale) for t in self.tails]
        return per[self.idx]

    def square_sums(self, scale: int) -> np.ndarray:
        per = np.empty(len(self.tails), dtype=object)
        per[:] = [exact.rescale(t.squares, 2 * t.scale, 2 * scale) for t in self.tails]
        return per[self.idx]

"""A key's state as bytes: what the stream keeps in Beam keyed state and in its checkpoints.

``encode_state(state) -> bytes`` and ``decode_state(bytes) -> KeyState``: a version byte then ``marshal``
(stdlib) of plain values only (ints of any size, floats, text, bytes, tuples, lists): the tails' times and float
values as little-endian int64 / float64 bytes, text values as lists, the evicted aggregates as they are
(the exact sums as ints). Decoding gives back the same state bit for bit, so a restored key goes on exactly
as if it had never stopped. ``marshal`` reads only what flowtrain wrote: the checkpoints that hold the states are
checksummed files of the run.
"""
from __future__ import annotations

import marshal

import numpy as np

from pipelines.features.core import KeyState, Tail

VERSION = 1


def _tail(t: Tail) -> tuple:
    if t.values is None:
        kind, values = "n", None
    elif t.values.dtype.kind == "f":
        kind, values = "f", t.values.astype("<f8").tobytes()
    else:
        kind, values = "t", list(t.values.tolist())
    return (t.times.astype("<i8").tobytes(), kind, values, t.count, t.scale, t.total, t.squares, t.low, t.high,
            None if t.distinct is None else sorted(t.distinct, key=repr))


def _untail(x: tuple) -> Tail:
    times, kind, values, count, scale, total, squares, low, high, distinct = x
    if kind == "n":
        vals = None
    elif kind == "f":
        vals = np.frombuffer(values, dtype="<f8").astype(np.float64)
    else:
        vals = np.asarray(values, dtype=object) if values else np.zeros(0, dtype=object)
    return Tail(np.frombuffer(times, dtype="<i8").astype(np.int64), vals, count, scale, total, squares, low, high,
                None if distinct is None else set(distinct))


def encode_state(state: KeyState) -> bytes:
    return bytes([VERSION]) + marshal.dumps((state.last_time, _tail(state.events), [_tail(t) for t in state.series]))


def decode_state(data: bytes) -> KeyState:
    if not data or data[0] != VERSION:
        raise ValueError(f"not a feature state of version {VERSION} (first byte {data[:1]!r})")
    last_time, events, series = marshal.loads(data[1:])
    return KeyState(last_time, _untail(events), [_untail(t) for t in series])

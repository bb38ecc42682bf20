"""Exact sums of float64 values, so that a window's sum, mean and standard deviation are functions of the
window's values alone: not of their order, of how the events were cut into blocks, or of the key's history.

A finite float64 is ``M * 2**(e - 53)`` with an integer ``M`` (``numpy.frexp``). At a scale ``s`` with
``s >= 53 - e`` for every value, ``v * 2**s`` is a Python integer, and sums and differences of such integers are
exact. A window's sum is then ``S[hi] - S[lo]`` of the exact prefix sums, converted to the nearest float64 once
(Python's ``int / int`` is correctly rounded). Two computations of the same window (the backfill over a whole
history, the stream over its state and one micro-batch) get the same exact integer whatever scale each chose, so
the same float64, bit for bit; and no cancellation error grows with the history (a prefix-sum difference in
float64 loses ~1e-16 times the history's total).

Numpy object arrays of Python ints: ~0.1-0.3 us per value and operation (measured: 1M values, 55-bit scale:
to_exact 0.21 s, prefix 0.08 s, a window's differences 0.12 s, to_float 0.11 s).
"""
from __future__ import annotations

import numpy as np


def scale_for(values: np.ndarray) -> int:
    """The smallest scale at which every finite value of ``values`` is an integer (0 for none)."""
    v = values[np.isfinite(values) & (values != 0)]
    if not v.size:
        return 0
    _, e = np.frexp(v)
    return max(0, int((53 - e).max()))


def to_exact(values: np.ndarray, scale: int) -> np.ndarray:
    """``values * 2**scale`` as exact Python ints (an object array); ``scale`` from ``scale_for`` or above."""
    m, e = np.frexp(values.astype(np.float64, copy=False))
    mant = (m * 9007199254740992.0).astype(np.int64)  # m * 2**53: exact
    shift = e.astype(np.int64) - 53 + scale
    if shift.size and shift.min() < 0:
        bad = values[np.argmin(shift)]
        raise ValueError(f"scale {scale} too small for {bad!r}")
    return np.left_shift(mant.astype(object), shift.astype(object))


def prefix(ints: np.ndarray) -> np.ndarray:
    """Exact prefix sums with a leading 0: ``P[i]`` is the sum of ``ints[:i]``."""
    out = np.empty(len(ints) + 1, dtype=object)
    out[0] = 0
    if len(ints):
        out[1:] = np.cumsum(ints)
    return out


def rescale(value: int, old: int, new: int) -> int:
    """An exact integer at scale ``old`` at scale ``new >= old``."""
    return value << (new - old)


def to_float(ints: np.ndarray, scale: int) -> np.ndarray:
    """Exact sums at ``scale`` -> the nearest float64 (correctly rounded)."""
    if not len(ints):
        return np.zeros(0)
    return np.asarray(np.true_divide(ints, 1 << scale), dtype=np.float64)


def means(sums: np.ndarray, counts: np.ndarray, scale: int) -> np.ndarray:
    """The correctly rounded sum divided by the count in float64 (within an ulp of the exact mean, and a function
    of the exact sum and the count alone); NaN where the count is 0."""
    out = np.full(len(sums), np.nan)
    has = counts > 0
    if has.any():
        out[has] = to_float(sums[has], scale) / counts[has]
    return out


def stds(sums: np.ndarray, squares: np.ndarray, counts: np.ndarray, scale: int) -> np.ndarray:
    """The population standard deviation ``sqrt((n Q - S^2) / n^2)``: the variance exact and correctly rounded,
    then its square root; NaN where the count is 0 (0 for one value)."""
    out = np.full(len(sums), np.nan)
    has = counts > 0
    if has.any():
        n = counts[has].astype(object)
        num = n * squares[has] - sums[has] * sums[has]
        den = np.left_shift(n * n, 2 * scale)
        out[has] = np.sqrt(np.asarray(np.true_divide(num, den), dtype=np.float64))
    return out

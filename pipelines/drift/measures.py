"""Drift measures between two histograms, thresholds, and an ADWIN change detector: pure numpy, no I/O.

Histograms are counts over the same buckets (a numeric feature's fixed quantile bins, a categorical
feature's values plus "other" and "unseen"). Every measure smooths empty buckets the same way
(``SMOOTHING`` added to each count) so that an empty bucket never makes a measure infinite.

- ``psi``: population stability index, sum (q - p) ln(q / p) (p reference, q current). Usual reading:
  < 0.1 no change, 0.1 to 0.25 moderate, > 0.25 large.
- ``js``: Jensen-Shannon divergence in bits (base 2), in [0, 1].
- ``linf``: L-infinity distance, the largest absolute difference of one bucket's share (TFDV's
  categorical comparator).
- ``Adwin``: ADWIN (Bifet and Gavalda, "Learning from Time-Changing Data with Adaptive Windowing",
  SDM 2007) on a stream of values in [0, 1] (the prequential error: 1 for a wrong prediction).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

#: Added to every bucket's count before turning counts into shares.
SMOOTHING = 0.5

#: Default thresholds, one per measure (a measure above its threshold is an alarm); ``--drift-threshold``
#: changes them. ``unseen`` and ``missing`` are increases over the reference's rate, ``out_of_range`` a rate,
#: ``prediction`` the PSI (or L-infinity for classes) of the model's scores, ``adwin`` ADWIN's confidence delta.
DEFAULT_THRESHOLDS: dict[str, float] = {
    "psi": 0.2, "js": 0.1, "linf": 0.15, "unseen": 0.1, "missing": 0.1, "out_of_range": 0.01,
    "prediction": 0.2, "adwin": 0.002,
}
#: A window with fewer rows than this is not compared (its measures are shown, never an alarm).
MIN_ROWS = 100
#: The data-quality margin: a numeric value further than this fraction of the training range (max - min)
#: outside [min, max] counts as out of range.
RANGE_MARGIN = 0.1


def shares(counts) -> np.ndarray:
    c = np.asarray(counts, dtype=np.float64) + SMOOTHING
    return c / c.sum()


def psi(reference, current) -> float:
    """Population stability index of ``current`` against ``reference`` (counts over the same buckets)."""
    p, q = shares(reference), shares(current)
    return float(np.sum((q - p) * np.log(q / p)))


def js(reference, current) -> float:
    """Jensen-Shannon divergence (bits, in [0, 1]) of two histograms over the same buckets."""
    p, q = shares(reference), shares(current)
    m = 0.5 * (p + q)
    return float(0.5 * np.sum(p * np.log2(p / m)) + 0.5 * np.sum(q * np.log2(q / m)))


def linf(reference, current) -> float:
    """The largest absolute difference between the two histograms' shares of one bucket (no smoothing)."""
    p, q = np.asarray(reference, np.float64), np.asarray(current, np.float64)
    if p.sum() <= 0 or q.sum() <= 0:
        return 0.0
    return float(np.max(np.abs(p / p.sum() - q / q.sum())))


def parse_thresholds(text: str | None) -> dict[str, float]:
    """``psi=0.2,linf=0.1`` -> the defaults with those replaced. An unknown measure or a value that is not a
    positive number: ``ValueError`` naming it and the known ones."""
    out = dict(DEFAULT_THRESHOLDS)
    for part in (text or "").split(","):
        if not part.strip():
            continue
        name, eq, value = part.partition("=")
        name = name.strip()
        if not eq or name not in DEFAULT_THRESHOLDS:
            raise ValueError(f"--drift-threshold {part.strip()!r}: expected MEASURE=VALUE with MEASURE one of "
                             f"{', '.join(DEFAULT_THRESHOLDS)}")
        try:
            number = float(value)
        except ValueError:
            number = float("nan")
        if not (math.isfinite(number) and number > 0):
            raise ValueError(f"--drift-threshold {part.strip()!r}: the value must be a positive number")
        out[name] = number
    if out["adwin"] >= 1:
        raise ValueError("--drift-threshold adwin=DELTA: ADWIN's delta must be below 1 (default 0.002)")
    return out


@dataclass
class Adwin:
    """ADWIN on values in [0, 1], kept as blocks of ``block`` values (sum, count).

    After each ``update`` that completed a block it looks for a cut of the window into an older part W0 and a newer part W1
    (at every block boundary) whose means differ by more than ADWIN's bound (the paper's
    ``epsilon_cut`` with its variance form, section 3 of Bifet and Gavalda 2007)::

        eps = sqrt(2 / m * var * ln(2 / d')) + 2 / (3 m) * ln(2 / d'),  m = 1 / (1/n0 + 1/n1),  d' = delta / n

    and drops W0 when it finds one: that is a change (``changes`` counts them; ``detected`` is true
    after the block that found one). By the paper's Theorem 3.1, while the mean does not change the
    probability that one check raises a false alarm is at most ``delta``; there is at most one check per
    block, so over a stream of N values the expected number of false alarms is at most delta * N / block
    (delta 0.002, blocks of 32: at most one false alarm per 16,000 blocks, about 512,000 values; the
    scorer checks once per micro-batch, far fewer). The variance is bounded by mean * (1 - mean), the
    largest a [0, 1] variable with that mean can have, so the bound only grows (fewer false alarms).
    Checking at block boundaries only (ADWIN2 checks at its exponential-histogram boundaries) costs
    O(blocks) numpy work per check. The window holds at most ``max_blocks`` blocks (oldest dropped).
    """

    delta: float = 0.002
    block: int = 32
    max_blocks: int = 1024

    def __post_init__(self):
        self.sums = np.zeros(0)  # each whole block's sum, oldest first (every block holds ``block`` values)
        self._sum, self._n = 0.0, 0
        self.changes = 0
        self.detected = False

    @property
    def width(self) -> int:
        return self.sums.size * self.block + self._n

    @property
    def mean(self) -> float:
        n = self.width
        return (sum(self.sums.tolist()) + self._sum) / n if n else 0.0

    def update(self, values) -> bool:
        """Add values (in order); True when a change was detected while adding them."""
        values = np.clip(np.asarray(values, dtype=np.float64).ravel(), 0.0, 1.0)
        new = []
        i = 0
        if self._n:  # the partial block first
            i = min(self.block - self._n, values.size)
            self._sum += float(values[:i].sum())
            self._n += i
            if self._n == self.block:
                new.append(np.asarray([self._sum]))
                self._sum, self._n = 0.0, 0
        full = (values.size - i) // self.block
        if full:  # whole blocks at once
            new.append(values[i:i + full * self.block].reshape(full, self.block).sum(axis=1))
            i += full * self.block
        if i < values.size:
            self._sum += float(values[i:].sum())
            self._n += values.size - i
        if new:
            self.sums = np.concatenate([self.sums, *new])[-self.max_blocks:]  # the oldest dropped beyond max_blocks
        self.detected = self._check() if new else False
        return self.detected

    def _check(self) -> bool:
        found = False
        while self.sums.size >= 2:
            s = self.sums
            c = np.full(s.size, float(self.block))
            n = c.sum()
            mean = s.sum() / n
            # variance of the window's values, bounded by the mean of Bernoulli-like values in [0, 1]
            var = max(mean * (1 - mean), 1e-12)
            n0 = np.cumsum(c)[:-1]
            s0 = np.cumsum(s)[:-1]
            n1 = n - n0
            mu0, mu1 = s0 / n0, (s.sum() - s0) / n1
            m = 1.0 / (1.0 / n0 + 1.0 / n1)
            ln = math.log(2.0 * n / self.delta)
            eps = np.sqrt(2.0 / m * var * ln) + 2.0 / (3.0 * m) * ln
            cut = np.flatnonzero(np.abs(mu0 - mu1) > eps)
            if cut.size == 0:
                break
            drop = int(cut[-1]) + 1  # the largest old part that differs: keep the newest values
            self.sums = self.sums[drop:]
            self.changes += 1
            found = True
        return found

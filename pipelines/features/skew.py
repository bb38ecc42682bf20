"""The skew gate: feature values a stream logged (``--log-features``: the pipeline's or the scorer's) against the
backfill of the same events (``flowtrain features``), per feature.

``compare(logged_rows, backfill, id_column)`` matches events by ``id_column`` and reports for each feature column
the backfill has: ``mismatches`` (values that differ by more than ``tolerance`` relative, or one of them null),
``max_difference`` (the largest relative difference), and for the events: ``missing`` (in the backfill, not
logged: events still waiting for the watermark, late ones, or lost), ``extra`` (logged, not in the backfill) and
``inconsistent`` (an event logged twice with other values). Floats are compared exactly as logged (JSON keeps a
float64 bit for bit)."""
from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

TOLERANCE = 1e-9


@dataclass
class FeatureSkew:
    name: str
    compared: int = 0
    mismatches: int = 0
    max_difference: float = 0.0
    example: str = ""


@dataclass
class SkewReport:
    events_logged: int
    events_backfill: int
    matched: int
    missing: int
    extra: int
    inconsistent: int
    features: list[FeatureSkew] = field(default_factory=list)

    @property
    def mismatches(self) -> int:
        return sum(f.mismatches for f in self.features) + self.inconsistent

    def lines(self) -> list[str]:
        out = [f"events: {self.matched:,} compared; {self.missing:,} missing (in the backfill, not logged), "
               f"{self.extra:,} extra (logged, not in the backfill), {self.inconsistent:,} logged twice with other "
               f"values",
               f"{'feature':<40} {'compared':>9} {'mismatches':>10} {'max rel. difference':>19}"]
        for f in self.features:
            out.append(f"{f.name:<40} {f.compared:>9,} {f.mismatches:>10,} {f.max_difference:>19.3g}"
                       + (f"  e.g. {f.example}" if f.example else ""))
        return out


def read_logged(paths: Iterable[str]) -> list[dict]:
    """Every JSON line of the files (a directory: its ``*.jsonl``)."""
    rows = []
    for p in paths:
        path = Path(p)
        files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
        for f in files:
            with open(f, encoding="utf-8") as fh:
                rows.extend(json.loads(line) for line in fh if line.strip())
    return rows


def _differ(a, b, tolerance: float) -> tuple[bool, float]:
    if a is None or b is None or (isinstance(a, float) and math.isnan(a)) or (isinstance(b, float) and math.isnan(b)):
        none_a = a is None or (isinstance(a, float) and math.isnan(a))
        none_b = b is None or (isinstance(b, float) and math.isnan(b))
        return none_a != none_b, (math.inf if none_a != none_b else 0.0)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        a, b = float(a), float(b)
        if a == b:
            return False, 0.0
        rel = abs(a - b) / max(abs(a), abs(b))
        return rel > tolerance, rel
    return str(a) != str(b), (0.0 if str(a) == str(b) else math.inf)


def _id(value) -> str:
    """An event's id as text: a stream keeps an event field it does not aggregate as the event's text (``42``), a
    file may hold it as a number (``42`` or ``42.0``)."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def compare(logged: Sequence[dict], backfill: pa.Table, id_column: str, *, features: Sequence[str] | None = None,
            tolerance: float = TOLERANCE) -> SkewReport:
    """The skew report of ``logged`` rows against ``backfill`` (see the module doc)."""
    if id_column not in backfill.column_names:
        raise ValueError(f"the backfill has no column {id_column!r} (it has {', '.join(backfill.column_names)})")
    by_id: dict = {}
    inconsistent = 0
    for row in logged:
        if id_column not in row:
            raise ValueError(f"a logged row has no {id_column!r}: {sorted(row)[:12]}")
        key = _id(row[id_column])
        if key in by_id and by_id[key] != row:
            inconsistent += 1
        by_id.setdefault(key, row)
    names = list(features) if features else [c for c in backfill.column_names if c != id_column and any(
        c in r for r in logged[:50])]
    ids = [_id(v) for v in backfill.column(id_column).to_pylist()]
    cols = {n: backfill.column(n).to_pylist() for n in names}
    found = [i for i, k in enumerate(ids) if k in by_id]
    report = SkewReport(len(by_id), len(ids), len(found), len(ids) - len(found), len(set(by_id) - set(ids)),
                        inconsistent)
    for n in names:
        f = FeatureSkew(n)
        for i in found:
            row = by_id[ids[i]]
            differ, diff = _differ(row.get(n), cols[n][i], tolerance)
            f.compared += 1
            if differ:
                f.mismatches += 1
                if not f.example:
                    f.example = f"{id_column}={ids[i]}: logged {row.get(n)!r}, backfill {cols[n][i]!r}"
            if diff > f.max_difference and np.isfinite(diff):
                f.max_difference = diff
            elif not np.isfinite(diff):
                f.max_difference = math.inf
        report.features.append(f)
    return report

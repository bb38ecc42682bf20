"""Numeric ranges: the one check of a numeric value's size, for the batch ETL, the streaming pipeline
and predict alike.

A column's range is declared (``FeatureSpec.numeric_range``, ``--numeric-range col=LO:HI``; checked
when rows are validated, before any statistics) or derived from the training statistics: a magnitude
below ``2**RANGE_MARGIN_BITS`` times the 99th percentile of the column's nonzero magnitudes in the
training split, rounded up to a power of two (``stats["numeric"][col]["max_abs"]``). The statistics
(``stats``) count magnitudes by power of two, so the mean and std leave out exactly the training rows
beyond that bound (which the ETL's featurize step then sends to the dead letters): one absurd value
(1e30) neither trains nor skews the standardization. With ``FeatureSpec.clip_numeric``
(``--clip-outliers``) such values are clipped to the range instead of rejecting their row.

A regression label is bounded the same way (``label_range_check``): its statistics count its magnitudes by
power of two, ``stats["label_max_abs"]`` is its bound, ``label_mean``/``label_std`` leave out the training
rows beyond it (``stats["label_outside"]``: how many), and featurizing sends a row whose label is beyond it
to the dead letters with the reason, in the batch ETL and the stream alike. A label is never clipped (that
would train on a target the data does not hold), ``--clip-outliers`` or not.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from connectors.dataset_spec import FeatureSpec
from pipelines.tabular.columns import floats

#: A numeric column without a declared range accepts magnitudes below 2**RANGE_MARGIN_BITS (about a million)
#: times the RANGE_QUANTILE quantile of its nonzero magnitudes in the training split, rounded up to a power of 2.
RANGE_MARGIN_BITS = 20
RANGE_QUANTILE = 0.99


def numeric_ranges(spec: FeatureSpec, stats: dict | None) -> dict[str, tuple[float, float, str]]:
    """Each numeric column's range as (low, high, where from): declared, else from ``stats`` (``max_abs``:
    values with a magnitude of it or more are out); a column with neither is not listed."""
    out = {col: (lo, hi, "declared") for col, (lo, hi) in spec.numeric_range.items()}
    for col in spec.all_numeric:
        bound = ((stats or {}).get("numeric") or {}).get(col, {}).get("max_abs")
        if col not in out and bound:
            out[col] = (-float(bound), float(bound), "statistics")
    return out


def range_checks(batch: pa.RecordBatch, spec: FeatureSpec, stats: dict | None = None
                 ) -> list[tuple[str, np.ndarray]]:
    """(reason, rows that fail) for numeric values outside their column's range (``numeric_ranges``: declared
    ones always, the statistics' with ``stats``); none with ``spec.clip_numeric`` (values are clipped)."""
    if spec.clip_numeric:
        return []
    checks = []
    for col, (lo, hi, source) in numeric_ranges(spec, stats).items():
        v = floats(batch.column(col))
        with np.errstate(invalid="ignore"):
            if source == "declared":
                fails = (v < lo) | (v > hi)
                reason = f"numeric feature {col!r} is outside its declared range [{lo:g}, {hi:g}] (--numeric-range)"
            else:
                fails = np.abs(v) >= hi
                reason = (f"numeric feature {col!r} is out of range: a magnitude of {hi:.4g} or more, over "
                          f"2^{RANGE_MARGIN_BITS} times the training split's usual size (if such values are real, "
                          f"declare the range with --numeric-range {col}=LO:HI, or pass --clip-outliers)")
        checks.append((reason, fails & np.isfinite(v)))
    return checks


def label_range_check(batch: pa.RecordBatch, spec: FeatureSpec, stats: dict | None) -> tuple[str, np.ndarray] | None:
    """(reason, rows that fail) for a regression label at or past the bound its statistics allow
    (``stats["label_max_abs"]``); None for a classification label or statistics without a bound."""
    bound = (stats or {}).get("label_max_abs")
    if spec.task != "regression" or not bound:
        return None
    v = floats(batch.column(spec.label))
    with np.errstate(invalid="ignore"):
        fails = (np.abs(v) >= float(bound)) & np.isfinite(v)
    return (f"label {spec.label!r} is out of range: a magnitude of {float(bound):.4g} or more, over "
            f"2^{RANGE_MARGIN_BITS} times the training split's usual size (fix or drop such rows upstream)", fails)


def clip_to_range(values: np.ndarray, col: str, spec: FeatureSpec, stats: dict | None) -> np.ndarray:
    """``values`` clipped to the column's range (``spec.clip_numeric``), else as they are."""
    if not spec.clip_numeric:
        return values
    found = numeric_ranges(spec, stats).get(col)
    if found is None:
        return values
    lo, hi, source = found
    if source == "statistics":  # magnitudes below the bound
        lo, hi = np.nextafter(lo, 0.0), np.nextafter(hi, 0.0)
    return np.clip(values, lo, hi)

"""Validation: the checks every tabular row gets (label, features, required IDs, declared ranges, the time
column); the rows that fail become dead letters naming their source and the first failed check."""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from connectors.dataset_spec import FeatureSpec
from connectors.id_keys import BAD_KEYS, keys_of
from connectors.rows import DeadLetter
from pipelines.tabular.columns import floats, source_strings
from pipelines.tabular.labels import is_classes, label_keys
from pipelines.tabular.ranges import range_checks
from pipelines.tabular.times import describe_time_format, time_seconds


def row_checks(batch: pa.RecordBatch, spec: FeatureSpec, stats: dict | None = None) -> list[tuple[str, np.ndarray]]:
    """(reason, rows that fail) for the checks every tabular dataset gets."""
    label = batch.column(spec.label)
    missing = np.asarray(label.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    checks = [(f"label {spec.label!r} is missing", missing)]
    if is_classes(spec):
        no_class = np.asarray(label_keys(label).is_null().to_numpy(zero_copy_only=False), dtype=bool)
        checks.append((f"label {spec.label!r} is not a class value (NaN, infinite or empty)", no_class & ~missing))
    else:
        vals = floats(label)
        checks.append((f"label {spec.label!r} is not a finite number", ~np.isfinite(vals) & ~missing))
    checks += feature_checks(batch, spec, stats)
    if spec.weight_column:
        checks.append(weight_check(batch, spec))
    if spec.time_column:
        t = time_seconds(batch.column(spec.time_column), spec.time_format)
        checks.append((f"time column {spec.time_column!r} is missing or not a time "
                       f"({describe_time_format(spec.time_format)})", ~np.isfinite(t)))
    return checks


def weight_check(batch: pa.RecordBatch, spec: FeatureSpec) -> tuple[str, np.ndarray]:
    """(reason, rows that fail) for ``--weight-column``: a weight is a finite number >= 0."""
    w = floats(batch.column(spec.weight_column))
    with np.errstate(invalid="ignore"):
        return (f"weight column {spec.weight_column!r} is missing, not a finite number or negative (a sample weight "
                f"is a number >= 0)", ~(np.isfinite(w) & (w >= 0)))


def feature_checks(batch: pa.RecordBatch, spec: FeatureSpec, stats: dict | None = None
                   ) -> list[tuple[str, np.ndarray]]:
    """(reason, rows that fail) for the feature columns: what a row needs to be predicted (no label, no time);
    with ``stats``, the ranges derived from them too (``range_checks``)."""
    checks = []
    for col in spec.numeric:
        checks.append((f"numeric feature {col!r} is missing or not a finite number", ~np.isfinite(floats(batch.column(col)))))
    for col in spec.optional_numeric:
        values = batch.column(col)
        present = np.asarray(values.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
        checks.append((f"optional numeric feature {col!r} is not a finite number",
                       present & ~np.isfinite(floats(values))))
    for col in spec.required_ids:  # an ID the spec requires: no key is a dead letter, not the fallback vector
        keys = keys_of(batch.column(col).to_pylist(), spec.max_id_bytes)
        for kind, key in BAD_KEYS.items():
            checks.append((f"required ID {col!r} is {kind.replace('_', ' ')}"
                           f"{f' (over {spec.max_id_bytes} bytes)' if kind == 'too_long' else ''}; it has no key "
                           f"(--required-ids)", keys == key))
    return checks + range_checks(batch, spec, stats)


def dead_letters(batch: pa.RecordBatch, rows: np.ndarray, reasons) -> list[DeadLetter]:
    """A dead letter for each of ``rows`` of ``batch``: its values (not the reader's source columns), its
    source (``file:row``) and its reason."""
    idx = pa.array(rows)
    payloads = batch.take(idx).to_pylist()
    sources = source_strings(batch).take(idx).to_pylist()
    return [DeadLetter({k: v for k, v in row.items() if not k.startswith("_source")}, src, reason)
            for row, src, reason in zip(payloads, sources, reasons)]


def split_valid(batch: pa.RecordBatch, spec: FeatureSpec, extra_checks: list[tuple[str, np.ndarray]] = (), *,
                features_only: bool = False, stats: dict | None = None) -> tuple[pa.RecordBatch, list[DeadLetter]]:
    """Rows the features can use, and a dead letter (first failed check) for each row they cannot.

    ``extra_checks`` (a dataset's own rules, e.g. impossible values) come first, so their more
    specific reasons win over the generic ones. ``features_only``: only the feature columns' checks (rows to
    predict: the label and the time column may be absent). ``stats``: the dataset's statistics, whose numeric
    ranges are checked too (without them only declared ranges are: the ETL validates before its statistics).
    """
    checks = list(extra_checks) + (feature_checks(batch, spec, stats) if features_only
                                   else row_checks(batch, spec, stats))
    bad = np.zeros(batch.num_rows, dtype=bool)
    code = np.full(batch.num_rows, -1, dtype=np.int32)
    for i, (_, fails) in enumerate(checks):
        code[fails & ~bad] = i
        bad |= fails
    if not bad.any():
        return batch, []
    rows = np.flatnonzero(bad)
    return batch.filter(pa.array(~bad)), dead_letters(batch, rows, [checks[c][0] for c in code[rows]])

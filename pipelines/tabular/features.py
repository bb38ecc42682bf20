"""Column-at-a-time feature code shared by the batch ETL and the streaming pipeline.

Everything here takes and returns Arrow record batches and works on whole columns with
pyarrow.compute and numpy: no Python loop over rows, except to describe the (few) rows that
become dead letters.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from connectors.deadletter import DeadLetter
from connectors.files import SOURCE_FILE, SOURCE_ROW
from connectors.dataset_spec import CAT_PREFIX, LABEL, NUM_PREFIX, SOURCE, FeatureSpec


class SchemaError(ValueError):
    """Input files do not have the declared columns or types; raised before any training."""


# ---------------------------------------------------------------------------------------------
# Schema check
# ---------------------------------------------------------------------------------------------
def _kind(t: pa.DataType) -> str:
    if pa.types.is_boolean(t):
        return "boolean"
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t):
        return "number"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_dictionary(t):
        return "string"
    if pa.types.is_timestamp(t) or pa.types.is_date(t):
        return "time"
    if pa.types.is_null(t):
        return "null"
    return str(t)


def check_schema(schema: pa.Schema, spec: FeatureSpec, where: str) -> None:
    """Missing or wrongly typed declared columns -> ``SchemaError`` naming file, column, types."""
    names = set(schema.names)
    missing = [c for c in spec.input_columns if c not in names]
    if missing:
        raise SchemaError(f"{where}: missing declared column(s) {', '.join(missing)}; "
                          f"the file has {', '.join(schema.names)}")
    wanted = {c: ("number",) for c in spec.all_numeric}
    wanted.update({c: ("string", "number", "boolean") for c in spec.categorical})
    wanted[spec.label] = ("number", "boolean") if spec.task == "regression" or spec.positive_above is not None \
        else ("number", "boolean", "string")
    if spec.time_column:
        wanted[spec.time_column] = ("time", "number", "string")
    for col, kinds in wanted.items():
        found = _kind(schema.field(col).type)
        if found not in kinds and found != "null":
            raise SchemaError(f"{where}: column {col!r} has type {schema.field(col).type} ({found}); "
                              f"expected {' or '.join(kinds)}")


# ---------------------------------------------------------------------------------------------
# Validation: bad rows become dead letters
# ---------------------------------------------------------------------------------------------
def source_strings(batch: pa.RecordBatch) -> pa.Array:
    """``file:row`` for each row (the reader's source columns), or an existing ``source``."""
    if SOURCE in batch.schema.names:
        return batch.column(SOURCE)
    if SOURCE_FILE in batch.schema.names:
        return pc.binary_join_element_wise(batch.column(SOURCE_FILE),
                                           pc.cast(batch.column(SOURCE_ROW), pa.string()), ":")
    return pa.array([""] * batch.num_rows)


def _as_float(col: pa.Array) -> pa.Array:
    if pa.types.is_boolean(col.type):
        return pc.cast(col, pa.int8()).cast(pa.float64())
    return pc.cast(col, pa.float64(), safe=False)


def row_checks(batch: pa.RecordBatch, spec: FeatureSpec) -> list[tuple[str, np.ndarray]]:
    """(reason, rows that fail) for the checks every tabular dataset gets."""
    label = batch.column(spec.label)
    missing = np.asarray(label.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    checks = [(f"label {spec.label!r} is missing", missing)]
    if _kind(label.type) == "number":
        vals = _as_float(label).to_numpy(zero_copy_only=False)
        checks.append((f"label {spec.label!r} is not a finite number", ~np.isfinite(vals) & ~missing))
    for col in spec.numeric:
        vals = _as_float(batch.column(col)).to_numpy(zero_copy_only=False)
        checks.append((f"numeric feature {col!r} is missing or not a finite number", ~np.isfinite(vals)))
    return checks


def split_valid(batch: pa.RecordBatch, spec: FeatureSpec,
                extra_checks: list[tuple[str, np.ndarray]] = ()) -> tuple[pa.RecordBatch, list[DeadLetter]]:
    """Rows the features can use, and a dead letter (first failed check) for each row they cannot.

    ``extra_checks`` (a dataset's own rules, e.g. impossible values) come first, so their more
    specific reasons win over the generic ones.
    """
    checks = list(extra_checks) + row_checks(batch, spec)
    bad = np.zeros(batch.num_rows, dtype=bool)
    code = np.full(batch.num_rows, -1, dtype=np.int32)
    for i, (_, fails) in enumerate(checks):
        code[fails & ~bad] = i
        bad |= fails
    if not bad.any():
        return batch, []
    bad_idx = pa.array(np.flatnonzero(bad))
    rows = batch.take(bad_idx).to_pylist()
    sources = source_strings(batch).take(bad_idx).to_pylist()
    letters = [DeadLetter({k: v for k, v in row.items() if not k.startswith("_source")}, src, checks[c][0])
               for row, src, c in zip(rows, sources, code[np.flatnonzero(bad)])]
    return batch.filter(pa.array(~bad)), letters


# ---------------------------------------------------------------------------------------------
# Splitting
# ---------------------------------------------------------------------------------------------
def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer: a fast, well-spread hash of 64-bit integers."""
    x = x.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x


def _time_values(col: pa.Array) -> np.ndarray:
    """Time as float seconds since the epoch (timestamps of any unit, dates, ISO strings); a number as is."""
    if pa.types.is_date(col.type):
        col = pc.cast(col, pa.timestamp("s"))
    elif pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        col = pc.strptime(col, format="%Y-%m-%dT%H:%M:%S", unit="s", error_is_null=True)
    if pa.types.is_timestamp(col.type):
        per_second = {"s": 1.0, "ms": 1e3, "us": 1e6, "ns": 1e9}[col.type.unit]
        return _as_float(pc.cast(col, pa.int64())).to_numpy(zero_copy_only=False) / per_second
    return _as_float(col).to_numpy(zero_copy_only=False)


def time_cutoff(value: str | float | None) -> float | None:
    """A cutoff given as a number, or an ISO date/time (UTC unless it says otherwise) in seconds."""
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    import datetime as dt

    when = dt.datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return when.timestamp()


def assign_splits(batch: pa.RecordBatch, spec: FeatureSpec, cutoffs: tuple[float, float] | None = None,
                  row_ids: np.ndarray | None = None) -> np.ndarray:
    """Split code per row: 0 train, 1 valid, 2 test.

    By time: ``t < valid_from`` train, ``valid_from <= t < test_from`` valid, the rest test,
    so no row of the test period reaches training. At random: a hash of the row's source and
    the seed, so a row always lands in the same split whatever the bundling.
    """
    if spec.time_column:
        assert cutoffs is not None, "time splits need cutoffs"
        t = _time_values(batch.column(spec.time_column))
        return np.where(t < cutoffs[0], 0, np.where(t < cutoffs[1], 1, 2)).astype(np.int8)
    if row_ids is None:
        row_ids = _row_ids(batch)
    u = _mix64(row_ids ^ np.uint64(spec.seed * 0x9E3779B97F4A7C15 % (1 << 64))).astype(np.float64) / 2.0**64
    f_train, f_valid, _ = spec.fractions
    return np.where(u < f_train, 0, np.where(u < f_train + f_valid, 1, 2)).astype(np.int8)


def hash_str(s: str) -> int:
    import zlib

    return zlib.crc32(s.encode()) * 0x100000001B3 % (1 << 64)


def _row_ids(batch: pa.RecordBatch) -> np.ndarray:
    """A stable 64-bit id per row from its source (file and row number, or source string)."""
    if SOURCE_ROW in batch.schema.names and batch.num_rows:
        files = batch.column(SOURCE_FILE)
        file_ids = np.array([hash_str(f) for f in pc.unique(files).to_pylist()], dtype=np.uint64)
        which = pc.index_in(files, value_set=pc.unique(files)).to_numpy(zero_copy_only=False)
        return batch.column(SOURCE_ROW).to_numpy().astype(np.uint64) ^ file_ids[which]
    return np.array([hash_str(s or "") for s in source_strings(batch).to_pylist()], dtype=np.uint64)


# ---------------------------------------------------------------------------------------------
# Full-pass statistics over the training split
# ---------------------------------------------------------------------------------------------
@dataclass
class StatsAccumulator:
    """Sums for mean/std and value counts for vocabularies; mergeable (a Beam CombineFn's state)."""

    count: dict[str, int] = field(default_factory=dict)
    total: dict[str, float] = field(default_factory=dict)
    total_sq: dict[str, float] = field(default_factory=dict)
    values: dict[str, dict] = field(default_factory=dict)
    label_values: dict = field(default_factory=dict)
    label_sum: float = 0.0
    label_sq: float = 0.0
    rows: int = 0

    def add(self, batch: pa.RecordBatch, spec: FeatureSpec) -> "StatsAccumulator":
        self.rows += batch.num_rows
        for col in spec.all_numeric:
            vals = _as_float(batch.column(col)).to_numpy(zero_copy_only=False)
            vals = vals[np.isfinite(vals)]
            self.count[col] = self.count.get(col, 0) + int(vals.size)
            self.total[col] = self.total.get(col, 0.0) + float(vals.sum())
            self.total_sq[col] = self.total_sq.get(col, 0.0) + float(np.square(vals).sum())
        for col in spec.categorical:
            counts = self.values.setdefault(col, {})
            vc = pc.value_counts(pc.cast(batch.column(col), pa.string()))
            for value, n in zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist()):
                if value is not None:
                    counts[value] = counts.get(value, 0) + n
        labels = label_values(batch.column(spec.label), spec)
        self.label_sum += float(labels.astype(np.float64).sum())
        self.label_sq += float(np.square(labels.astype(np.float64)).sum())
        if spec.task == "classification":
            for v, n in zip(*np.unique(labels, return_counts=True)):
                self.label_values[float(v)] = self.label_values.get(float(v), 0) + int(n)
        else:
            for v in np.unique(labels)[:3]:
                self.label_values[float(v)] = self.label_values.get(float(v), 0) + 1
        return self

    def merge(self, other: "StatsAccumulator") -> "StatsAccumulator":
        self.rows += other.rows
        self.label_sum += other.label_sum
        self.label_sq += other.label_sq
        for name in ("count", "total", "total_sq"):
            mine, theirs = getattr(self, name), getattr(other, name)
            for k, v in theirs.items():
                mine[k] = mine.get(k, 0) + v
        for col, counts in other.values.items():
            mine = self.values.setdefault(col, {})
            for k, v in counts.items():
                mine[k] = mine.get(k, 0) + v
        for k, v in other.label_values.items():
            self.label_values[k] = self.label_values.get(k, 0) + v
        return self

    def finalize(self, spec: FeatureSpec) -> dict:
        numeric = {}
        for col in spec.all_numeric:
            n = self.count.get(col, 0)
            mean = self.total.get(col, 0.0) / n if n else 0.0
            var = max(self.total_sq.get(col, 0.0) / n - mean * mean, 0.0) if n else 0.0
            std = math.sqrt(var)
            numeric[col] = {"mean": mean, "std": std if std > 1e-12 else 1.0, "count": n}
        vocab = {}
        for col in spec.categorical:
            counts = self.values.get(col, {})
            kept = sorted((v for v, n in counts.items() if n >= spec.min_count),
                          key=lambda v: (-counts[v], v))[: spec.max_vocab]
            vocab[col] = kept  # code = index + 1; 0 is out-of-vocabulary / missing
        label_mean = self.label_sum / self.rows if self.rows else 0.0
        label_var = self.label_sq / self.rows - label_mean ** 2 if self.rows else 0.0
        return {"numeric": numeric, "vocab": vocab, "train_rows": self.rows, "label_mean": label_mean,
                "label_std": math.sqrt(max(label_var, 0.0)) or 1.0,
                "label_values": sorted(self.label_values)}


def label_values(col: pa.Array, spec: FeatureSpec) -> np.ndarray:
    """The label as float32: the target for regression, 0/1 for classification."""
    if spec.task == "classification":
        if spec.positive_above is not None:
            return (_as_float(col).to_numpy(zero_copy_only=False) > spec.positive_above).astype(np.float32)
        if pa.types.is_string(col.type):
            return np.asarray(pc.equal(col, "1").to_numpy(zero_copy_only=False) |
                              pc.equal(pc.utf8_lower(col), "true").to_numpy(zero_copy_only=False),
                              dtype=np.float32)
        return (_as_float(col).to_numpy(zero_copy_only=False) > 0.5).astype(np.float32)
    return _as_float(col).to_numpy(zero_copy_only=False).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# Featurizing with the statistics
# ---------------------------------------------------------------------------------------------
def _codes(col: pa.Array, vocab: list) -> np.ndarray:
    idx = pc.index_in(pc.cast(col, pa.string()), value_set=pa.array(vocab, type=pa.string()))
    return (pc.fill_null(idx, -1).to_numpy(zero_copy_only=False) + 1).astype(np.int32)


def featurize(batch: pa.RecordBatch, spec: FeatureSpec, stats: dict) -> pa.RecordBatch:
    """Valid input rows -> model features: standardized numerics, category codes, label, source."""
    arrays, names = [], []
    for col in spec.all_numeric:
        s = stats["numeric"][col]
        vals = _as_float(batch.column(col)).to_numpy(zero_copy_only=False)
        z = (vals - s["mean"]) / s["std"]
        arrays.append(pa.array(np.nan_to_num(z, nan=0.0, posinf=0.0, neginf=0.0).astype(np.float32)))
        names.append(NUM_PREFIX + col)
    for col in spec.categorical:
        arrays.append(pa.array(_codes(batch.column(col), stats["vocab"][col])))
        names.append(CAT_PREFIX + col)
    arrays.append(pa.array(label_values(batch.column(spec.label), spec)))
    names.append(LABEL)
    arrays.append(source_strings(batch).cast(pa.string()))
    names.append(SOURCE)
    return pa.RecordBatch.from_arrays(arrays, names=names)

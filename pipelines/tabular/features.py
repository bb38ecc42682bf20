"""Column-at-a-time feature code shared by the batch ETL and the streaming pipeline.

Everything here takes and returns Arrow record batches and works on whole columns with
pyarrow.compute and numpy: no Python loop over rows, except to describe the (few) rows that
become dead letters.

Labels: ``encode_labels`` is the one function that turns a label column into training targets,
for the batch ETL and the streaming pipeline alike (both reach it through ``featurize_rows``).
A regression target is a float; a classification label of any type (string, boolean, integer)
is the index of its class in the vocabulary of the training split (``stats["classes"]``, stored
in the dataset manifest), or 0/1 with ``positive_above``. A class the training split never saw
cannot be encoded: its row becomes a dead letter, never a silently wrong target.
"""
from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from connectors.dataset_spec import (
    CAT_PREFIX,
    EPOCH_FORMATS,
    LABEL,
    MAX_CLASSES,
    NUM_PREFIX,
    SOURCE,
    VOCAB_SKETCH_FACTOR,
    FeatureSpec,
)
from connectors.deadletter import DeadLetter
from connectors.files import SOURCE_FILE, SOURCE_ROW, parse_numbers


class SchemaError(ValueError):
    """Input files do not have the declared columns or types; raised before any training."""


# ---------------------------------------------------------------------------------------------
# Schema check
# ---------------------------------------------------------------------------------------------
def _kind(t: pa.DataType) -> str:
    if pa.types.is_dictionary(t):
        return _kind(t.value_type)
    if pa.types.is_boolean(t):
        return "boolean"
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t):
        return "number"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
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
        if found == "binary":
            raise SchemaError(f"{where}: column {col!r} is not UTF-8 text; save the file as UTF-8")
        if found not in kinds and found != "null":
            raise SchemaError(f"{where}: column {col!r} has type {schema.field(col).type} ({found}); "
                              f"expected {' or '.join(kinds)}")


def read_types(spec: FeatureSpec) -> dict[str, pa.DataType | None]:
    """The Arrow type each declared input column is read as (files are read with these types,
    so a late odd value rejects its row instead of failing the file)."""
    types: dict[str, pa.DataType | None] = {c: pa.float64() for c in spec.all_numeric}
    types.update({c: pa.string() for c in spec.categorical})
    numeric_label = spec.task == "regression" or spec.positive_above is not None
    types[spec.label] = pa.float64() if numeric_label else None  # class labels keep their type
    if spec.time_column and spec.time_column not in types:
        types[spec.time_column] = None
    return types


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
    """Numbers as float64; text that is not a number becomes NaN (never an exception)."""
    if pa.types.is_dictionary(col.type):
        col = col.cast(col.type.value_type)
    if pa.types.is_boolean(col.type):
        return pc.cast(col, pa.int8()).cast(pa.float64())
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        values, _ = parse_numbers(col)
        return values
    if pa.types.is_null(col.type):
        return pa.nulls(len(col), pa.float64())
    return pc.cast(col, pa.float64(), safe=False)


def _floats(col: pa.Array) -> np.ndarray:
    return _as_float(col).to_numpy(zero_copy_only=False).astype(np.float64, copy=False)


def _is_classes(spec: FeatureSpec) -> bool:
    return spec.task == "classification" and spec.positive_above is None


def row_checks(batch: pa.RecordBatch, spec: FeatureSpec) -> list[tuple[str, np.ndarray]]:
    """(reason, rows that fail) for the checks every tabular dataset gets."""
    label = batch.column(spec.label)
    missing = np.asarray(label.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    checks = [(f"label {spec.label!r} is missing", missing)]
    if _is_classes(spec):
        no_class = np.asarray(label_keys(label).is_null().to_numpy(zero_copy_only=False), dtype=bool)
        checks.append((f"label {spec.label!r} is not a class value (NaN, infinite or empty)", no_class & ~missing))
    else:
        vals = _floats(label)
        checks.append((f"label {spec.label!r} is not a finite number", ~np.isfinite(vals) & ~missing))
    checks += feature_checks(batch, spec)
    if spec.time_column:
        t = time_seconds(batch.column(spec.time_column), spec.time_format)
        checks.append((f"time column {spec.time_column!r} is missing or not a time ({_time_formats(spec.time_format)})",
                       ~np.isfinite(t)))
    return checks


def feature_checks(batch: pa.RecordBatch, spec: FeatureSpec) -> list[tuple[str, np.ndarray]]:
    """(reason, rows that fail) for the feature columns: what a row needs to be predicted (no label, no time)."""
    checks = []
    for col in spec.numeric:
        checks.append((f"numeric feature {col!r} is missing or not a finite number", ~np.isfinite(_floats(batch.column(col)))))
    for col in spec.optional_numeric:
        values = batch.column(col)
        present = np.asarray(values.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
        checks.append((f"optional numeric feature {col!r} is not a finite number",
                       present & ~np.isfinite(_floats(values))))
    return checks


def _letters(batch: pa.RecordBatch, rows: np.ndarray, reasons) -> list[DeadLetter]:
    idx = pa.array(rows)
    payloads = batch.take(idx).to_pylist()
    sources = source_strings(batch).take(idx).to_pylist()
    return [DeadLetter({k: v for k, v in row.items() if not k.startswith("_source")}, src, reason)
            for row, src, reason in zip(payloads, sources, reasons)]


def split_valid(batch: pa.RecordBatch, spec: FeatureSpec, extra_checks: list[tuple[str, np.ndarray]] = (), *,
                features_only: bool = False) -> tuple[pa.RecordBatch, list[DeadLetter]]:
    """Rows the features can use, and a dead letter (first failed check) for each row they cannot.

    ``extra_checks`` (a dataset's own rules, e.g. impossible values) come first, so their more
    specific reasons win over the generic ones. ``features_only``: only the feature columns' checks (rows to
    predict: the label and the time column may be absent).
    """
    checks = list(extra_checks) + (feature_checks(batch, spec) if features_only else row_checks(batch, spec))
    bad = np.zeros(batch.num_rows, dtype=bool)
    code = np.full(batch.num_rows, -1, dtype=np.int32)
    for i, (_, fails) in enumerate(checks):
        code[fails & ~bad] = i
        bad |= fails
    if not bad.any():
        return batch, []
    rows = np.flatnonzero(bad)
    return batch.filter(pa.array(~bad)), _letters(batch, rows, [checks[c][0] for c in code[rows]])


# ---------------------------------------------------------------------------------------------
# Time columns: ISO dates and timestamps, YYYY/MM/DD, epoch numbers, or a strptime format
# ---------------------------------------------------------------------------------------------
_AUTO_FORMATS = ("%Y-%m-%d %H:%M:%S%z", "%Y-%m-%d %H:%M:%S", "%Y-%m-%d %H:%M%z", "%Y-%m-%d %H:%M", "%Y-%m-%d",
                 "%Y/%m/%d %H:%M:%S", "%Y/%m/%d %H:%M", "%Y/%m/%d")


def _time_formats(time_format: str | None) -> str:
    if time_format in EPOCH_FORMATS:
        return f"numbers, {time_format}"
    if time_format:
        return f"format {time_format}"
    return "ISO date or timestamp, YYYY/MM/DD or epoch seconds; set --time-format for others"


def _strptime_seconds(col: pa.Array, fmt: str) -> pa.Array:
    parsed = pc.strptime(col, format=fmt, unit="s", error_is_null=True)
    return pc.divide(pc.cast(pc.cast(parsed, pa.timestamp("s")), pa.int64()), 1.0)


def time_seconds(col: pa.Array, time_format: str | None = None) -> np.ndarray:
    """Time as float seconds since the epoch (UTC unless the value says otherwise); NaN where a
    value is missing or not a time. Timestamps and dates of any unit; numbers are epoch seconds
    (or the unit ``time_format`` names: ``epoch_ms`` ...); text is read with ``time_format`` (a
    strptime format) or, without one, as ISO 8601 (``2013-01-01``, ``2013-01-01T05:00:00Z``,
    ``2013-01-01 05:00:00+02:00``, fractions of a second dropped), ``YYYY/MM/DD [HH:MM[:SS]]``
    or epoch numbers."""
    if pa.types.is_dictionary(col.type):
        col = col.cast(col.type.value_type)
    per_unit = EPOCH_FORMATS.get(time_format or "epoch", None)
    if pa.types.is_date(col.type):
        col = pc.cast(col, pa.timestamp("s"))
    if pa.types.is_timestamp(col.type):
        per_second = {"s": 1.0, "ms": 1e3, "us": 1e6, "ns": 1e9}[col.type.unit]
        return _floats(pc.cast(col, pa.int64())) / per_second
    if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
        return _floats(col) / (per_unit or 1.0)
    text = pc.utf8_trim_whitespace(col)
    if per_unit is not None and time_format:  # declared epoch numbers written as text
        return _floats(text) / per_unit
    if time_format:
        return _floats(_strptime_seconds(text, time_format))
    iso = pc.replace_substring_regex(text, r"^(\d{4}-\d{2}-\d{2})T", r"\1 ")
    iso = pc.replace_substring_regex(iso, r"(\d{2}:\d{2}:\d{2})\.\d+", r"\1")
    iso = pc.replace_substring_regex(iso, r"(?i)Z$", "+0000")
    out = np.full(len(col), np.nan)
    for fmt in _AUTO_FORMATS:
        todo = np.isnan(out)
        if not todo.any():
            break
        # only the rows no earlier format read: a column in the last format is not parsed N times whole
        out[todo] = _floats(_strptime_seconds(iso.filter(pa.array(todo)), fmt))
    todo = np.isnan(out)
    if todo.any():
        numbers = _floats(text)
        out[todo] = numbers[todo]
    return out


def time_cutoff(value: str | float | None, time_format: str | None = None) -> float | None:
    """A cutoff (``--valid-from``/``--test-from``), read the way the time column is: a number, or
    text in ``time_format`` or ISO / ``YYYY/MM/DD``; seconds since the epoch."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value) / EPOCH_FORMATS.get(time_format or "epoch", 1.0)
    if isinstance(value, (dt.datetime, dt.date)):
        value = value.isoformat()
    text = str(value)
    seconds = time_seconds(pa.array([text]), time_format)[0]
    if not np.isfinite(seconds) and time_format and time_format not in EPOCH_FORMATS:
        seconds = time_seconds(pa.array([text]), None)[0]  # an ISO cutoff for a custom-format column
    if not np.isfinite(seconds):
        raise ValueError(f"cutoff {text!r} is not a time ({_time_formats(time_format)})")
    return float(seconds)


def format_time(seconds: float) -> str:
    """Seconds since the epoch as ISO 8601 (UTC), for messages."""
    try:
        return dt.datetime.fromtimestamp(float(seconds), dt.timezone.utc).isoformat().replace("+00:00", "Z")
    except (OverflowError, OSError, ValueError):
        return f"{seconds:g}"


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


def assign_splits(batch: pa.RecordBatch, spec: FeatureSpec, cutoffs: tuple[float, float] | None = None,
                  row_ids: np.ndarray | None = None) -> np.ndarray:
    """Split code per row: 0 train, 1 valid, 2 test.

    By time: ``t < valid_from`` train, ``valid_from <= t < test_from`` valid, the rest test,
    so no row of the test period reaches training. At random: a hash of the row's source and
    the seed, so a row always lands in the same split whatever the bundling.
    """
    if spec.time_column:
        assert cutoffs is not None, "time splits need cutoffs"
        t = time_seconds(batch.column(spec.time_column), spec.time_format)
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
# Labels: one function for the batch ETL and the streaming pipeline
# ---------------------------------------------------------------------------------------------
def _float_keys(values: pa.Array) -> pa.Array:
    """Canonical text of numbers: integral values without a fraction (``1.0`` -> ``"1"``)."""
    v = values.to_numpy(zero_copy_only=False).astype(np.float64, copy=False)
    finite = np.isfinite(v)
    integral = finite & (np.floor(np.where(finite, v, 0.0)) == np.where(finite, v, 0.0)) & (np.abs(v) < 2.0**53)
    as_int = pc.cast(pa.array(np.where(integral, v, 0.0).astype(np.int64)), pa.string())
    as_float = pc.cast(pa.array(np.where(finite, v, 0.0)), pa.string())
    keys = pc.if_else(pa.array(integral), as_int, as_float)
    return pc.if_else(pa.array(finite), keys, pa.scalar(None, pa.string()))


def label_keys(col: pa.Array) -> pa.Array:
    """A class label of any type as canonical text, the key of the class vocabulary: booleans
    ``"false"``/``"true"`` (also written as text, any case), numbers without a needless fraction
    (``1``, ``1.0`` and ``"1"`` are one class), other text trimmed. Null where there is no class
    (missing, empty, NaN)."""
    t = col.type
    if pa.types.is_dictionary(t):
        col, t = col.cast(t.value_type), t.value_type
    if pa.types.is_null(t):
        return pa.nulls(len(col), pa.string())
    if pa.types.is_boolean(t):
        return pc.cast(col, pa.string())
    if pa.types.is_integer(t):
        return pc.cast(col, pa.string())
    if pa.types.is_floating(t) or pa.types.is_decimal(t):
        keys = _float_keys(pc.cast(col, pa.float64()))
        return pc.if_else(col.is_valid(), keys, pa.scalar(None, pa.string()))
    text = pc.utf8_trim_whitespace(pc.cast(col, pa.string()))
    lower = pc.utf8_lower(text)
    is_bool = pc.is_in(lower, value_set=pa.array(["true", "false"]))
    numbers, not_number = parse_numbers(text)
    is_number = pc.and_(pc.is_valid(numbers), pa.array(~not_number))
    keys = pc.if_else(is_number, _float_keys(numbers), pc.if_else(is_bool, lower, text))
    return pc.if_else(pc.equal(text, ""), pa.scalar(None, pa.string()), keys)


def sort_classes(keys) -> list[str]:
    """Numbers by value (``2`` before ``10``), anything else as text."""
    keys = list(keys)
    try:
        return sorted(keys, key=float)
    except ValueError:
        return sorted(keys)


def encode_labels(col: pa.Array, spec: FeatureSpec, stats: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The label column as float32 training targets, and which rows have one.

    Regression: the value. Classification with ``positive_above``: 1.0 above it, else 0.0.
    Classification: the index of the row's class in ``stats["classes"]`` (the training split's
    vocabulary), so 0/1 for two classes; a class not in it has no target (``known`` False).
    """
    if spec.task == "regression" or spec.positive_above is not None:
        values = _floats(col)
        known = np.isfinite(values)
        if spec.task == "regression":
            return values.astype(np.float32), known
        return (values > spec.positive_above).astype(np.float32), known
    classes = (stats or {}).get("classes")
    if classes is None:
        raise ValueError(f"label {spec.label!r}: the statistics hold no class vocabulary; re-run the ETL that "
                         f"wrote this dataset (its manifest predates class labels)")
    idx = pc.index_in(label_keys(col), value_set=pa.array(classes, type=pa.string()))
    known = np.asarray(idx.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
    return pc.fill_null(idx, 0).to_numpy(zero_copy_only=False).astype(np.float32), known


# ---------------------------------------------------------------------------------------------
# Full-pass statistics over the training split
# ---------------------------------------------------------------------------------------------
@dataclass
class StatsAccumulator:
    """Sums for mean/std and value counts for vocabularies; mergeable (a Beam CombineFn's state).

    Memory is bounded whatever the data: a categorical column's counter keeps at most
    ``2 * VOCAB_SKETCH_FACTOR * max_vocab`` values; past that it becomes a Misra-Gries heavy-hitters
    summary (the smallest counts are subtracted away: ``pruned`` records by how much, the largest
    possible undercount; 0 means the vocabulary is exact). A classification label stops the ETL as
    soon as it has more than ``MAX_CLASSES`` distinct values (a ``SchemaError`` naming the label and
    the fix), instead of holding millions of them.
    """

    count: dict[str, int] = field(default_factory=dict)
    total: dict[str, float] = field(default_factory=dict)
    total_sq: dict[str, float] = field(default_factory=dict)
    values: dict[str, dict] = field(default_factory=dict)
    label_values: dict = field(default_factory=dict)
    label_counts: dict[str, int] = field(default_factory=dict)  # classes: canonical key -> rows
    label_sum: float = 0.0
    label_sq: float = 0.0
    rows: int = 0
    capacity: int = 0  # values a categorical counter keeps (VOCAB_SKETCH_FACTOR * max_vocab); 0: not yet known
    pruned: dict[str, int] = field(default_factory=dict)  # column -> the largest undercount of its counter
    label_name: str = ""

    def _bound(self) -> None:
        """Shrink any counter past twice its capacity (Misra-Gries), and stop at too many classes."""
        if self.capacity:
            for col, counts in self.values.items():
                if len(counts) > 2 * self.capacity:
                    cut = sorted(counts.values(), reverse=True)[self.capacity]  # the (capacity+1)-th largest
                    self.values[col] = {k: n - cut for k, n in counts.items() if n > cut}
                    self.pruned[col] = self.pruned.get(col, 0) + cut
        if len(self.label_counts) > MAX_CLASSES:
            raise SchemaError(
                f"label column {self.label_name!r} has more than {MAX_CLASSES:,} distinct values in the training "
                f"split (the ETL stopped at the first {len(self.label_counts):,}): it looks like a numeric target or "
                f"an id, not classes; pass --task regression, or --positive-above T for a binary target")

    def add(self, batch: pa.RecordBatch, spec: FeatureSpec) -> StatsAccumulator:
        self.rows += batch.num_rows
        self.capacity = max(self.capacity, VOCAB_SKETCH_FACTOR * spec.max_vocab)
        self.label_name = spec.label
        for col in spec.all_numeric:
            vals = _floats(batch.column(col))
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
        if _is_classes(spec):
            vc = pc.value_counts(label_keys(batch.column(spec.label)))
            for value, n in zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist()):
                if value is not None:
                    self.label_counts[value] = self.label_counts.get(value, 0) + n
            self._bound()
            return self
        self._bound()
        labels = encode_labels(batch.column(spec.label), spec)[0].astype(np.float64)
        self.label_sum += float(labels.sum())
        self.label_sq += float(np.square(labels).sum())
        if spec.task == "classification":
            for v, n in zip(*np.unique(labels, return_counts=True)):
                self.label_values[float(v)] = self.label_values.get(float(v), 0) + int(n)
        else:
            for v in np.unique(labels)[:3]:
                self.label_values[float(v)] = self.label_values.get(float(v), 0) + 1
        return self

    def merge(self, other: StatsAccumulator) -> StatsAccumulator:
        self.rows += other.rows
        self.capacity = max(self.capacity, other.capacity)
        self.label_name = self.label_name or other.label_name
        for col, n in other.pruned.items():
            self.pruned[col] = self.pruned.get(col, 0) + n
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
        for k, v in other.label_counts.items():
            self.label_counts[k] = self.label_counts.get(k, 0) + v
        self._bound()
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
        out = {"numeric": numeric, "vocab": vocab, "train_rows": self.rows,
               # per column, the largest undercount of a value's training count (0: exact counts)
               "vocab_count_error": {col: int(self.pruned.get(col, 0)) for col in spec.categorical}}
        if _is_classes(spec):
            classes = sort_classes(self.label_counts)
            counts = [self.label_counts[c] for c in classes]
            index_sum = float(sum(i * n for i, n in enumerate(counts)))
            mean = index_sum / self.rows if self.rows else 0.0
            var = float(sum(i * i * n for i, n in enumerate(counts))) / self.rows - mean ** 2 if self.rows else 0.0
            return {**out, "classes": classes, "class_counts": counts, "label_mean": mean,
                    "label_std": math.sqrt(max(var, 0.0)) or 1.0,
                    "label_values": [float(i) for i in range(len(classes))]}
        label_mean = self.label_sum / self.rows if self.rows else 0.0
        label_var = self.label_sq / self.rows - label_mean ** 2 if self.rows else 0.0
        out.update({"label_mean": label_mean, "label_std": math.sqrt(max(label_var, 0.0)) or 1.0,
                    "label_values": sorted(self.label_values)})
        if spec.task == "classification":  # positive_above: two classes, 0 and 1
            out["class_counts"] = [int(self.label_values.get(0.0, 0)), int(self.label_values.get(1.0, 0))]
        return out


# ---------------------------------------------------------------------------------------------
# Featurizing with the statistics
# ---------------------------------------------------------------------------------------------
def _codes(col: pa.Array, vocab: list) -> np.ndarray:
    idx = pc.index_in(pc.cast(col, pa.string()), value_set=pa.array(vocab, type=pa.string()))
    return (pc.fill_null(idx, -1).to_numpy(zero_copy_only=False) + 1).astype(np.int32)


def featurize_rows(batch: pa.RecordBatch, spec: FeatureSpec, stats: dict
                   ) -> tuple[pa.RecordBatch, list[DeadLetter]]:
    """Valid input rows -> (model features, dead letters): standardized numerics, category codes,
    the label's target (``encode_labels``) and the source; a row whose label has no target (a
    class the training split never saw) is a dead letter instead."""
    targets, known = encode_labels(batch.column(spec.label), spec, stats)
    letters: list[DeadLetter] = []
    if not known.all():
        rows = np.flatnonzero(~known)
        letters = _letters(batch, rows, [f"label {spec.label!r} holds a class not seen in the training split"]
                           * len(rows))
        batch, targets = batch.filter(pa.array(known)), targets[known]
    arrays, names = feature_arrays(batch, spec, stats)
    arrays.append(pa.array(targets, type=pa.float32()))
    names.append(LABEL)
    arrays.append(source_strings(batch).cast(pa.string()))
    names.append(SOURCE)
    return pa.RecordBatch.from_arrays(arrays, names=names), letters


def feature_arrays(batch: pa.RecordBatch, spec: FeatureSpec, stats: dict) -> tuple[list[pa.Array], list[str]]:
    """The model's inputs of valid rows: standardized numerics (``num__<col>``, float32; a missing optional
    numeric is the mean, 0) and category codes (``cat__<col>``, int32; 0 for a category the training split
    never saw: the out-of-vocabulary bucket)."""
    arrays, names = [], []
    for col in spec.all_numeric:
        s = stats["numeric"][col]
        z = (_floats(batch.column(col)) - s["mean"]) / s["std"]
        arrays.append(pa.array(np.nan_to_num(z, nan=0.0, posinf=0.0, neginf=0.0).astype(np.float32)))
        names.append(NUM_PREFIX + col)
    for col in spec.categorical:
        arrays.append(pa.array(_codes(batch.column(col), stats["vocab"][col])))
        names.append(CAT_PREFIX + col)
    return arrays, names


def featurize(batch: pa.RecordBatch, spec: FeatureSpec, stats: dict) -> pa.RecordBatch:
    """``featurize_rows`` for rows that all have a target; any that does not is an error (use
    ``featurize_rows`` to get such rows as dead letters)."""
    features, letters = featurize_rows(batch, spec, stats)
    if letters:
        raise ValueError(f"{len(letters)} row(s) cannot be featurized, e.g. {letters[0].source}: {letters[0].reason}")
    return features

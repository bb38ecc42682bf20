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

Numeric ranges: ``range_checks`` is the one check of a numeric value's size, for the batch ETL, the
streaming pipeline and predict alike. A column's range is declared (``FeatureSpec.numeric_range``,
``--numeric-range col=LO:HI``; checked when rows are validated, before any statistics) or derived
from the training statistics: a magnitude below ``2**RANGE_MARGIN_BITS`` times the 99th percentile
of the column's nonzero magnitudes in the training split, rounded up to a power of two
(``stats["numeric"][col]["max_abs"]``). The statistics count magnitudes by power of two, so the
mean and std leave out exactly the training rows beyond that bound (which the ETL's featurize step
then sends to the dead letters): one absurd value (1e30) neither trains nor skews the
standardization. With ``FeatureSpec.clip_numeric`` (``--clip-outliers``) such values are clipped to
the range instead of rejecting their row.

A regression label is bounded the same way (``label_range_check``): its statistics count its magnitudes by
power of two, ``stats["label_max_abs"]`` is its bound, ``label_mean``/``label_std`` leave out the training
rows beyond it (``stats["label_outside"]``: how many), and featurizing sends a row whose label is beyond it
to the dead letters with the reason, in the batch ETL and the stream alike. A label is never clipped (that
would train on a target the data does not hold), ``--clip-outliers`` or not.
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
    ID_PREFIX,
    LABEL,
    MAX_CLASSES,
    NUM_PREFIX,
    SOURCE,
    VOCAB_SKETCH_FACTOR,
    FeatureSpec,
)
from connectors.id_keys import BAD_KEYS, keys_of
from connectors.rows import SOURCE_FILE, SOURCE_ROW, DeadLetter, parse_numbers

#: A numeric column without a declared range accepts magnitudes below 2**RANGE_MARGIN_BITS (about a million)
#: times the RANGE_QUANTILE quantile of its nonzero magnitudes in the training split, rounded up to a power of 2.
RANGE_MARGIN_BITS = 20
RANGE_QUANTILE = 0.99
_ZERO = -2000  # the magnitude bucket of exact zeros (np.frexp's exponents are >= -1073)


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
    wanted.update({c: ("string", "number") for c in spec.id_columns})
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
    types.update({c: pa.string() for c in spec.id_columns})  # 42 and "42" are the same ID
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


def row_checks(batch: pa.RecordBatch, spec: FeatureSpec, stats: dict | None = None) -> list[tuple[str, np.ndarray]]:
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
    checks += feature_checks(batch, spec, stats)
    if spec.time_column:
        t = time_seconds(batch.column(spec.time_column), spec.time_format)
        checks.append((f"time column {spec.time_column!r} is missing or not a time ({_time_formats(spec.time_format)})",
                       ~np.isfinite(t)))
    return checks


def feature_checks(batch: pa.RecordBatch, spec: FeatureSpec, stats: dict | None = None
                   ) -> list[tuple[str, np.ndarray]]:
    """(reason, rows that fail) for the feature columns: what a row needs to be predicted (no label, no time);
    with ``stats``, the ranges derived from them too (``range_checks``)."""
    checks = []
    for col in spec.numeric:
        checks.append((f"numeric feature {col!r} is missing or not a finite number", ~np.isfinite(_floats(batch.column(col)))))
    for col in spec.optional_numeric:
        values = batch.column(col)
        present = np.asarray(values.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
        checks.append((f"optional numeric feature {col!r} is not a finite number",
                       present & ~np.isfinite(_floats(values))))
    for col in spec.required_ids:  # an ID the spec requires: no key is a dead letter, not the fallback vector
        keys = keys_of(batch.column(col).to_pylist(), spec.max_id_bytes)
        for kind, key in BAD_KEYS.items():
            checks.append((f"required ID {col!r} is {kind.replace('_', ' ')}"
                           f"{f' (over {spec.max_id_bytes} bytes)' if kind == 'too_long' else ''}; it has no key "
                           f"(--required-ids)", keys == key))
    return checks + range_checks(batch, spec, stats)


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
        v = _floats(batch.column(col))
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
    v = _floats(batch.column(spec.label))
    with np.errstate(invalid="ignore"):
        fails = (np.abs(v) >= float(bound)) & np.isfinite(v)
    return (f"label {spec.label!r} is out of range: a magnitude of {float(bound):.4g} or more, over "
            f"2^{RANGE_MARGIN_BITS} times the training split's usual size (fix or drop such rows upstream)", fails)


def _clipped(values: np.ndarray, col: str, spec: FeatureSpec, stats: dict | None) -> np.ndarray:
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


def _letters(batch: pa.RecordBatch, rows: np.ndarray, reasons) -> list[DeadLetter]:
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


def order_classes(keys, spec: FeatureSpec) -> list[str]:
    """The class vocabulary (index = target): ``sort_classes``; with ``spec.positive_class`` (two classes
    only) that class second, so it is the positive one. A positive class the training split does not
    hold, or a label with other than two classes, is a ``SchemaError``."""
    classes = sort_classes(keys)
    if spec.positive_class is None:
        return classes
    positive = label_keys(pa.array([spec.positive_class])).to_pylist()[0]
    shown = ", ".join(repr(c) for c in classes[:20]) + (", ..." if len(classes) > 20 else "")
    if positive not in classes:
        raise SchemaError(f"--positive-class {spec.positive_class!r} is not a class of label {spec.label!r} in the "
                          f"training split; its classes are {shown}")
    if len(classes) != 2:
        raise SchemaError(f"--positive-class is for a label with two classes; label {spec.label!r} has "
                          f"{len(classes)} in the training split ({shown}): leave it out for a multi-class model")
    return [c for c in classes if c != positive] + [positive]


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

    #: numeric column -> {power of two of |value| (np.frexp's exponent; _ZERO for 0): [rows, sum, sum of squares]}
    magnitudes: dict[str, dict[int, list[float]]] = field(default_factory=dict)
    #: a regression label's magnitudes, as ``magnitudes``' (its mean, std and bound come from them)
    label_magnitudes: dict[int, list[float]] = field(default_factory=dict)
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
            if spec.clip_numeric and col in spec.numeric_range:
                vals = np.clip(vals, *spec.numeric_range[col])
            _add_magnitudes(self.magnitudes.setdefault(col, {}), vals)
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
        if spec.task == "regression":
            values = _floats(batch.column(spec.label))  # float64: a float32 target would round (or overflow)
            values = values[np.isfinite(values)]
            _add_magnitudes(self.label_magnitudes, values)
            for v in np.unique(values)[:3]:
                self.label_values[float(v)] = self.label_values.get(float(v), 0) + 1
            return self
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
        for mine, buckets in [(self.magnitudes.setdefault(col, {}), b) for col, b in other.magnitudes.items()] + [
                (self.label_magnitudes, other.label_magnitudes)]:
            for e, (n, total, sq) in buckets.items():
                acc = mine.setdefault(e, [0, 0.0, 0.0])
                acc[0] += n
                acc[1] += total
                acc[2] += sq
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
        numeric = {col: _numeric_stats(self.magnitudes.get(col, {}), col in spec.numeric_range)
                   for col in spec.all_numeric}
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
            classes = order_classes(self.label_counts, spec)  # with two, the positive class second
            counts = [self.label_counts[c] for c in classes]
            index_sum = float(sum(i * n for i, n in enumerate(counts)))
            mean = index_sum / self.rows if self.rows else 0.0
            var = float(sum(i * i * n for i, n in enumerate(counts))) / self.rows - mean ** 2 if self.rows else 0.0
            return {**out, "classes": classes, "class_counts": counts, "label_mean": mean,
                    "label_std": math.sqrt(max(var, 0.0)) or 1.0,
                    "label_values": [float(i) for i in range(len(classes))],
                    **({"positive_class": classes[1]} if len(classes) == 2 else {})}
        if spec.task == "regression":  # bounded as a numeric feature is: one 1e30 does not skew mean and std
            label = _numeric_stats(self.label_magnitudes, False)
            out.update({"label_mean": label["mean"], "label_std": label["std"], "label_values": sorted(self.label_values)})
            if "max_abs" in label:
                out.update({"label_max_abs": label["max_abs"], "label_outside": label["outside"]})
            return out
        label_mean = self.label_sum / self.rows if self.rows else 0.0
        label_var = self.label_sq / self.rows - label_mean ** 2 if self.rows else 0.0
        out.update({"label_mean": label_mean, "label_std": math.sqrt(max(label_var, 0.0)) or 1.0,
                    "label_values": sorted(self.label_values)})
        if spec.task == "classification":  # positive_above: two classes, 0 and 1
            out["class_counts"] = [int(self.label_values.get(0.0, 0)), int(self.label_values.get(1.0, 0))]
            out["positive_class"] = "1"  # label > positive_above
        return out


def _add_magnitudes(buckets: dict[int, list[float]], vals: np.ndarray) -> None:
    """Count finite ``vals`` into ``buckets`` by the power of two of their magnitude."""
    if not vals.size:
        return
    exps = np.frexp(vals)[1].astype(np.int64)
    exps[vals == 0] = _ZERO
    keys, which = np.unique(exps, return_inverse=True)
    with np.errstate(over="ignore"):
        n = np.bincount(which, minlength=keys.size)
        total = np.bincount(which, weights=vals, minlength=keys.size)
        sq = np.bincount(which, weights=vals * vals, minlength=keys.size)
    for k, a, b, c in zip(keys.tolist(), n.tolist(), total.tolist(), sq.tolist()):
        acc = buckets.setdefault(k, [0, 0.0, 0.0])
        acc[0] += a
        acc[1] += b
        acc[2] += c


def _numeric_stats(buckets: dict[int, list[float]], declared: bool) -> dict:
    """mean, std and count of a numeric column, and (without a declared range) ``max_abs``: the bound of the
    magnitudes it accepts (None when the column has no nonzero value); rows at or past it are left out of the
    mean and std (``outside``: how many)."""
    bound_exp = None
    nonzero = sorted(e for e in buckets if e != _ZERO)
    if not declared and nonzero:
        cumulative = np.cumsum([buckets[e][0] for e in nonzero])
        typical = nonzero[int(np.searchsorted(cumulative, RANGE_QUANTILE * cumulative[-1]))]
        bound_exp = typical + RANGE_MARGIN_BITS if typical + RANGE_MARGIN_BITS < 1024 else None
    kept = [acc for e, acc in buckets.items() if bound_exp is None or e <= bound_exp]
    n = int(sum(acc[0] for acc in kept))
    mean = sum(acc[1] for acc in kept) / n if n else 0.0
    var = max(sum(acc[2] for acc in kept) / n - mean * mean, 0.0) if n else 0.0
    std = math.sqrt(var) if math.isfinite(var) else 1.0
    out = {"mean": mean, "std": std if std > 1e-12 else 1.0, "count": n}
    if bound_exp is not None:
        out["max_abs"] = math.ldexp(1.0, bound_exp)
        out["outside"] = int(sum(acc[0] for e, acc in buckets.items() if e > bound_exp))
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
    class the training split never saw), with a numeric value outside the range its statistics
    allow (``range_checks``), or with a regression label past its bound (``label_range_check``), is a
    dead letter instead."""
    targets, known = encode_labels(batch.column(spec.label), spec, stats)
    letters: list[DeadLetter] = []
    ok = known.copy()
    reasons = np.full(batch.num_rows, f"label {spec.label!r} holds a class not seen in the training split",
                      dtype=object)
    label_check = label_range_check(batch, spec, stats)
    for reason, fails in range_checks(batch, spec, stats) + ([label_check] if label_check else []):
        reasons[fails & ok] = reason
        ok &= ~fails
    if not ok.all():
        rows = np.flatnonzero(~ok)
        letters = _letters(batch, rows, reasons[rows].tolist())
        batch, targets = batch.filter(pa.array(ok)), targets[ok]
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
        z = (_clipped(_floats(batch.column(col)), col, spec, stats) - s["mean"]) / s["std"]
        arrays.append(pa.array(np.nan_to_num(z, nan=0.0, posinf=0.0, neginf=0.0).astype(np.float32)))
        names.append(NUM_PREFIX + col)
    for col in spec.categorical:
        arrays.append(pa.array(_codes(batch.column(col), stats["vocab"][col])))
        names.append(CAT_PREFIX + col)
    for col in spec.id_columns:  # ID keys (int64), never a vocabulary index: the model's ID tables map them to rows
        # the values as given (files read them as text): a boolean, a fractional number or a nested value is of
        # the wrong type, and gets that reason's reserved key (connectors.id_keys), as missing/empty/too long ones do
        arrays.append(pa.array(keys_of(batch.column(col).to_pylist(), spec.max_id_bytes), type=pa.int64()))
        names.append(ID_PREFIX + col)
    return arrays, names


def featurize(batch: pa.RecordBatch, spec: FeatureSpec, stats: dict) -> pa.RecordBatch:
    """``featurize_rows`` for rows that all have a target; any that does not is an error (use
    ``featurize_rows`` to get such rows as dead letters)."""
    features, letters = featurize_rows(batch, spec, stats)
    if letters:
        raise ValueError(f"{len(letters)} row(s) cannot be featurized, e.g. {letters[0].source}: {letters[0].reason}")
    return features

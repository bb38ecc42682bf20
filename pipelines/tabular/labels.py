"""Labels: one function for the batch ETL and the streaming pipeline.

``encode_labels`` is the one function that turns a label column into training targets, for the
batch ETL and the streaming pipeline alike (both reach it through ``features.featurize_rows``).
A regression target is a float; a classification label of any type (string, boolean, integer)
is the index of its class in the vocabulary of the training split (``stats["classes"]``, stored
in the dataset manifest), or 0/1 with ``positive_above``. A class the training split never saw
cannot be encoded: its row becomes a dead letter, never a silently wrong target.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from connectors.dataset_spec import FeatureSpec
from connectors.rows import parse_numbers
from pipelines.tabular.columns import floats
from pipelines.tabular.schema import SchemaError


def is_classes(spec: FeatureSpec) -> bool:
    """True when the label is classes (a vocabulary), not a number or a number with ``positive_above``."""
    return spec.task == "classification" and spec.positive_above is None


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
        values = floats(col)
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

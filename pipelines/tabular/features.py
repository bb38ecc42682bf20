"""Featurizing with the training statistics: valid rows -> the model's inputs and targets (standardized
numerics, category codes, ID keys, the label's target), for the batch ETL and the streaming pipeline alike.

Everything in ``pipelines.tabular`` takes and returns Arrow record batches and works on whole columns with
pyarrow.compute and numpy: no Python loop over rows, except to describe the (few) rows that become dead
letters. Its modules, bottom up: ``schema`` (declared columns and types) and ``columns`` (numbers, row
sources); ``times`` (time columns); ``labels`` (``encode_labels``, the one label encoder), ``ranges`` (the one
check of a numeric value's size) and ``splits`` (train/valid/test); ``checks`` (validation: dead letters);
``stats`` (``StatsAccumulator``: the full pass over the training split); this module; ``preflight`` (the
input files, before a run) and ``pipeline`` (the ETL as Beam transforms).
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from connectors.dataset_spec import CAT_PREFIX, ID_PREFIX, LABEL, NUM_PREFIX, SOURCE, WEIGHT, FeatureSpec
from connectors.id_keys import keys_of
from connectors.rows import DeadLetter
from pipelines.tabular.checks import dead_letters
from pipelines.tabular.columns import floats, source_strings
from pipelines.tabular.labels import encode_labels
from pipelines.tabular.ranges import clip_to_range, label_range_check, range_checks


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
        letters = dead_letters(batch, rows, reasons[rows].tolist())
        batch, targets = batch.filter(pa.array(ok)), targets[ok]
    arrays, names = feature_arrays(batch, spec, stats)
    arrays.append(pa.array(targets, type=pa.float32()))
    names.append(LABEL)
    if spec.weight_column:  # the sample weight as given (validated: finite, >= 0); never a feature
        arrays.append(pa.array(floats(batch.column(spec.weight_column)).astype(np.float32), type=pa.float32()))
        names.append(WEIGHT)
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
        z = (clip_to_range(floats(batch.column(col)), col, spec, stats) - s["mean"]) / s["std"]
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

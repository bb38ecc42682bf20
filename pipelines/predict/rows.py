"""Rows to predict -> model inputs -> prediction columns: the one code path of ``flowtrain predict`` (in Beam)
and of a loaded bundle's ``predict(table)`` (in process), so both give the same numbers.

- ``featurize_for_prediction``: the batch ETL's own feature code (``feature_checks``, ``feature_arrays``) with
  the training statistics; the label and the time column may be absent; a category never seen in training
  takes the out-of-vocabulary code 0; a row whose features fail a check is a dead letter with its reason.
- the forward is the stream scorer's model handler's (``pipelines.serving.handler.FlowtrainModelHandler``):
  probabilities (binary: P(second class); K classes: softmax) or values in the label's units (regression).
- ``prediction_columns``: those outputs as named Arrow columns.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import pyarrow as pa

from connectors.dataset_spec import FeatureSpec
from connectors.deadletter import DeadLetter
from connectors.files import SOURCE_FILE, SOURCE_ROW
from pipelines.tabular.features import SchemaError, feature_arrays, source_strings, split_valid

#: Columns every prediction output has (besides --id-column / --keep-columns, and the label when present).
SOURCE_COLUMN = "source"
VERSION_COLUMN = "model_version"


class PredictionInput(NamedTuple):
    """One Arrow batch of rows to predict: the model's inputs and the columns copied to the output."""

    features: pa.RecordBatch  # num__* float32, cat__* int32
    carry: pa.RecordBatch  # source, then the id / keep / label columns as read


def required_columns(spec: FeatureSpec) -> list[str]:
    """The input columns a prediction needs: the features (the label and time column are optional)."""
    return [*spec.all_numeric, *spec.categorical]


def check_columns(names: Sequence[str], spec: FeatureSpec, where: str, extra: Sequence[str] = ()) -> None:
    """Columns the model (or ``--id-column`` / ``--keep-columns``) needs and ``where`` lacks: one error naming
    them (extra columns are ignored)."""
    have = set(names)
    missing = [c for c in required_columns(spec) if c not in have]
    if missing:
        raise SchemaError(f"{where}: missing column(s) {', '.join(missing)} the model needs (its feature spec); "
                          f"the file has {', '.join(names)}")
    absent = [c for c in extra if c not in have]
    if absent:
        raise SchemaError(f"{where}: no column {', '.join(absent)} (--id-column / --keep-columns); the file has "
                          f"{', '.join(names)}")


def read_types(spec: FeatureSpec) -> dict[str, pa.DataType | None]:
    """The types the feature columns are read as (as the ETL reads them)."""
    types: dict[str, pa.DataType | None] = {c: pa.float64() for c in spec.all_numeric}
    types.update({c: pa.string() for c in spec.categorical})
    return types


def with_sources(batch: pa.RecordBatch) -> pa.RecordBatch:
    """``batch`` with the reader's source columns, numbering rows from 1 when it has none (in-process input)."""
    if SOURCE_FILE in batch.schema.names:
        return batch
    n = batch.num_rows
    return pa.RecordBatch.from_arrays([*batch.columns, pa.array(["row"] * n), pa.array(np.arange(1, n + 1))],
                                      names=[*batch.schema.names, SOURCE_FILE, SOURCE_ROW])


def featurize_for_prediction(batch: pa.RecordBatch, spec: FeatureSpec, stats: dict,
                             carry: Sequence[str] = ()) -> tuple[PredictionInput | None, list[DeadLetter]]:
    """Rows of ``batch`` (raw columns, with the reader's source columns) -> the model's inputs of the valid ones
    and the columns ``carry`` copied through; a dead letter for each row a feature check rejects."""
    batch = with_sources(batch)
    valid, letters = split_valid(batch, spec, features_only=True)
    if valid.num_rows == 0:
        return None, letters
    arrays, names = feature_arrays(valid, spec, stats)
    carried = [source_strings(valid).cast(pa.string())] + [valid.column(c) for c in carry]
    return (PredictionInput(pa.RecordBatch.from_arrays(arrays, names=names),
                            pa.RecordBatch.from_arrays(carried, names=[SOURCE_COLUMN, *carry])), letters)


def prediction_columns(scores: np.ndarray, kind: str, classes: Sequence[str] | None) -> tuple[list[pa.Array],
                                                                                              list[str]]:
    """``probability`` and ``class`` (binary), ``probability_<class>`` per class and ``class`` (K classes), or
    ``prediction`` (regression)."""
    if kind == "regression":
        return [pa.array(scores, pa.float64())], ["prediction"]
    names = list(classes or ["0", "1"])
    if kind == "binary":
        picked = np.where(scores >= 0.5, 1, 0)
        return ([pa.array(scores, pa.float64()), pa.array(np.asarray(names, dtype=object)[picked], pa.string())],
                ["probability", "class"])
    picked = scores.argmax(axis=1) if len(scores) else np.zeros(0, dtype=np.int64)
    arrays = [pa.array(scores[:, i], pa.float64()) for i in range(len(names))]
    return ([*arrays, pa.array(np.asarray(names, dtype=object)[picked], pa.string())],
            [*(f"probability_{c}" for c in names), "class"])


def output_batch(inp: PredictionInput, scores: np.ndarray, kind: str, classes: Sequence[str] | None,
                 version: str) -> pa.RecordBatch:
    """The carried columns, the prediction columns and the model version of one predicted batch."""
    arrays, names = prediction_columns(scores, kind, classes)
    n = inp.carry.num_rows
    return pa.RecordBatch.from_arrays([*inp.carry.columns, *arrays, pa.array([version] * n, pa.string())],
                                      names=[*inp.carry.schema.names, *names, VERSION_COLUMN])

"""Rows to predict -> model inputs -> prediction columns: the one code path of ``flowtrain predict`` (in Beam)
and of a loaded bundle's ``predict(table)`` (in process), so both give the same numbers.

- ``featurize_for_prediction``: the batch ETL's own feature code (``feature_checks``, ``feature_arrays``) with
  the training statistics; the label and the time column may be absent; a category never seen in training
  takes the out-of-vocabulary code 0; a row whose features fail a check is a dead letter with its reason.
- the forward is ``pipelines.serving.forward.forward``, which the stream scorer's model handler
  (``pipelines.serving.handler.FlowtrainModelHandler``, run by ``flowtrain predict``) calls too: probabilities
  (binary: P(the positive class, the second of the two); K classes: softmax) or values in the label's units.
  This module imports no Beam (a loaded bundle predicts without it).
- ``prediction_columns``: those outputs as named Arrow columns, named by ``output_names``.

Output column names (one scheme for ``flowtrain predict`` and ``load(...).predict``): the input columns copied
through (``--id-column``, ``--keep-columns``, the label) keep their names; every column flowtrain adds starts
with ``pred_``: ``pred_source``, ``pred_probability_<class>`` (binary: the positive class's only; K classes:
one per class), ``pred_class``, ``pred_value`` (regression), ``pred_model_version``, ``pred_reason`` (in
process: why a row has no prediction), ``pred_unseen`` (``--flag-unseen``). Where an input column already has
such a name, flowtrain's column takes the first free ``_1``, ``_2``... suffix (the summary lists the renames),
so no output name is ever taken twice.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from connectors.dataset_spec import CAT_PREFIX, SOURCE, FeatureSpec
from connectors.rows import SOURCE_FILE, SOURCE_ROW, DeadLetter
from pipelines.tabular.checks import split_valid
from pipelines.tabular.features import feature_arrays
from pipelines.tabular.schema import SchemaError

#: The prefix of every column flowtrain adds to a prediction output.
PREFIX = "pred_"
#: Where an input row came from (``file:line``, ``file:row``; in process ``row:<n>``), as a column of the inputs
#: that cannot be an input column's name (a user's own ``source`` column stays theirs).
_USER_SOURCE = "\x00source"


@dataclass(frozen=True)
class OutputNames:
    """The names of the columns flowtrain adds to one prediction output (given the input columns it carries)."""

    source: str
    probabilities: tuple[str, ...]  # binary: (P(positive class),); K classes: one per class; regression: ()
    klass: str | None  # the predicted class's name (classification)
    value: str | None  # the predicted value, in the label's units (regression)
    version: str
    reason: str
    unseen: str
    renamed: dict[str, str] = field(default_factory=dict)  # wanted name -> name given, where an input had it
    more: dict[str, str] = field(default_factory=dict)  # ``output_names(more=...)``: each wanted name -> its name

    @property
    def predictions(self) -> list[str]:
        """The prediction columns, in output order."""
        return [*self.probabilities, *([self.klass] if self.klass else []), *([self.value] if self.value else [])]


def positive_class(classes: Sequence[str] | None) -> str:
    """The class whose probability a binary model predicts: the second of the bundle's two classes."""
    return str(list(classes or ["0", "1"])[1])


def output_names(carried: Sequence[str], kind: str, classes: Sequence[str] | None,
                 more: Sequence[str] = ()) -> OutputNames:
    """The ``pred_*`` names of the columns flowtrain adds, none equal to a ``carried`` input column (a taken name
    gets the first free ``_1``, ``_2``... suffix) nor to each other; ``more``: further ``pred_<what>`` columns (the
    stream scorer's), in ``OutputNames.more``."""
    taken = set(carried)
    renamed: dict[str, str] = {}

    def free(what: str) -> str:
        want = name = PREFIX + what
        n = 0
        while name in taken:
            n += 1
            name = f"{want}_{n}"
        taken.add(name)
        if name != want:
            renamed[want] = name
        return name

    source = free("source")
    names = [str(c) for c in (classes or ["0", "1"])]
    probs: tuple[str, ...] = ()
    klass = value = None
    if kind == "regression":
        value = free("value")
    else:
        picked = [positive_class(classes)] if kind == "binary" else names
        probs = tuple(free(f"probability_{c}") for c in picked)
        klass = free("class")
    version, reason, unseen = free("model_version"), free("reason"), free("unseen")
    extra = {what: free(what) for what in more}
    return OutputNames(source, probs, klass, value, version, reason, unseen, renamed, extra)


class PredictionInput(NamedTuple):
    """One Arrow batch of rows to predict: the model's inputs and the columns copied to the output."""

    features: pa.RecordBatch  # num__* float32, cat__* int32
    carry: pa.RecordBatch  # source, then the id / keep / label columns as read


def feature_columns(spec: FeatureSpec) -> list[str]:
    """The input columns a model reads: its features (the label and the time column are not among them)."""
    return [*spec.all_numeric, *spec.categorical, *spec.id_columns]


def required_columns(spec: FeatureSpec) -> list[str]:
    """The input columns a prediction cannot do without: the numerics whose missing value is a dead letter and the
    ID columns that must have a key (``--required-ids``). The others (optional numerics, categoricals, other ID
    columns) may be absent: their missing values are what the model was trained to handle."""
    return [*spec.numeric, *spec.required_ids]


def optional_columns(spec: FeatureSpec) -> list[str]:
    """The feature columns an input may lack (each then read as missing in every row)."""
    need = set(required_columns(spec))
    return [c for c in feature_columns(spec) if c not in need]


def check_columns(names: Sequence[str], spec: FeatureSpec, where: str, extra: Sequence[str] = (), *,
                  what: str = "file") -> list[str]:
    """Columns the model (or ``--id-column`` / ``--keep-columns``) needs and ``where`` lacks: one error naming
    them (extra columns are ignored). Returns the optional feature columns it lacks (read as missing). ``what``:
    how the message calls the input (``file``, or ``input`` for rows given in Python)."""
    have = set(names)
    missing = [c for c in required_columns(spec) if c not in have]
    if missing:
        raise SchemaError(f"{where}: missing column(s) {', '.join(missing)} that the model needs (features it was "
                          f"trained without missing values); the {what} has {', '.join(names) or 'no column'}")
    absent = [c for c in extra if c not in have]
    if absent:
        raise SchemaError(f"{where}: no column {', '.join(absent)} (--id-column / --keep-columns); the {what} has "
                          f"{', '.join(names) or 'no column'}")
    return [c for c in optional_columns(spec) if c not in have]


def absent_line(absent: dict[str, int], what: str) -> str:
    """``age absent from new.csv: read as missing in its 50 row(s) (the model learned with missing values
    there)``: said once per call."""
    rows = set(absent.values())
    counts = f"its {rows.pop():,} row(s)" if len(rows) == 1 else ", ".join(f"{c} {n:,}" for c, n in absent.items()) \
        + " row(s)"
    return (f"{', '.join(absent)} absent from {what}: read as missing in {counts} (the model learned with missing "
            f"values there)")


def read_types(spec: FeatureSpec) -> dict[str, pa.DataType | None]:
    """The types the feature columns are read as (as the ETL reads them)."""
    types: dict[str, pa.DataType | None] = {c: pa.float64() for c in spec.all_numeric}
    types.update({c: pa.string() for c in spec.categorical})
    types.update({c: pa.string() for c in spec.id_columns})  # 42 and "42" are the same ID
    return types


def with_sources(batch: pa.RecordBatch) -> pa.RecordBatch:
    """``batch`` with the reader's source columns, numbering rows from 1 when it has none (in-process input)."""
    if SOURCE_FILE in batch.schema.names:
        return batch
    n = batch.num_rows
    return pa.RecordBatch.from_arrays([*batch.columns, pa.array(["row"] * n), pa.array(np.arange(1, n + 1))],
                                      names=[*batch.schema.names, SOURCE_FILE, SOURCE_ROW])


def featurize_for_prediction(batch: pa.RecordBatch, spec: FeatureSpec, stats: dict, carry: Sequence[str] = (),
                             source_name: str = PREFIX + "source") -> tuple[PredictionInput | None, list[DeadLetter]]:
    """Rows of ``batch`` (raw columns, with the reader's source columns) -> the model's inputs of the valid ones
    and the columns ``carry`` copied through (after the source, named ``source_name``); a dead letter for each
    row a feature check rejects. An input column named ``source`` is the user's: it is carried, never taken
    for the row's source."""
    batch = with_sources(batch)
    # a user's own `source` column (not a feature) is set aside while the feature code, which reads `source` as
    # the row's position when present, names the dead letters' sources
    user_source = SOURCE in batch.schema.names and SOURCE not in feature_columns(spec)
    if user_source:
        batch = batch.rename_columns([_USER_SOURCE if n == SOURCE else n for n in batch.schema.names])
    valid, letters = split_valid(batch, spec, features_only=True, stats=stats)  # and the numeric ranges
    if user_source:
        letters = [d._replace(payload={(SOURCE if k == _USER_SOURCE else k): v for k, v in d.payload.items()})
                   if isinstance(d.payload, dict) else d for d in letters]
    if valid.num_rows == 0:
        return None, letters
    arrays, names = feature_arrays(valid, spec, stats)
    position = pc.binary_join_element_wise(valid.column(SOURCE_FILE).cast(pa.string()),
                                           pc.cast(valid.column(SOURCE_ROW), pa.string()), ":")
    carried = [position] + [
        valid.column(_USER_SOURCE if user_source and c == SOURCE else c) for c in carry]
    return (PredictionInput(pa.RecordBatch.from_arrays(arrays, names=names),
                            pa.RecordBatch.from_arrays(carried, names=[source_name, *carry])), letters)


def unseen_masks(features: pa.RecordBatch, spec: FeatureSpec) -> dict[str, np.ndarray]:
    """For each categorical feature, the rows whose value the model does not know: never seen in the training
    split (or too rare to be kept in its vocabulary), or missing (the out-of-vocabulary code 0)."""
    return {c: features.column(CAT_PREFIX + c).to_numpy(zero_copy_only=False) == 0 for c in spec.categorical}


def unseen_counts(features: pa.RecordBatch, spec: FeatureSpec) -> dict[str, int]:
    """Rows with an unseen (or missing) value, per categorical feature."""
    return {c: int(m.sum()) for c, m in unseen_masks(features, spec).items()}


def unseen_column(features: pa.RecordBatch, spec: FeatureSpec) -> pa.Array:
    """Per row, its categorical features with an unseen (or missing) value, comma-separated; null if none."""
    masks = unseen_masks(features, spec)
    rows = [",".join(c for c, m in masks.items() if m[i]) or None for i in range(features.num_rows)]
    return pa.array(rows, pa.string())


def prediction_columns(scores: np.ndarray, kind: str, classes: Sequence[str] | None,
                       names: OutputNames) -> tuple[list[pa.Array], list[str]]:
    """Binary: P(positive class) and the predicted class; K classes: each class's probability and the predicted
    class; regression: the value. Named by ``names`` (``output_names``)."""
    if kind == "regression":
        return [pa.array(scores, pa.float64())], [names.value]
    labels = np.asarray([str(c) for c in (classes or ["0", "1"])], dtype=object)
    if kind == "binary":
        picked = np.where(scores >= 0.5, 1, 0)
        return [pa.array(scores, pa.float64()), pa.array(labels[picked], pa.string())], names.predictions
    picked = scores.argmax(axis=1) if len(scores) else np.zeros(0, dtype=np.int64)
    arrays = [pa.array(scores[:, i], pa.float64()) for i in range(len(labels))]
    return [*arrays, pa.array(labels[picked], pa.string())], names.predictions


def output_batch(inp: PredictionInput, scores: np.ndarray, kind: str, classes: Sequence[str] | None,
                 version: str, names: OutputNames, spec: FeatureSpec | None = None) -> pa.RecordBatch:
    """The carried columns, the prediction columns and the model version of one predicted batch (and, given
    ``spec``, the ``unseen`` column)."""
    arrays, cols = prediction_columns(scores, kind, classes, names)
    n = inp.carry.num_rows
    arrays, cols = [*inp.carry.columns, *arrays, pa.array([version] * n, pa.string())], \
        [*inp.carry.schema.names, *cols, names.version]
    if spec is not None:
        arrays, cols = [*arrays, unseen_column(inp.features, spec)], [*cols, names.unseen]
    return pa.RecordBatch.from_arrays(arrays, names=cols)


def output_schema(carried: Sequence[pa.Field], kind: str, classes: Sequence[str] | None, names: OutputNames,
                  flag_unseen: bool = False) -> pa.Schema:
    """The schema of ``output_batch``'s batches (``carried``: the source, then the carried input columns)."""
    scores = np.zeros((0, len(classes or [])) if kind == "multiclass" else 0)
    arrays, cols = prediction_columns(scores, kind, classes, names)
    fields = [*carried, *(pa.field(c, a.type) for c, a in zip(cols, arrays)), pa.field(names.version, pa.string())]
    return pa.schema([*fields, *([pa.field(names.unseen, pa.string())] if flag_unseen else [])])

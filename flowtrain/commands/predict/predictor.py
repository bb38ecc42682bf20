"""``load(bundle)``: a bundle as a ``Predictor`` in this process (``flowtrain.load``): ``predict(rows)`` runs what
``flowtrain predict`` runs on each batch of rows (``pipelines.predict.rows``, the scorer's forward), without Beam."""

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from connectors.dataset_spec import FeatureSpec
from connectors.paths import is_url
from connectors.rows import parse_numbers
from flowtrain.errors import BundleError, FlowtrainError
from flowtrain.train.bundle import build_module, bundle_key, read_bundle
from flowtrain.train.staging import fetch_bundle
from pipelines.predict.rows import (
    absent_line,
    check_columns,
    feature_columns,
    featurize_for_prediction,
    output_names,
    prediction_columns,
    read_types,
    required_columns,
    unseen_column,
    unseen_counts,
)
from pipelines.serving.forward import forward
from pipelines.tabular.schema import SchemaError


class Predictor:
    """A loaded bundle. ``predict(rows)`` takes a pyarrow Table or RecordBatch, a pandas DataFrame, a list of dicts
    or one dict (one row) with the raw columns and returns the same type with one row per input row, in order: the
    ``keep`` columns as given (``keep_columns=True``: every input column), the ``pred_*`` prediction columns and
    ``pred_model_version`` (the names and values of ``flowtrain predict``), and ``pred_reason``: null where the row
    was predicted, else why not (its prediction columns are then null). ``errors="raise"`` raises instead. The
    rows' dead letters are also in ``last_dead_letters``; the unseen categorical values per column of the last call
    in ``last_unseen``; optional feature columns the input lacked (read as missing) in ``last_absent``.

    For scikit-learn users: ``classes_`` and ``predict_proba(rows)`` (an array of the class probabilities,
    ``(rows, classes)``)."""

    def __init__(self, path: str | Path, *, trust_code: bool = False, bundle_key_file: str | None = None):
        self.bundle = read_bundle(path, option="flowtrain.load", key=bundle_key(bundle_key_file, "bundle_key_file"))
        self.module = build_module(self.bundle, trust_code=trust_code)
        self.spec = FeatureSpec.from_dict(self.bundle.features["spec"])
        self.stats = self.bundle.features["stats"]
        self.kind = self.bundle.features["kind"]
        self.classes = self.bundle.features.get("classes")
        self.target_scale = tuple(self.bundle.model["target_scale"])
        self.version = self.bundle.version
        self.last_dead_letters: list = []
        self.last_unseen: dict[str, int] = {}
        self.last_absent: dict[str, int] = {}

    def _forward(self, inp):
        """The forward flowtrain predict's (and the stream scorer's) model handler runs, in this process and
        without Beam (``pipelines.serving.forward``)."""
        return forward(self.module, inp.features, self.spec, n_classes=len(self.classes or []),
                       target_scale=self.target_scale, what=f"the model of {self.bundle.path}")

    @property
    def columns(self) -> list[str]:
        """The raw columns the model reads (``required`` those it cannot do without)."""
        return feature_columns(self.spec)

    @property
    def required(self) -> list[str]:
        """The raw columns an input must have (the others may be absent: read as missing)."""
        return required_columns(self.spec)

    @property
    def classes_(self):
        """The class names, in the order of ``predict_proba``'s columns (scikit-learn's ``classes_``); a
        ``FlowtrainError`` for a regression model."""
        if self.kind == "regression":
            raise FlowtrainError("classes_: the model is a regression model (it predicts pred_value, no classes)")
        return np.asarray([str(c) for c in (self.classes or ["0", "1"])], dtype=object)

    def predict_proba(self, rows: Any, *, errors: str = "raise"):
        """The class probabilities of each row, a float64 array ``(rows, len(classes_))`` (binary: ``[1 - p, p]``),
        as scikit-learn's ``predict_proba``. A row that cannot be predicted raises (``errors="null"``: its row is
        NaN)."""
        classes = self.classes_
        out = self.predict(_as_table(rows)[0], errors=errors)  # a Table in, a Table out
        names = output_names([], self.kind, self.classes)
        cols = [pc.fill_null(out.column(c), np.nan).to_numpy() for c in names.probabilities]
        if self.kind == "binary":
            return np.stack([1.0 - cols[0], cols[0]], axis=1)
        return np.stack(cols, axis=1) if cols else np.zeros((0, len(classes)))

    def predict(self, rows: Any, *, keep: tuple[str, ...] | list[str] = (), errors: str = "null",
                flag_unseen: bool = False, keep_columns: bool | tuple[str, ...] | list[str] = False) -> Any:
        if errors not in ("null", "raise"):
            raise FlowtrainError(f"predict(rows, errors={errors!r}): give errors='null' (rows that cannot be "
                                 f"predicted get nulls and a reason) or errors='raise'")
        table, given = _as_table(rows)
        keep = list(dict.fromkeys([*keep, *(table.schema.names if keep_columns is True else (keep_columns or []))]))
        try:
            absent = check_columns(table.schema.names, self.spec, "predict(rows)", extra=keep, what="input")
        except SchemaError as err:
            raise BundleError(str(err)) from None
        names = output_names(keep, self.kind, self.classes)
        n = table.num_rows
        kept = table.select(keep)
        types = read_types(self.spec)
        self.last_absent = {c: n for c in absent}
        for name in absent:  # an optional column the input lacks: missing in every row, as a file reader reads it
            table = table.append_column(name, pa.nulls(n, types[name]))
        if absent and n:
            warnings.warn(f"predict(rows): {absent_line(self.last_absent, 'the input')}", stacklevel=2)
        inputs = table.select(list(dict.fromkeys([*keep, *types])))
        for name, t in types.items():  # the types the reader gives the feature columns
            i = inputs.schema.get_field_index(name)
            if inputs.schema.field(name).type != t:
                inputs = inputs.set_column(i, name, _conform(inputs.column(name), t))
        batch = inputs.combine_chunks().to_batches()[0] if n else None
        inp, letters = featurize_for_prediction(batch, self.spec, self.stats) if n else (None, [])
        self.last_dead_letters = letters
        reasons: list[str | None] = [None] * n
        for letter in letters:  # sources are row:<n>, from 1
            reasons[int(str(letter.source).rsplit(":", 1)[1]) - 1] = letter.reason
        if letters and errors == "raise":
            first = next(i for i, r in enumerate(reasons) if r is not None)
            raise FlowtrainError(f"predict(rows): {len(letters)} of {n} row(s) cannot be predicted, the first is "
                                 f"row {first} (from 0): {reasons[first]}; errors='null' returns them with null "
                                 f"predictions and the reason in {names.reason}")
        valid = np.asarray([r is None for r in reasons], dtype=bool)
        if inp is None:  # no row to predict: no forward
            scores = np.zeros((0, len(self.classes or [])) if self.kind == "multiclass" else 0)
            features = None
        else:
            scores, features = self._forward(inp), inp.features
        arrays, cols = prediction_columns(scores, self.kind, self.classes, names)
        at = pa.array(np.where(valid, np.cumsum(valid) - 1, 0), mask=~valid) if n else pa.array([], pa.int64())
        out = [a.take(at) for a in arrays]
        out.append(pa.array([self.version] * n, pa.string()))
        cols.append(names.version)
        out.append(pa.array(reasons, pa.string()))
        cols.append(names.reason)
        self.last_unseen = unseen_counts(features, self.spec) if features is not None else \
            {c: 0 for c in self.spec.categorical}
        if flag_unseen:
            flags = unseen_column(features, self.spec) if features is not None else pa.array([], pa.string())
            out.append(flags.take(at))
            cols.append(names.unseen)
        result = pa.Table.from_arrays([*kept.columns, *out], names=[*kept.schema.names, *cols])
        return _as_given(result, rows, given)


def _as_table(rows: Any):
    """``rows`` as a pyarrow Table, and the kind of input it was (the output is given back as that kind)."""
    if isinstance(rows, dict):  # one row
        return _from_dicts([rows]), "dict"
    if isinstance(rows, pa.Table):
        return rows, "table"
    if isinstance(rows, pa.RecordBatch):
        return pa.Table.from_batches([rows]), "batch"
    if isinstance(rows, list):
        if not all(isinstance(r, dict) for r in rows):
            raise FlowtrainError("predict(rows): a list must hold one dict per row (column name -> value)")
        return _from_dicts(rows), "dicts"
    if type(rows).__module__.startswith("pandas") and hasattr(rows, "columns"):
        return pa.Table.from_pandas(rows, preserve_index=False), "pandas"
    raise FlowtrainError(f"predict(rows): expected a pyarrow Table or RecordBatch, a pandas DataFrame or a list of "
                         f"dicts, not a {type(rows).__name__}")


def _from_dicts(rows: list[dict]):
    """Dicts as a Table whose columns are every key of any row (a key a row lacks is null there; pyarrow's
    ``from_pylist`` takes the first row's keys only)."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return pa.table({k: [r.get(k) for r in rows] for k in keys}) if keys else pa.Table.from_pylist(rows)


def _as_given(table, rows: Any, given: str) -> Any:
    """The output table as the kind of input ``predict`` was given (a DataFrame keeps the input's index)."""
    if given == "batch":
        return table.combine_chunks().to_batches()[0] if table.num_rows else \
            __import__("pyarrow").RecordBatch.from_pylist([], schema=table.schema)
    if given == "dicts":
        return table.to_pylist()
    if given == "dict":
        return table.to_pylist()[0]
    if given == "pandas":
        frame = table.to_pandas()
        frame.index = rows.index
        return frame
    return table


def _conform(col, t):
    """A column as the file reader would type it: numbers from text parsed, categories as text."""
    col = col.combine_chunks() if hasattr(col, "combine_chunks") else col
    if pa.types.is_floating(t):
        if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
            return parse_numbers(col)[0]
        if pa.types.is_boolean(col.type):
            return pc.cast(pc.cast(col, pa.int8()), t)
        return pc.cast(col, t, safe=False)
    if pa.types.is_boolean(col.type):
        return pc.if_else(col, "true", "false")
    return pc.cast(col, t)


def load(path: str | Path, *, trust_code: bool = False, bundle_key_file: str | None = None) -> Predictor:
    """A bundle (or a run directory's ``bundle/``) as a ``Predictor``, checked first (checksums, version; the
    signature with ``bundle_key_file`` or ``$FLOWTRAIN_BUNDLE_KEY``). Loading imports no code: a bundle whose
    model is a user's factory is refused unless ``trust_code=True``."""
    if is_url(path):  # a bundle (or a run) on an object store: downloaded, then checked as a local one
        path = fetch_bundle(str(path), "flowtrain.load")
    return Predictor(path, trust_code=trust_code, bundle_key_file=bundle_key_file)

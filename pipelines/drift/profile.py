"""Reference profiles and the sufficient statistics (bucket counts) of a window of data.

Everything is measured on what reaches the model: the featurized columns (``num__<col>`` standardized with
the training mean and std, ``cat__<col>`` vocabulary codes, 0 for a value training never saw or a missing
one), the label's target and the model's score. The same code counts a training split (the reference), a
file set (``flowtrain drift``, ``flowtrain predict``) and a scorer's micro-batch, so the buckets agree.

A **reference profile** (``reference_profile``; JSON, written by ``flowtrain batch`` as
``<run>/drift_reference.json`` and into the bundle):

- each numeric feature: ``BINS`` fixed quantile bins of the training split (``edges`` in the column's own
  units; ``z_edges`` standardized), their counts, the training ``min`` / ``max``, the ``missing`` rate
  (an optional numeric's missing value is featurized as the mean: the rate of values exactly at the mean);
- each categorical feature: the ``TOP_VALUES`` most frequent values' counts, an "(other)" bucket for the
  rest of the vocabulary and an "(unseen or missing)" bucket (code 0: too rare for the vocabulary, or missing);
- the label (classes' counts, or quantile bins of a numeric target);
- the model's score on the validation split (binary: P(positive class) in quantile bins; regression: the
  predicted value in quantile bins; K classes: the predicted class's counts), when given.

``Counter(profile).count(features, label, scores)`` turns one batch into ``Counts`` (numpy arrays, added
with ``merge``); ``compare(profile, counts, thresholds)`` gives every measure, alarm and data-quality finding.
"""
from __future__ import annotations

import math

import numpy as np
import pyarrow as pa

from connectors.dataset_spec import CAT_PREFIX, LABEL, NUM_PREFIX, FeatureSpec
from pipelines.drift.measures import RANGE_MARGIN

FORMAT = 1
#: Quantile bins of a numeric column (fewer when its values repeat: the edges are distinct).
BINS = 10
#: A categorical column's most frequent values each get a bucket; the rest of its vocabulary is "(other)".
TOP_VALUES = 20
#: Rows of the training split the quantiles are computed from at most (a uniform sample beyond).
SAMPLE_ROWS = 200_000
OTHER, UNSEEN = "(other)", "(unseen or missing)"
#: Names of the pseudo-features of a comparison (never a column's name: parentheses).
PREDICTION, ERROR = "(prediction)", "(prequential error)"


# --- the reference ----------------------------------------------------------------------------------------
def _numeric_ref(z: np.ndarray, mean: float, std: float, *, optional: bool) -> dict:
    z = np.asarray(z, dtype=np.float64)
    z = z[np.isfinite(z)]
    if z.size == 0:
        z = np.zeros(1)
    edges = np.unique(np.quantile(z, np.arange(1, BINS) / BINS))
    counts = np.bincount(np.searchsorted(edges, z, side="right"), minlength=edges.size + 1)
    raw = lambda v: float(v) * std + mean  # noqa: E731
    return {"z_edges": edges.tolist(), "edges": [raw(e) for e in edges], "counts": counts.tolist(),
            "z_min": float(z.min()), "z_max": float(z.max()), "min": raw(z.min()), "max": raw(z.max()),
            "missing": float(np.mean(z == 0.0)) if optional else 0.0, "optional": optional,
            "mean": mean, "std": std}


def _categorical_ref(codes: np.ndarray, vocab: list) -> dict:
    codes = np.asarray(codes, dtype=np.int64)
    per_code = np.bincount(codes, minlength=len(vocab) + 1)
    order = [int(c) for c in np.argsort(-per_code[1:], kind="stable")[:TOP_VALUES] + 1 if per_code[c] > 0]
    top = sorted(order)
    other = int(per_code[1:].sum() - per_code[top].sum())
    return {"codes": top, "values": [str(vocab[c - 1]) for c in top],
            "counts": [*per_code[top].tolist(), other, int(per_code[0])], "unseen": float(per_code[0] / max(1, codes.size))}


def _numeric_bins(values: np.ndarray) -> dict:
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    if v.size == 0:
        v = np.zeros(1)
    edges = np.unique(np.quantile(v, np.arange(1, BINS) / BINS))
    counts = np.bincount(np.searchsorted(edges, v, side="right"), minlength=edges.size + 1)
    return {"kind": "numeric", "edges": edges.tolist(), "counts": counts.tolist()}


def _class_bins(codes: np.ndarray, names: list[str]) -> dict:
    codes = np.asarray(codes, dtype=np.int64)
    codes = codes[(codes >= 0) & (codes < len(names))]
    return {"kind": "classes", "values": list(names), "counts": np.bincount(codes, minlength=len(names)).tolist()}


def score_kind(task: str, n_classes: int) -> str:
    """How a model's scores are bucketed: "classes" (K > 2 classes: the predicted class), else "numeric"."""
    return "classes" if task == "classification" and n_classes > 2 else "numeric"


def reference_profile(train: pa.Table | pa.RecordBatch, spec: FeatureSpec, stats: dict, *,
                      classes: list[str] | None = None, scores: np.ndarray | None = None) -> dict:
    """The reference profile of a featurized training split (``num__``/``cat__`` columns and ``label``).
    ``scores``: the model's outputs on the validation split (binary: probabilities; K classes: (rows, K)
    probabilities; regression: values)."""
    cols = train.schema.names
    profile = {"format": FORMAT, "rows": int(train.num_rows), "bins": BINS, "numeric": {}, "categorical": {}}
    for col in spec.all_numeric:
        # a dataset written without numeric statistics (made by hand, not by the ETL) has its features as given
        s = (stats.get("numeric") or {}).get(col) or {"mean": 0.0, "std": 1.0}
        profile["numeric"][col] = _numeric_ref(_column(train, NUM_PREFIX + col), float(s["mean"]), float(s["std"]),
                                               optional=col in spec.optional_numeric)
    for col in spec.categorical:
        profile["categorical"][col] = _categorical_ref(_column(train, CAT_PREFIX + col), stats["vocab"][col])
    if LABEL in cols:
        y = _column(train, LABEL).astype(np.float64)
        y = y[np.isfinite(y)]
        if spec.task == "classification":
            profile["label"] = {"name": spec.label, **_class_bins(y.astype(np.int64), list(classes or ["0", "1"]))}
        else:
            profile["label"] = {"name": spec.label, **_numeric_bins(y)}
    if scores is not None:
        scores = np.asarray(scores)
        if scores.ndim == 2:
            profile["prediction"] = _class_bins(scores.argmax(axis=1), list(classes or []))
        else:
            profile["prediction"] = _numeric_bins(scores)
    return profile


def _column(table, name: str) -> np.ndarray:
    col = table.column(name)
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    return col.to_numpy(zero_copy_only=False)


def read_train_sample(dataset: str, spec: FeatureSpec, *, rows: int = SAMPLE_ROWS, seed: int = 0) -> pa.Table:
    """The featurized training split of a dataset directory (a uniform sample of about ``rows`` rows)."""
    from connectors.dataset import read_manifest, read_shard, shard_paths

    total = int(read_manifest(dataset)["rows"].get("train", 0) or 0)
    keep = 1.0 if total <= rows else rows / total
    columns = [NUM_PREFIX + c for c in spec.all_numeric] + [CAT_PREFIX + c for c in spec.categorical] + [LABEL]
    rng = np.random.default_rng(seed)
    parts = []
    for path in shard_paths(dataset, "train"):
        t = read_shard(path, columns=columns)
        if keep < 1.0:
            t = t.filter(pa.array(rng.random(t.num_rows) < keep))
        parts.append(t)
    return pa.concat_tables(parts) if parts else pa.table({c: pa.array([], pa.float32()) for c in columns})


def check_profile(profile: dict, spec: FeatureSpec, where: str) -> dict:
    """A profile that does not cover ``spec``'s features: ``ValueError`` naming ``where`` and the fix."""
    if not isinstance(profile, dict) or profile.get("format") != FORMAT:
        raise ValueError(f"{where}: not a flowtrain drift reference (format {FORMAT}); run `flowtrain batch` again")
    missing = [c for c in spec.all_numeric if c not in profile.get("numeric", {})] + \
              [c for c in spec.categorical if c not in profile.get("categorical", {})]
    if missing:
        raise ValueError(f"{where}: no reference for feature(s) {', '.join(missing)}; it belongs to another model")
    return profile


# --- counting a window --------------------------------------------------------------------------------------
class Counter:
    """Counts batches of featurized rows into the reference's buckets in one vectorised pass per batch.

    ``count_flat`` gives a batch's counts as one int64 vector (``ints``: rows; each numeric feature's bins,
    missing, below and above; each categorical feature's bins; the label's and the prediction's bins and rows)
    plus each numeric feature's smallest and largest value (``lo``, ``hi``): window totals are then one vector
    addition (``DriftMonitor`` keeps a running total). ``counts`` turns them into ``Counts``; ``count`` does both.

    The numeric columns are stacked (features x rows) and each row's bin is the number of the column's edges at
    or below it (the fixed quantile bins, padded; ``searchsorted(edges, z, side="right")`` without a call per
    column); every categorical code goes through one lookup table of all columns' buckets; then one
    ``bincount`` counts every feature, the label and the scores at once."""

    def __init__(self, profile: dict):
        self.profile = profile
        self.numeric = {c: np.asarray(r["z_edges"], dtype=np.float32) for c, r in profile["numeric"].items()}
        self.label = profile.get("label")
        self.prediction = profile.get("prediction")
        pos = 1  # ints[0]: rows
        # numeric: per feature, its bins then missing, below, above
        self._num_bins, self._num_rest = [], []
        for edges in self.numeric.values():
            self._num_bins.append(pos)
            pos += edges.size + 1
            self._num_rest.append(pos)
            pos += 3
        self._num_bins = np.asarray(self._num_bins, np.int64)
        self._num_rest = np.asarray(self._num_rest, np.int64)
        k = len(self.numeric)
        widest = max([e.size for e in self.numeric.values()], default=0)
        self._edges = np.full((k, max(widest, 1)), np.inf, np.float32)  # padded: an edge of +inf counts nothing
        for i, edges in enumerate(self.numeric.values()):
            self._edges[i, :edges.size] = edges
        self._n_edges = np.asarray([e.size for e in self.numeric.values()], np.int64)
        self._num_names = [NUM_PREFIX + c for c in self.numeric]
        refs = list(profile["numeric"].values())
        margins = [RANGE_MARGIN * (r["z_max"] - r["z_min"]) for r in refs]
        self._below = [r["z_min"] - m for r, m in zip(refs, margins)]
        self._above = [r["z_max"] + m for r, m in zip(refs, margins)]
        self._optional = np.asarray([bool(r["optional"]) for r in refs], bool)
        self._limits: dict = {}  # the dtypes of the numeric columns -> (below, above) in their precision
        # categorical: code -> the feature's bucket (its own for the top values, "(other)" for the rest of the
        # vocabulary and any code past the table, "(unseen or missing)" for code 0 or a negative one), all columns
        # in one table: row c's codes are clipped to [0, size_c] and offset by start_c
        self.lookup, tables, starts, sizes = {}, [], [], []
        start = 0
        for col, ref in profile["categorical"].items():
            size = max([*ref["codes"], 0]) + 1
            table = np.full(size + 1, len(ref["codes"]), dtype=np.int64)  # [size]: past the table, "(other)"
            table[ref["codes"]] = np.arange(len(ref["codes"]))
            table[0] = len(ref["codes"]) + 1
            self.lookup[col] = table[:size]
            tables.append(table + pos)
            starts.append(start)
            sizes.append(size)
            start += size + 1
            pos += len(ref["counts"])
        self._cat_names = [CAT_PREFIX + c for c in self.lookup]
        self._cat_table = np.concatenate(tables) if tables else np.zeros(0, np.int64)
        self._cat_start = np.asarray(starts, np.int64)[:, None]
        self._cat_size = np.asarray(sizes, np.int64)[:, None]
        self._targets = {}
        for key, ref in (("label", self.label), ("prediction", self.prediction)):
            if ref is not None:
                self._targets[key] = pos  # its bins, then its rows
                pos += len(ref["counts"]) + 1
        self.size = pos

    def empty(self) -> dict:
        return self.counts(*self.empty_flat())

    def empty_flat(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        k = len(self.numeric)
        return np.zeros(self.size, np.int64), np.full(k, math.inf), np.full(k, -math.inf)

    def count(self, features: pa.RecordBatch | None, label: np.ndarray | None = None,
              scores: np.ndarray | None = None) -> dict:
        """The ``Counts`` of one batch: ``features`` (``num__``/``cat__`` columns), the label's targets (NaN: no
        label) and the model's scores (as in ``reference_profile``), each optional."""
        return self.counts(*self.count_flat(features, label, scores))

    def count_flat(self, features: pa.RecordBatch | None, label: np.ndarray | None = None,
                   scores: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``count`` as (ints, lo, hi): see the class."""
        if features is None or features.num_rows == 0:
            return self.empty_flat()
        n = features.num_rows
        index = []  # the bucket of every counted value, offset into ints: one bincount at the end
        k = len(self.numeric)
        lo, hi = np.full(k, math.inf), np.full(k, -math.inf)
        rest = None
        if k:
            z, types = _stacked(features, self._num_names)  # features x rows
            bins = np.zeros(z.shape, np.int8 if self._edges.shape[1] < 127 else np.int64)
            for j in range(self._edges.shape[1]):  # the number of edges at or below each value
                bins += z >= self._edges[:, j:j + 1]
            bins = np.minimum(bins, self._n_edges[:, None])  # +inf counts no padding edge (int64 from here)
            lo, hi = np.minimum.reduce(z, axis=1).astype(np.float64), np.maximum.reduce(z, axis=1).astype(np.float64)
            if np.isnan(lo).any():  # a NaN (the minimum is NaN): sorted after every edge, as searchsorted puts it
                nan = np.isnan(z)
                bins[nan] = np.broadcast_to(self._n_edges[:, None], z.shape)[nan]
            bins += self._num_bins[:, None]
            index.append(bins.ravel())
            below, above = self._range_limits(types, z.dtype)
            rest = np.stack([np.add.reduce(z == 0.0, axis=1) * self._optional,
                             np.add.reduce(z < below, axis=1), np.add.reduce(z > above, axis=1)], axis=1)
        if len(self.lookup):
            codes = _stacked(features, self._cat_names)[0].astype(np.int64)
            np.maximum(codes, 0, out=codes)
            np.minimum(codes, self._cat_size, out=codes)
            codes += self._cat_start
            index.append(self._cat_table[codes.ravel()])
        target_rows = {}
        for key, values in (("label", label), ("prediction", scores)):
            if values is not None and key in self._targets:
                v = _target_buckets(self.profile[key], np.asarray(values, dtype=np.float64) if key == "label"
                                    else np.asarray(values))
                index.append(v + self._targets[key])
                target_rows[key] = v.size
        ints = np.bincount(np.concatenate(index), minlength=self.size) if index else np.zeros(self.size, np.int64)
        ints[0] = n
        if rest is not None:
            ints[self._num_rest[:, None] + np.arange(3)] = rest
        for key, rows in target_rows.items():
            ints[self._targets[key] + len(self.profile[key]["counts"])] = rows
        return ints, lo, hi

    def _range_limits(self, types: tuple, common) -> tuple[np.ndarray, np.ndarray]:
        """The out-of-range limits of each numeric column in its own precision (a float32 column is compared with
        its limits rounded to float32, as numpy compares an array with a Python float), as one array."""
        key = (types, common)
        if key not in self._limits:
            own = [t.to_pandas_dtype() if pa.types.is_floating(t) else np.float64 for t in types]
            below = [np.asarray(b).astype(d) for b, d in zip(self._below, own)]
            above = [np.asarray(a).astype(d) for a, d in zip(self._above, own)]
            self._limits[key] = (np.asarray(below, common)[:, None], np.asarray(above, common)[:, None])
        return self._limits[key]

    def counts(self, ints: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> dict:
        """``Counts`` (dicts of numpy bins and numbers) from ``count_flat``'s vectors (or a sum of them)."""
        out = {"rows": int(ints[0]), "numeric": {}, "categorical": {}}
        for i, (col, edges) in enumerate(self.numeric.items()):
            b, r = self._num_bins[i], self._num_rest[i]
            out["numeric"][col] = {"bins": ints[b:b + edges.size + 1].copy(), "missing": int(ints[r]),
                                   "below": int(ints[r + 1]), "above": int(ints[r + 2]),
                                   "min": float(lo[i]), "max": float(hi[i])}
        pos = int(self._num_rest[-1]) + 3 if len(self.numeric) else 1
        for col, ref in self.profile["categorical"].items():
            out["categorical"][col] = {"bins": ints[pos:pos + len(ref["counts"])].copy()}
            pos += len(ref["counts"])
        for key, start in self._targets.items():
            n = len(self.profile[key]["counts"])
            out[key] = {"bins": ints[start:start + n].copy(), "rows": int(ints[start + n])}
        return out


def _stacked(batch: pa.RecordBatch, names: list[str]) -> tuple[np.ndarray, tuple]:
    """Columns of a batch as one (columns x rows) array of their common type (a null as NaN, as ``to_numpy``
    gives it) and the columns' Arrow types: one conversion, not one per column."""
    part = batch.select(names)
    nulls = any(col.null_count for col in part.columns)
    return np.asarray(part.to_tensor(null_to_nan=nulls, row_major=False)).T, tuple(part.schema.types)


def _target_buckets(ref: dict, values: np.ndarray) -> np.ndarray:
    """The bucket of each label target or model score (NaN: none, left out) in ``ref``'s buckets; (rows, K)
    probabilities: their most likely class."""
    n = len(ref["counts"])
    if ref["kind"] == "classes":
        if values.ndim == 2:
            values = values.argmax(axis=1)
        v = values[np.isfinite(values)].astype(np.int64) if values.dtype.kind == "f" else values.astype(np.int64)
        return v[(v >= 0) & (v < n)]
    return np.searchsorted(np.asarray(ref["edges"]), values[np.isfinite(values)], side="right")


def score_counts(ref: dict, values: np.ndarray) -> dict:
    """Label targets or model scores (NaN: none) counted into the buckets of ``ref`` (a profile's ``label`` or
    ``prediction``); (rows, K) probabilities count their most likely class."""
    v = _target_buckets(ref, values)
    return {"bins": np.bincount(v, minlength=len(ref["counts"])), "rows": int(v.size)}


def merge(a: dict, b: dict) -> dict:
    """The counts of two windows together (a new dict; min/max kept, every count added)."""
    out = {"rows": a["rows"] + b["rows"], "numeric": {}, "categorical": {}}
    for col, x in a["numeric"].items():
        y = b["numeric"][col]
        out["numeric"][col] = {"bins": np.asarray(x["bins"]) + np.asarray(y["bins"]),
                               **{k: x[k] + y[k] for k in ("missing", "below", "above")},
                               "min": min(x["min"], y["min"]), "max": max(x["max"], y["max"])}
    for col, x in a["categorical"].items():
        out["categorical"][col] = {"bins": np.asarray(x["bins"]) + np.asarray(b["categorical"][col]["bins"])}
    for key in ("label", "prediction"):
        if key in a and key in b:
            out[key] = {"bins": np.asarray(a[key]["bins"]) + np.asarray(b[key]["bins"]),
                        "rows": a[key]["rows"] + b[key]["rows"]}
    return out


def counts_to_json(counts: dict) -> dict:
    """``Counts`` as plain JSON values (lists of ints; an empty window's min/max as null)."""
    def clean(v):
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, np.ndarray):
            return v.astype(np.int64).tolist()
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, np.generic):
            return v.item()
        return v
    return clean(counts)


def counts_from_json(data: dict) -> dict:
    """The inverse of ``counts_to_json``."""
    def back(v, key=None):
        if isinstance(v, dict):
            return {k: back(x, k) for k, x in v.items()}
        if key == "bins":
            return np.asarray(v, dtype=np.int64)
        if key == "min" and v is None:
            return math.inf
        if key == "max" and v is None:
            return -math.inf
        return v
    return back(data)


def reference_scores(scores: np.ndarray) -> dict:
    """A ``prediction`` reference made from scores (a scorer without one from training: its first window's)."""
    scores = np.asarray(scores)
    if scores.ndim == 2:
        return _class_bins(scores.argmax(axis=1), [str(i) for i in range(scores.shape[1])])
    return _numeric_bins(scores)

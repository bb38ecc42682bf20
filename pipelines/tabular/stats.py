"""Full-pass statistics over the training split: ``StatsAccumulator``, a Beam CombineFn's mergeable state
(means and standard deviations by magnitude, bounded vocabularies, the label's classes or moments)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from connectors.dataset_spec import MAX_CLASSES, VOCAB_SKETCH_FACTOR, FeatureSpec
from pipelines.tabular.columns import floats
from pipelines.tabular.labels import encode_labels, is_classes, label_keys, order_classes
from pipelines.tabular.ranges import RANGE_MARGIN_BITS, RANGE_QUANTILE
from pipelines.tabular.schema import SchemaError

_ZERO = -2000  # the magnitude bucket of exact zeros (np.frexp's exponents are >= -1073)


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
    weight_sum: float = 0.0  # --weight-column: the training rows' weights summed

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
        if spec.weight_column:
            self.weight_sum += float(np.nansum(floats(batch.column(spec.weight_column))))
        self.capacity = max(self.capacity, VOCAB_SKETCH_FACTOR * spec.max_vocab)
        self.label_name = spec.label
        for col in spec.all_numeric:
            vals = floats(batch.column(col))
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
        if is_classes(spec):
            vc = pc.value_counts(label_keys(batch.column(spec.label)))
            for value, n in zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist()):
                if value is not None:
                    self.label_counts[value] = self.label_counts.get(value, 0) + n
            self._bound()
            return self
        self._bound()
        if spec.task == "regression":
            values = floats(batch.column(spec.label))  # float64: a float32 target would round (or overflow)
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
        self.weight_sum += other.weight_sum
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
        if spec.weight_column:  # the loader divides each weight by their training mean (they average 1 in training)
            out.update({"weight_sum": self.weight_sum, "weight_mean": self.weight_sum / self.rows if self.rows else 0.0})
        if is_classes(spec):
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

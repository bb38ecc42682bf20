"""The test evaluation behind the report: what a data scientist checks before trusting a model.

For the model and each baseline, on the test split (scikit-learn's metrics):
- binary: ROC and precision/recall curves, the calibration curve and Brier score, metrics at the
  threshold chosen on the validation split (the one with the best F1) and at 0.5, a threshold table;
- K classes: per-class ROC AUC (one class against the rest);
- regression: residuals and predicted against actual (the figures, ``flowtrain.train.report``);
- every task: bootstrap 95% intervals on the test metrics (percentiles of ``BOOTSTRAP`` resamples
  of the test rows, ``scipy.stats.bootstrap``) and on the model-minus-linear difference (the same resamples for both, paired),
  permutation feature importance on the test split (the drop of the selection metric when one
  feature's column is shuffled, ``REPEATS`` times, with a 95% t-interval over the repeats), and
  metrics per value of one categorical feature (``slice_by``).

Everything here is a pure function of outputs and labels (numpy arrays) or of a model and tensors;
``evaluate_run`` puts it together for ``flowtrain batch``.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from flowtrain.train.baselines import majority_outputs
from flowtrain.train.loader import iter_batches
from flowtrain.train.loop import predict

#: Bootstrap resamples of the test split for the 95% intervals.
BOOTSTRAP = 200
#: Bootstrap resamples drawn at once hold at most this many row indices (memory: 8 bytes each).
BOOTSTRAP_BATCH_ROWS = 4_000_000
#: Shuffles per feature for permutation importance.
REPEATS = 5
#: Permutation importance and slices look at up to this many test rows (the first ones).
IMPORTANCE_ROWS = 20_000
#: Slices shown (the most frequent values; the rest are summed up as "(other values)").
MAX_SLICES = 20
#: The thresholds of the binary threshold table.
THRESHOLDS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)

#: Metrics with an interval, per kind of task, and whether higher is better.
INTERVAL_METRICS = {"binary": {"auc": True, "accuracy": True, "log_loss": False, "brier": False},
                    "multiclass": {"accuracy": True, "macro_f1": True, "log_loss": False},
                    "regression": {"rmse": False, "mae": False, "r2": True}}


def probabilities(outputs: np.ndarray, kind: str) -> np.ndarray:
    """Binary: P(positive) per row; K classes: ``[N, K]`` softmax; regression: the predictions."""
    outputs = np.asarray(outputs, dtype=np.float64)
    if kind == "binary":
        return 1.0 / (1.0 + np.exp(-outputs.reshape(-1)))
    if kind == "multiclass":
        z = outputs - outputs.max(axis=1, keepdims=True)
        e = np.exp(z)
        return e / e.sum(axis=1, keepdims=True)
    return outputs.reshape(-1)


def point_metrics(kind: str, y: np.ndarray, p: np.ndarray) -> dict[str, float]:
    """The interval metrics of predictions ``p`` (``probabilities``) against labels ``y``."""
    from sklearn import metrics as skm

    y = np.asarray(y)
    if kind == "binary":
        y = (y > 0.5).astype(np.int64)
        both = 0 < y.sum() < len(y)
        return {"auc": float(skm.roc_auc_score(y, p)) if both else float("nan"),
                "accuracy": float(((p > 0.5) == y).mean()),
                "log_loss": float(skm.log_loss(y, np.clip(p, 1e-15, 1 - 1e-15), labels=[0, 1])),
                "brier": float(skm.brier_score_loss(y, p))}
    if kind == "multiclass":
        y = y.astype(np.int64)
        k = p.shape[1]
        present = np.unique(y)
        return {"accuracy": float((p.argmax(1) == y).mean()),
                "macro_f1": float(skm.f1_score(y, p.argmax(1), labels=present, average="macro", zero_division=0)),
                "log_loss": float(skm.log_loss(y, np.clip(p, 1e-15, 1.0), labels=list(range(k))))}
    err = p - y
    var = float(((y - y.mean()) ** 2).mean()) if len(y) else float("nan")
    mse = float((err ** 2).mean())
    return {"rmse": math.sqrt(mse), "mae": float(np.abs(err).mean()), "r2": 1 - mse / var if var > 0 else float("nan")}


def weighted_metrics(kind: str, y: np.ndarray, p: np.ndarray, w: np.ndarray, prepared: dict | None = None
                     ) -> dict[str, float]:
    """``point_metrics`` with a weight per row (a bootstrap resample is the rows weighted by how often
    they were drawn), in O(N) numpy: with unit weights they equal scikit-learn's (a test checks).
    ``prepared``: ``prepare(kind, y, p)``, what does not depend on the weights (computed once per model)."""
    total = float(w.sum())
    if total <= 0:
        return {k: float("nan") for k in INTERVAL_METRICS[kind]}
    if kind == "binary":
        prep = prepared or prepare(kind, y, p)
        # (w * x).sum(), not w @ x: a BLAS dot spins up threads, 30 ms per call on a busy machine
        return {"auc": _weighted_auc(prep, w), "accuracy": float((w * prep["correct"]).sum() / total),
                "log_loss": float((w * prep["nll"]).sum() / total),
                "brier": float((w * prep["squared"]).sum() / total)}
    if kind == "multiclass":
        yi = y.astype(np.int64)
        k = p.shape[1]
        pred = p.argmax(1)
        ll = -(w * np.log(np.clip(p[np.arange(len(yi)), yi], 1e-15, 1.0) / np.clip(p.sum(1), 1e-15, None))).sum()
        confusion = np.bincount(yi * k + pred, weights=w, minlength=k * k).reshape(k, k)
        tp, predicted, actual = np.diag(confusion), confusion.sum(0), confusion.sum(1)
        with np.errstate(divide="ignore", invalid="ignore"):
            precision = np.where(predicted > 0, tp / predicted, 0.0)
            recall = np.where(actual > 0, tp / actual, 0.0)
            f1 = np.where(precision + recall > 0, 2 * precision * recall / (precision + recall), 0.0)
        present = actual > 0
        return {"accuracy": float(tp.sum() / total), "macro_f1": float(f1[present].mean()) if present.any()
                else float("nan"), "log_loss": float(ll / total)}
    err = p - y
    mse = float((w * err ** 2).sum() / total)
    mean = float((w * y).sum() / total)
    var = float((w * (y - mean) ** 2).sum() / total)
    return {"rmse": math.sqrt(mse), "mae": float((w * np.abs(err)).sum() / total),
            "r2": 1 - mse / var if var > 0 else float("nan")}


def prepare(kind: str, y: np.ndarray, p: np.ndarray) -> dict:
    """Per-row terms of the binary metrics and the score order for the AUC (independent of weights)."""
    if kind != "binary":
        return {}
    pos = y > 0.5
    pc = np.clip(p, 1e-15, 1 - 1e-15)
    order = np.argsort(p, kind="stable")
    sp = p[order]
    group = np.concatenate([[0], np.cumsum(sp[1:] != sp[:-1])]) if len(sp) else np.zeros(0, np.int64)  # ties
    return {"correct": ((p > 0.5) == pos).astype(np.float64), "nll": -np.where(pos, np.log(pc), np.log(1 - pc)),
            "squared": (p - pos) ** 2, "order": order, "group": group, "pos": pos[order].astype(np.float64),
            "groups": int(group[-1]) + 1 if len(group) else 0}


def _weighted_auc(prep: dict, w: np.ndarray) -> float:
    """ROC AUC with row weights: the weighted share of (positive, negative) pairs ordered right, ties half."""
    sw, spos, group = w[prep["order"]], prep["pos"], prep["group"]
    wp = np.bincount(group, weights=sw * spos, minlength=prep["groups"])
    wn = np.bincount(group, weights=sw * (1.0 - spos), minlength=prep["groups"])
    n_pos, n_neg = wp.sum(), wn.sum()
    if n_pos <= 0 or n_neg <= 0:
        return float("nan")
    below = np.cumsum(wn) - wn
    return float((wp * (below + 0.5 * wn)).sum() / (n_pos * n_neg))


def bootstrap(kind: str, y: np.ndarray, preds: dict[str, np.ndarray], *, b: int = BOOTSTRAP, seed: int = 0,
              difference: tuple[str, str] | None = None) -> dict:
    """Point estimates and percentile 95% intervals of every model's metrics, on the same resamples;
    with ``difference=(a, b)`` also the interval of ``a``'s metric minus ``b``'s (paired).

    ``scipy.stats.bootstrap(method="percentile")`` draws the ``b`` resamples of the row indices
    (``numpy.random.default_rng(seed)``) and takes the percentiles; one statistic returns every model's
    metrics and the differences of each resample, so all of them see the same rows. A resample whose
    metric is undefined (an AUC of a resample with one class) is left out of that metric's interval. An interval
    that misses its point estimate (a metric at its bound) is widened to it."""
    from scipy import stats

    n = len(y)
    names, keys = list(preds), list(INTERVAL_METRICS[kind])
    prepared = {name: prepare(kind, y, p) for name, p in preds.items()}

    def metrics_of(w: np.ndarray) -> list[float]:
        per_model = {name: weighted_metrics(kind, y, preds[name], w, prepared[name]) for name in names}
        values = [per_model[name][k] for name in names for k in keys]
        if difference:
            values += [per_model[difference[0]][k] - per_model[difference[1]][k] for k in keys]
        return values

    def statistic(rows: np.ndarray, axis: int = -1) -> np.ndarray:  # rows: [resamples, n] drawn row indices
        return np.array([metrics_of(np.bincount(r, minlength=n).astype(np.float64)) for r in rows]).T

    point = np.array(metrics_of(np.ones(n)), dtype=np.float64)
    if n < 2 or b < 1:  # every resample of one row is that row; of none, nothing
        low = high = point if n == 1 and b >= 1 else np.full(len(point), np.nan)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", stats.DegenerateDataWarning)  # NaN resamples: handled below
            result = stats.bootstrap((np.arange(n),), statistic, n_resamples=b, vectorized=True,
                                     batch=max(1, min(b, BOOTSTRAP_BATCH_ROWS // n)), method="percentile",
                                     confidence_level=0.95, rng=np.random.default_rng(seed))
        low, high = result.confidence_interval.low, result.confidence_interval.high
        undefined = np.isnan(result.bootstrap_distribution).any(axis=-1)
        if undefined.any():  # the percentiles of the resamples where the metric is defined
            low, high = low.copy(), high.copy()
            for i in np.flatnonzero(undefined):
                kept = result.bootstrap_distribution[i][~np.isnan(result.bootstrap_distribution[i])]
                low[i], high[i] = np.percentile(kept, [2.5, 97.5]) if len(kept) else (np.nan, np.nan)
        # A percentile interval can miss its own estimate when the metric sits at its bound: the R^2 of the training
        # mean is at most 0, and when the test mean is close to it nearly every resample's R^2 is below the test
        # set's. Such an interval is widened to the estimate (never narrowed): the report never shows an estimate
        # outside its own interval.
        known = np.isfinite(point) & np.isfinite(low) & np.isfinite(high)
        low, high = np.where(known, np.minimum(low, point), low), np.where(known, np.maximum(high, point), high)
    intervals = [{"value": float(v), "low": float(lo), "high": float(hi)} for v, lo, hi in zip(point, low, high)]
    out = {"resamples": b, "models": {name: dict(zip(keys, intervals[i * len(keys):(i + 1) * len(keys)]))
                                      for i, name in enumerate(names)}}
    if difference:
        out["difference"] = {"of": list(difference),
                             "metrics": dict(zip(keys, intervals[len(names) * len(keys):]))}
    return out


# --- binary: thresholds and calibration ------------------------------------------------------------
def at_threshold(y: np.ndarray, p: np.ndarray, threshold: float) -> dict[str, float]:
    """Accuracy, precision, recall, F1 and the share predicted positive at one threshold."""
    y = y > 0.5
    pred = p >= threshold
    tp = float((pred & y).sum())
    precision = tp / pred.sum() if pred.sum() else 0.0
    recall = tp / y.sum() if y.sum() else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"threshold": float(threshold), "accuracy": float((pred == y).mean()), "precision": precision,
            "recall": recall, "f1": f1, "predicted_positive": float(pred.mean())}


def choose_threshold(y_valid: np.ndarray, p_valid: np.ndarray) -> float:
    """The threshold with the best F1 on the validation split (never the test split)."""
    from sklearn.metrics import precision_recall_curve

    precision, recall, thresholds = precision_recall_curve(y_valid > 0.5, p_valid)
    if not len(thresholds):
        return 0.5
    f1 = 2 * precision[:-1] * recall[:-1] / np.maximum(precision[:-1] + recall[:-1], 1e-12)
    return float(thresholds[int(np.argmax(f1))])


def binary_details(y: np.ndarray, p: np.ndarray, y_valid: np.ndarray, p_valid: np.ndarray) -> dict:
    """Brier score, calibration curve, metrics at the validation-chosen threshold and at 0.5, the table."""
    from sklearn.calibration import calibration_curve
    from sklearn.metrics import average_precision_score, brier_score_loss

    chosen = choose_threshold(y_valid, p_valid)
    both = 0 < (y > 0.5).sum() < len(y)
    true_rate, mean_pred = calibration_curve(y > 0.5, p, n_bins=10, strategy="quantile") if both else ([], [])
    return {"brier": float(brier_score_loss(y > 0.5, p)),
            "average_precision": float(average_precision_score(y > 0.5, p)) if both else float("nan"),
            "chosen_threshold": chosen, "at_chosen": at_threshold(y, p, chosen), "at_half": at_threshold(y, p, 0.5),
            "table": [at_threshold(y, p, t) for t in THRESHOLDS],
            "calibration": {"mean_predicted": [float(x) for x in mean_pred],
                            "observed_rate": [float(x) for x in true_rate]}}


def per_class_auc(y: np.ndarray, p: np.ndarray, classes: list[str]) -> dict[str, float | None]:
    """One class against the rest: ROC AUC per class (None for a class absent from, or alone in, the rows)."""
    from sklearn.metrics import roc_auc_score

    y = y.astype(np.int64)
    out = {}
    for k, c in enumerate(classes):
        hit = y == k
        out[c] = float(roc_auc_score(hit, p[:, k])) if 0 < hit.sum() < len(y) else None
    return out


# --- permutation importance and slices ------------------------------------------------------------------
@dataclass
class Rows:
    """Test rows as tensors (features) with their labels."""
    x_num: torch.Tensor
    x_cat: torch.Tensor
    y: np.ndarray


def permutation_importance(score: Callable[[torch.Tensor, torch.Tensor], float], rows: Rows,
                           names_num: list[str], names_cat: list[str], *, higher_is_better: bool,
                           repeats: int = REPEATS, seed: int = 0) -> list[dict]:
    """The drop of ``score(x_num, x_cat)`` when one feature's column is shuffled (positive: the
    feature matters), ``repeats`` shuffles each; mean and 95% t-interval, largest first."""
    from scipy import stats

    rng = np.random.default_rng(seed)
    base = score(rows.x_num, rows.x_cat)
    sign = 1.0 if higher_is_better else -1.0
    out = []
    for which, names in (("numeric", names_num), ("categorical", names_cat)):
        for j, name in enumerate(names):
            drops = []
            for _ in range(repeats):
                x_num, x_cat = rows.x_num.clone(), rows.x_cat.clone()
                perm = torch.from_numpy(rng.permutation(len(rows.y)))
                if which == "numeric":
                    x_num[:, j] = x_num[perm, j]
                else:
                    x_cat[:, j] = x_cat[perm, j]
                drops.append(sign * (base - score(x_num, x_cat)))
            mean = float(np.mean(drops))
            half = float(stats.t.ppf(0.975, repeats - 1) * np.std(drops, ddof=1) / math.sqrt(repeats)) \
                if repeats > 1 else float("nan")
            out.append({"feature": name, "kind": which, "importance": mean, "low": mean - half, "high": mean + half})
    return sorted(out, key=lambda r: -r["importance"])


def slices(kind: str, y: np.ndarray, preds: dict[str, np.ndarray], codes: np.ndarray, vocab: list[str], *,
           metric: str, max_slices: int = MAX_SLICES) -> list[dict]:
    """Rows and ``metric`` of every model per value of one categorical feature (its codes; 0 is a
    value not in the training vocabulary), the ``max_slices`` most frequent values first."""
    names = ["(not in the training vocabulary)"] + list(vocab)
    values, counts = np.unique(codes, return_counts=True)
    order = np.argsort(-counts, kind="stable")
    shown = values[order[:max_slices]]
    groups = [(names[int(v)] if int(v) < len(names) else str(int(v)), codes == v) for v in shown]
    rest = ~np.isin(codes, shown)
    if rest.any():
        groups.append((f"(other values: {len(values) - len(shown)})", rest))
    out = []
    for name, mask in groups:
        row = {"value": name, "rows": int(mask.sum())}
        for model, p in preds.items():
            row[model] = point_metrics(kind, y[mask], p[mask]).get(metric)
        if kind == "binary":
            row["positive_rate"] = float((y[mask] > 0.5).mean())
        out.append(row)
    return out


# --- the whole evaluation of a batch run ---------------------------------------------------------------
@dataclass
class Evaluation:
    """``summary``: JSON (summary.json's ``evaluation``); ``y`` and ``predictions`` (per model,
    ``probabilities``) for the figures and the PR curve."""
    kind: str
    summary: dict
    y: np.ndarray
    predictions: dict[str, np.ndarray]


def first_rows(split, n: int) -> Rows:
    """Up to ``n`` test rows as tensors, in the split's order (a streamed split is read batch by batch)."""
    parts, got = [], 0
    for batch in iter_batches(split, batch_size=min(n, 65_536), seed=0, epoch=0, shuffle=False):
        parts.append(batch)
        got += len(batch)
        if got >= n:
            break
    if not parts:
        return Rows(torch.zeros(0, 0), torch.zeros(0, 0, dtype=torch.long), np.zeros(0))
    return Rows(torch.cat([b.x_num for b in parts])[:n], torch.cat([b.x_cat for b in parts])[:n],
                torch.cat([b.y for b in parts])[:n].double().numpy())


def check_slice_by(column: str | None, categorical: list[str]) -> None:
    """``--slice-by`` must name a categorical feature of the dataset."""
    if column is not None and column not in categorical:
        raise ValueError(f"--slice-by {column}: not a categorical feature of the dataset; use one of "
                         f"{', '.join(categorical) or '(none: the dataset has no categorical feature)'}")


def evaluate_run(data, models: dict, test, valid, *, majority: str, select_by: str,
                 scale: tuple[float, float] = (0.0, 1.0), slice_by: str | None = None, b: int = BOOTSTRAP,
                 seed: int = 0) -> Evaluation:
    """``models``: name -> ``nn.Module`` (the first one is the model the report is about; "linear
    model" gets the paired difference); ``majority`` names the majority baseline, added here."""
    kind = data.kind
    y = test.y.double().numpy()
    y_valid = valid.y.double().numpy()
    outputs = {name: (predict(m, test, scale=scale), predict(m, valid, scale=scale)) for name, m in models.items()}
    # the majority baseline: class frequencies as logits, or the training mean in the label's units
    outputs[majority] = (majority_outputs(data, len(y)), majority_outputs(data, len(y_valid)))
    preds = {n: probabilities(t.numpy(), kind) for n, (t, _) in outputs.items()}
    preds_valid = {n: probabilities(v.numpy(), kind) for n, (_, v) in outputs.items()}
    main = next(iter(models))
    summary: dict = {"kind": kind, "rows": int(len(y))}
    summary["intervals"] = bootstrap(kind, y, preds, b=b, seed=seed,
                                     difference=(main, "linear model") if "linear model" in preds else None)
    if kind == "binary":
        summary["binary"] = {n: binary_details(y, p, y_valid, preds_valid[n]) for n, p in preds.items()}
    elif kind == "multiclass":
        summary["per_class_auc"] = {n: per_class_auc(y, p, list(data.classes)) for n, p in preds.items()}

    # permutation importance of the model, by the selection metric, on the first test rows
    metric = select_by if select_by in INTERVAL_METRICS[kind] else next(iter(INTERVAL_METRICS[kind]))
    rows = first_rows(test, IMPORTANCE_ROWS)
    model = models[main]

    @torch.no_grad()
    def score(x_num: torch.Tensor, x_cat: torch.Tensor) -> float:
        model.eval()
        out = model(x_num, x_cat) * scale[1] + scale[0]
        return weighted_metrics(kind, rows.y, probabilities(out.numpy(), kind), np.ones(len(rows.y)))[metric]

    summary["importance"] = {
        "metric": metric, "rows": int(len(rows.y)), "repeats": REPEATS,
        "features": permutation_importance(score, rows, list(data.spec.all_numeric), list(data.spec.categorical),
                                           higher_is_better=INTERVAL_METRICS[kind][metric], seed=seed)}
    if slice_by:
        check_slice_by(slice_by, list(data.spec.categorical))
        j = list(data.spec.categorical).index(slice_by)
        codes = np.concatenate([b.x_cat[:, j].numpy() for b in _batches(test)]) if len(y) else np.zeros(0, int)
        summary["slices"] = {"column": slice_by, "metric": metric,
                             "rows": slices(kind, y, preds, codes, list(data.stats["vocab"][slice_by]), metric=metric)}
    return Evaluation(kind, summary, y, preds)


def _batches(split):
    return iter_batches(split, batch_size=65_536, seed=0, epoch=0, shuffle=False)

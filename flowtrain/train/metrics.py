"""Evaluation metrics (on whole tensors) and the run's metrics log (JSON lines).

Metrics that fit the task:
- binary classification: ``auc``, ``accuracy``, ``log_loss`` (= ``loss``), ``positive_rate``;
- K-class classification: ``accuracy``, ``macro_f1``, ``log_loss`` (= ``loss``), and per class
  precision / recall / support plus the confusion matrix (rows: true class, columns: predicted);
- regression: ``rmse``, ``mae``, ``r2``, ``loss`` (the mean squared error).
AUC is the Mann-Whitney U over the pairs (``scipy.stats.mannwhitneyu``), the confusion matrix scikit-learn's (``confusion_matrix``).
``SELECT_BY`` says which of them can choose the best model and in which direction.
"""
from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from connectors.atomic import atomic_write

#: Validation metrics that can select the best model (``--select-by``): True if higher is better.
SELECT_BY = {"auc": True, "accuracy": True, "macro_f1": True, "r2": True,
             "log_loss": False, "loss": False, "rmse": False, "mae": False}
#: The metrics each kind of task reports (and can select by).
TASK_METRICS = {"binary": ("auc", "accuracy", "log_loss", "loss"),
                "multiclass": ("accuracy", "macro_f1", "log_loss", "loss"),
                "regression": ("rmse", "mae", "r2", "loss")}
#: The default ``--select-by`` per kind of task.
DEFAULT_SELECT_BY = {"binary": "auc", "multiclass": "accuracy", "regression": "rmse"}


def check_select_by(metric: str | None, kind: str) -> str:
    """The metric to select by (default per task); a metric that does not fit is a ValueError."""
    if metric is None:
        return DEFAULT_SELECT_BY[kind]
    if metric not in TASK_METRICS[kind]:
        raise ValueError(f"--select-by {metric}: not a metric of a {kind} task; use one of "
                         f"{', '.join(TASK_METRICS[kind])}")
    return metric


def better(a: dict, b: dict | None, metric: str) -> bool:
    """Is validation result ``a`` strictly better than ``b`` by ``metric``? A tie keeps ``b``, the
    earlier model (the one closer to its linear start) when validation cannot tell them apart."""
    if b is None:
        return True
    x, y = float(a[metric]), float(b[metric])
    if x != x:  # NaN never wins
        return False
    if y != y:
        return True
    if abs(x - y) <= 1e-9 * max(1.0, abs(y)):
        return False
    return x > y if SELECT_BY[metric] else x < y


def standard_error(metrics: dict, metric: str, n: int) -> float:
    """An approximate standard error of ``metric`` measured on ``n`` rows (binomial for accuracy
    and macro-F1, Hanley-McNeil's bound for AUC, ``x / sqrt(2n)`` for RMSE, ``x / sqrt(n)`` for
    losses and MAE): the noise a validation split of that size puts on the metric."""
    n = max(int(n), 1)
    x = float(metrics[metric])
    if metric in ("accuracy", "macro_f1"):
        return max(math.sqrt(max(x * (1 - x), 0.0) / n), 1.0 / n)
    if metric == "auc":
        rate = float(metrics.get("positive_rate", 0.5))
        smaller = max(1.0, min(rate, 1 - rate) * n)
        return max(math.sqrt(max(x * (1 - x), 0.0) / smaller), 1.0 / n)
    if metric == "rmse":
        return x / math.sqrt(2 * n)
    if metric == "r2":
        return 2 * max(1 - x, 0.0) / math.sqrt(2 * n)
    return abs(x) / math.sqrt(n)


def clears(a: dict, start: dict, metric: str, n: int) -> bool:
    """Is ``a`` better than the ``start`` model by more than one standard error of the metric on
    ``n`` validation rows (the one-standard-error rule: keep the simpler model unless the other is
    clearly better)?"""
    x, y = float(a[metric]), float(start[metric])
    if x != x:
        return False
    if y != y:
        return True
    se = standard_error(start, metric, n)
    return x >= y + se if SELECT_BY[metric] else x <= y - se


def import_evaluation() -> None:
    """Imports what the evaluation imports lazily (``scipy.stats``, ``sklearn.metrics``). A capped training worker
    (``--worker-memory``) does it before its cap is calibrated, and the memory plan before it measures a worker's
    fixed overhead: under ``RLIMIT_AS`` a shared object mapped after the calibration may not fit."""
    import scipy.stats  # noqa: F401
    import sklearn.metrics  # noqa: F401


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """ROC AUC: the Mann-Whitney U of the positives' scores against the negatives', over their count of pairs
    (``scipy.stats.mannwhitneyu``; tied scores count half, equal to scikit-learn's ``roc_auc_score``); NaN when the
    rows hold one class. Not ``roc_auc_score``, which builds the whole ROC curve: 1.29 s against 0.53 s on 3.4 M
    rows here, and its import adds 0.5 s to every ``flowtrain predict`` of a labelled table (measured)."""
    from scipy.stats import mannwhitneyu

    y = labels.detach().flatten().cpu().numpy() > 0.5
    if y.all() or not y.any():
        return float("nan")
    s = scores.detach().flatten().cpu().double().numpy()
    return float(mannwhitneyu(s[y], s[~y]).statistic / (int(y.sum()) * int((~y).sum())))


def classification_metrics(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Binary: one logit per row."""
    probs = torch.sigmoid(logits.double())
    loss = float(torch.nn.functional.binary_cross_entropy_with_logits(logits.double(), labels.double()))
    return {"loss": loss, "log_loss": loss, "auc": auc(logits, labels),
            "accuracy": float(((probs > 0.5).double() == labels.double()).double().mean()),
            "positive_rate": float(labels.double().mean())}


def multiclass_metrics(logits: torch.Tensor, labels: torch.Tensor, classes: Sequence[str] | None = None
                       ) -> dict[str, Any]:
    """K logits per row; ``labels`` are class indices. Scalars plus ``per_class`` and ``confusion``
    (scikit-learn's ``confusion_matrix``; precision, recall and F1 per class as its
    ``precision_recall_fscore_support(..., zero_division=0)`` defines them, read off that matrix: the
    function itself checks and counts the rows twice more, 2.5x the time on 1M rows; a class never
    predicted has precision 0, one absent recall 0; macro-F1 over the classes present in the rows)."""
    from sklearn.metrics import confusion_matrix

    k = logits.shape[1]
    classes = list(classes) if classes is not None else [str(i) for i in range(k)]
    target = labels.long().flatten()
    if not target.numel():
        return {"loss": float("nan"), "log_loss": float("nan"), "accuracy": 0.0, "macro_f1": float("nan"),
                "per_class": {c: {"precision": 0.0, "recall": 0.0, "support": 0} for c in classes},
                "confusion": [[0] * k for _ in range(k)]}
    loss = float(torch.nn.functional.cross_entropy(logits.double(), target))
    y, pred = target.cpu().numpy(), logits.argmax(dim=1).cpu().numpy()
    confusion = confusion_matrix(y, pred, labels=list(range(k)))
    tp, predicted, support = np.diag(confusion).astype(np.float64), confusion.sum(0), confusion.sum(1)
    precision = np.divide(tp, predicted, out=np.zeros(k), where=predicted > 0)
    recall = np.divide(tp, support, out=np.zeros(k), where=support > 0)
    f1 = np.divide(2 * tp, predicted + support, out=np.zeros(k), where=predicted + support > 0)
    present = support > 0
    return {"loss": loss, "log_loss": loss,
            "accuracy": float(tp.sum() / len(y)),
            "macro_f1": float(f1[present].mean()) if present.any() else float("nan"),
            "per_class": {c: {"precision": float(precision[i]), "recall": float(recall[i]),
                              "support": int(support[i])} for i, c in enumerate(classes)},
            "confusion": confusion.tolist()}


def regression_metrics(pred: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
    err = pred.double() - target.double()
    mse = float((err ** 2).mean())
    var = float(((target.double() - target.double().mean()) ** 2).mean()) if target.numel() else float("nan")
    return {"loss": mse, "rmse": mse ** 0.5, "mae": float(err.abs().mean()),
            "r2": 1.0 - mse / var if var > 0 else float("nan")}


def scalars(metrics: dict) -> dict[str, float]:
    """Only the scalar metrics (for log lines and the metrics log)."""
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float))}


class MetricsLog:
    """Appends one JSON object per line, each with ``time`` (wall clock, epoch seconds);
    ``truncate_after(step)`` drops lines a resume replays (a new file renamed over the old one). With a ``board``
    (``flowtrain.observe.board.Board``) every record is also written to TensorBoard as scalars."""

    def __init__(self, path: str | Path, board=None):
        self.path = Path(path)
        self.board = board

    def write(self, record: dict[str, Any]) -> None:
        record = {**record, "time": record.get("time", time.time())}
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record, default=float) + "\n")
        if self.board is not None:
            self.board.record(record)

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def truncate_after(self, step: int) -> None:
        kept = [r for r in self.read() if r.get("step", 0) <= step]
        # the old log stays whole until the shorter one is complete (a crash here loses nothing)
        atomic_write(self.path, "".join(json.dumps(r, default=float) + "\n" for r in kept))
        if self.board is not None:
            self.board.purge_after(step)


def metrics_of(out: torch.Tensor, y: torch.Tensor, task: str, classes=None) -> dict:
    """The task's metrics of outputs ``out`` against labels ``y``."""
    if task == "regression":
        return regression_metrics(out, y)
    if out.dim() == 2:
        return multiclass_metrics(out, y, classes)
    return classification_metrics(out, y)

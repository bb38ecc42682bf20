"""Evaluation metrics (on whole tensors) and the run's metrics log (JSON lines).

Metrics that fit the task:
- binary classification: ``auc``, ``accuracy``, ``log_loss`` (= ``loss``), ``positive_rate``;
- K-class classification: ``accuracy``, ``macro_f1``, ``log_loss`` (= ``loss``), and per class
  precision / recall / support plus the confusion matrix (rows: true class, columns: predicted);
- regression: ``rmse``, ``mae``, ``r2``, ``loss`` (the mean squared error).
``SELECT_BY`` says which of them can choose the best model and in which direction.
"""
from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

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


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """ROC AUC by the rank-sum (Mann-Whitney) formula, ties given their average rank."""
    scores, labels = scores.double().flatten(), labels.double().flatten()
    n_pos = float(labels.sum())
    n_neg = float(labels.numel() - n_pos)
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = torch.argsort(scores)
    sorted_scores = scores[order]
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, scores.numel() + 1, dtype=torch.float64)
    # average ranks over ties
    uniq, inverse, counts = torch.unique(sorted_scores, return_inverse=True, return_counts=True)
    if uniq.numel() != scores.numel():
        sums = torch.zeros(uniq.numel(), dtype=torch.float64).index_add_(
            0, inverse, torch.arange(1, scores.numel() + 1, dtype=torch.float64))
        avg = sums / counts
        ranks[order] = avg[inverse]
    return float((ranks[labels > 0.5].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def classification_metrics(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Binary: one logit per row."""
    probs = torch.sigmoid(logits.double())
    loss = float(torch.nn.functional.binary_cross_entropy_with_logits(logits.double(), labels.double()))
    return {"loss": loss, "log_loss": loss, "auc": auc(logits, labels),
            "accuracy": float(((probs > 0.5).double() == labels.double()).double().mean()),
            "positive_rate": float(labels.double().mean())}


def multiclass_metrics(logits: torch.Tensor, labels: torch.Tensor, classes: Sequence[str] | None = None
                       ) -> dict[str, Any]:
    """K logits per row; ``labels`` are class indices. Scalars plus ``per_class`` and ``confusion``."""
    k = logits.shape[1]
    classes = list(classes) if classes is not None else [str(i) for i in range(k)]
    target = labels.long().flatten()
    loss = float(torch.nn.functional.cross_entropy(logits.double(), target)) if target.numel() else float("nan")
    pred = logits.argmax(dim=1)
    confusion = torch.zeros(k, k, dtype=torch.int64)
    confusion.index_put_((target, pred), torch.ones_like(target), accumulate=True)
    tp = confusion.diag().double()
    predicted, actual = confusion.sum(0).double(), confusion.sum(1).double()
    precision = torch.where(predicted > 0, tp / predicted.clamp(min=1), torch.zeros_like(tp))
    recall = torch.where(actual > 0, tp / actual.clamp(min=1), torch.zeros_like(tp))
    f1 = torch.where(precision + recall > 0, 2 * precision * recall / (precision + recall).clamp(min=1e-12),
                     torch.zeros_like(tp))
    present = actual > 0  # macro-F1 over the classes that occur in these rows
    return {"loss": loss, "log_loss": loss,
            "accuracy": float(tp.sum() / max(target.numel(), 1)),
            "macro_f1": float(f1[present].mean()) if present.any() else float("nan"),
            "per_class": {c: {"precision": float(precision[i]), "recall": float(recall[i]),
                              "support": int(actual[i])} for i, c in enumerate(classes)},
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
    ``truncate_after(step)`` drops lines a resume replays. With a ``board``
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
        self.path.write_text("".join(json.dumps(r, default=float) + "\n" for r in kept))
        if self.board is not None:
            self.board.purge_after(step)

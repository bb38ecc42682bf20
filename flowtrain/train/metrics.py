"""Evaluation metrics (on whole tensors) and the run's metrics log (JSON lines)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


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
    probs = torch.sigmoid(logits.double())
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits.double(), labels.double())
    return {"loss": float(loss), "auc": auc(logits, labels),
            "accuracy": float(((probs > 0.5).double() == labels.double()).double().mean()),
            "positive_rate": float(labels.double().mean())}


def regression_metrics(pred: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
    err = pred.double() - target.double()
    mse = float((err ** 2).mean())
    return {"loss": mse, "rmse": mse ** 0.5, "mae": float(err.abs().mean())}


class MetricsLog:
    """Appends one JSON object per line; ``truncate_after(step)`` drops lines a resume replays."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record, default=float) + "\n")

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def truncate_after(self, step: int) -> None:
        kept = [r for r in self.read() if r.get("step", 0) <= step]
        self.path.write_text("".join(json.dumps(r, default=float) + "\n" for r in kept))

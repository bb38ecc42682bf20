"""Class weights (``--class-weight balanced|CLASS=W,...``): a classifier's loss weighs each example by its class, in
batch and stream training alike, and the validation and test metrics add the weighted ones.

- ``balanced``: each class weighs ``n / (K * n_k)`` (``n`` training rows, ``K`` classes, ``n_k`` of the class: the
  scikit-learn convention), so every class counts as much in the loss and the weights average 1 over the training
  rows; ``CLASS=W,...``: the classes named weigh ``W``, the others 1.
- The loss is the sum of ``w_y * loss`` over a batch's rows (``WeightedLoss``, reduction ``sum``): the map/reduce
  engine divides by the rows as ever, so N workers still equal one (the weights are per row, not per batch).
- ``weighted_metrics``: ``weighted_log_loss`` (the training objective) and ``weighted_accuracy`` (``sum w * right /
  sum w``; with ``balanced``, the balanced accuracy)."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

__all__ = ["class_weights", "class_weights_of", "WeightedLoss", "weighted_metrics"]


def class_weights(text: str | None, classes: Sequence[str] | None, counts: Sequence[int] | None,
                  task: str) -> np.ndarray | None:
    """Each class's weight, in the dataset's class order (None: no weights). A class that is no class of the
    training split, or weights for a regression, are a ValueError saying what to give."""
    if not text:
        return None
    if task != "classification" or not classes:
        raise ValueError("--class-weight weighs the classes of a classification label; this label is a regression "
                         "target (leave out --class-weight)")
    classes = [str(c) for c in classes]
    if text == "balanced":
        counts = np.asarray(counts if counts is not None else [], dtype=np.float64)
        if len(counts) != len(classes) or (counts <= 0).any():
            raise ValueError("--class-weight balanced needs every class's training count (the dataset's statistics "
                             "have none: run its ETL again)")
        return counts.sum() / (len(classes) * counts)
    weights = np.ones(len(classes))
    for pair in text.split(","):
        name, _, weight = pair.rpartition("=")
        name = name.strip()
        if name not in classes:
            raise ValueError(f"--class-weight {name}={weight}: {name!r} is not a class of the training split; the "
                             f"classes are {', '.join(classes)}")
        weights[classes.index(name)] = float(weight)
    return weights


def class_weights_of(config, data) -> torch.Tensor | None:
    """The class weights of a run's ``config`` (``class_weight``) for its dataset ``data`` (a ``TabularDataset``)."""
    found = class_weights(getattr(config, "class_weight", None), data.classes, data.stats.get("class_counts"),
                          data.spec.task)
    return None if found is None else torch.as_tensor(found, dtype=torch.float32)


class WeightedLoss(nn.Module):
    """The summed loss of a batch with each example weighed by its class (``weights``; None: 1) and by its own
    sample weight (``--weight-column``: then the target is ``[N, 2]``, the label and the row's weight): binary
    cross-entropy over one logit (``weights``: [negative, positive]), cross-entropy over K logits (the target is
    the class index, a float as datasets store labels), or with ``regression`` the squared error."""

    reduction = "sum"

    def __init__(self, weights: torch.Tensor | None, outputs: int, *, regression: bool = False):
        super().__init__()
        if weights is not None and regression:
            raise ValueError("class weights weigh the classes of a classification label, not a regression target")
        self.register_buffer("weights", None if weights is None else torch.as_tensor(weights, dtype=torch.float32))
        self.outputs, self.regression = int(outputs), bool(regression)

    def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        sample = None
        if target.dim() == 2:  # (label, sample weight) per row
            target, sample = target[:, 0], target[:, 1].to(output.dtype)
        if self.regression:
            per = (output - target.to(output.dtype)) ** 2
        elif self.outputs > 1:
            per = nn.functional.cross_entropy(output, target.long(), reduction="none")
        else:
            per = nn.functional.binary_cross_entropy_with_logits(output, target.to(output.dtype), reduction="none")
        if self.weights is not None:
            per = per * self.weights.to(output.device, output.dtype)[target.long()]
        if sample is not None:
            per = per * sample
        return per.sum()


def weighted_metrics(out: torch.Tensor, y: torch.Tensor, weights: torch.Tensor | None,
                     sample_weights: torch.Tensor | None = None, *, regression: bool = False) -> dict:
    """``weighted_log_loss`` and ``weighted_accuracy`` of classifier outputs (one logit, or K) against class indices
    ``y``, each row weighed by its class (``weights``) and its sample weight (``sample_weights``, ``--weight-column``);
    of a regression's outputs (``regression``; ``out`` and ``y`` in the label's units) ``weighted_rmse`` and
    ``weighted_mae``. Empty without weights (or rows, or a nonzero weight)."""
    if (weights is None and sample_weights is None) or len(y) == 0:
        return {}
    sample = None if sample_weights is None else sample_weights.double()
    if regression:  # weighed by the sample weights only
        if sample is None or not float(sample.sum()) > 0:
            return {}
        err = out.double() - y.double()
        total = float(sample.sum())
        return {"weighted_rmse": (float((err ** 2 * sample).sum()) / total) ** 0.5,
                "weighted_mae": float((err.abs() * sample).sum()) / total}
    index = y.long()
    w = weights.double()[index] if weights is not None else torch.ones(len(y), dtype=torch.float64)
    if sample is not None:
        w = w * sample
    if not float(w.sum()) > 0:
        return {}
    if out.dim() == 2:
        per = nn.functional.cross_entropy(out.double(), index, reduction="none")
        right = out.argmax(dim=1) == index
    else:
        per = nn.functional.binary_cross_entropy_with_logits(out.double(), y.double(), reduction="none")
        right = (out > 0).long() == index
    total = float(w.sum())
    return {"weighted_log_loss": float((per * w).sum()) / total, "weighted_accuracy": float((right.double() * w).sum())
            / total}


"""Issue 30 item 7: the validation metrics are the libraries' (AUC as ``scipy.stats.mannwhitneyu``'s U, equal to
scikit-learn's ``roc_auc_score``; scikit-learn's ``confusion_matrix``, per class as ``precision_recall_fscore_support``
defines it) and equal the hand-written formulas they replaced,
kept here as the oracle, on fixed inputs (ties, float32 logits, classes absent or never predicted)."""
from __future__ import annotations

import math

import pytest
import torch
from sklearn.metrics import precision_recall_fscore_support, roc_auc_score

from flowtrain.train.metrics import auc, classification_metrics, multiclass_metrics


def _old_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    scores, labels = scores.double().flatten(), labels.double().flatten()
    n_pos = float(labels.sum())
    n_neg = float(labels.numel() - n_pos)
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = torch.argsort(scores)
    sorted_scores = scores[order]
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, scores.numel() + 1, dtype=torch.float64)
    uniq, inverse, counts = torch.unique(sorted_scores, return_inverse=True, return_counts=True)
    if uniq.numel() != scores.numel():
        sums = torch.zeros(uniq.numel(), dtype=torch.float64).index_add_(
            0, inverse, torch.arange(1, scores.numel() + 1, dtype=torch.float64))
        ranks[order] = (sums / counts)[inverse]
    return float((ranks[labels > 0.5].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def _old_multiclass(logits: torch.Tensor, labels: torch.Tensor, classes=None) -> dict:
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
    present = actual > 0
    return {"loss": loss, "log_loss": loss, "accuracy": float(tp.sum() / max(target.numel(), 1)),
            "macro_f1": float(f1[present].mean()) if present.any() else float("nan"),
            "per_class": {c: {"precision": float(precision[i]), "recall": float(recall[i]),
                              "support": int(actual[i])} for i, c in enumerate(classes)},
            "confusion": confusion.tolist()}


def _same(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _same(a[key], b[key])
    elif isinstance(a, list):
        assert a == b
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b)
    else:
        assert a == pytest.approx(b, rel=1e-12, abs=1e-15), (a, b)


def test_auc_is_scikit_learns_and_equals_the_rank_sum_formula():
    g = torch.Generator().manual_seed(3)
    labels = (torch.rand(5000, generator=g) < 0.3).float()
    for logits in (torch.randn(5000, generator=g) + labels,                    # no ties
                   torch.round((torch.randn(5000, generator=g) + labels) * 4),  # many ties
                   (torch.randn(5000, 1, generator=g) + labels[:, None]).float()):  # float32 column
        assert auc(logits, labels) == pytest.approx(_old_auc(logits, labels), rel=1e-12)
        assert auc(logits, labels) == pytest.approx(roc_auc_score(labels.numpy() > 0.5, logits.flatten().numpy()),
                                                    rel=1e-12)
        assert classification_metrics(logits.flatten(), labels)["auc"] == auc(logits, labels)
    assert math.isnan(auc(torch.randn(10), torch.ones(10))) and math.isnan(auc(torch.randn(10), torch.zeros(10)))
    assert auc(torch.tensor([0.2, 0.2, 0.7, 0.1]), torch.tensor([1.0, 0.0, 1.0, 0.0])) == 0.875  # a tie counts half


def test_per_class_metrics_are_scikit_learns_and_equal_the_old_confusion_formulas():
    g = torch.Generator().manual_seed(4)
    n, k = 3000, 5
    labels = torch.randint(0, 4, (n,), generator=g)  # class 4 never occurs
    logits = torch.randn(n, k, generator=g)
    logits[:, 2] -= 10.0  # class 2 is never predicted
    logits[torch.arange(n), labels] += 1.0
    names = ["a", "b", "c", "d", "e"]
    new, old = multiclass_metrics(logits, labels, names), _old_multiclass(logits, labels, names)
    _same(new, old)
    precision, recall, f1, support = precision_recall_fscore_support(
        labels.numpy(), logits.argmax(1).numpy(), labels=list(range(k)), zero_division=0)
    for i, c in enumerate(names):
        assert new["per_class"][c] == pytest.approx({"precision": precision[i], "recall": recall[i],
                                                     "support": support[i]}, rel=1e-12)
    assert new["macro_f1"] == pytest.approx(f1[support > 0].mean(), rel=1e-12)
    assert new["per_class"]["c"]["precision"] == 0.0 and new["per_class"]["e"]["support"] == 0
    _same(multiclass_metrics(logits[:7], labels[:7]), _old_multiclass(logits[:7], labels[:7]))
    _same(multiclass_metrics(logits[:0], labels[:0]), _old_multiclass(logits[:0], labels[:0]))

"""Issue 45 item 7 (class weights): --class-weight balanced|CLASS=W,... weighs each example's loss by its class (the
batch run's and the online trainer's loss function), the map/reduce sum stays a sum over rows (so N workers equal
one), and the weighted metrics are what they say."""
from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch
from torch import nn

from flowtrain.train.class_weights import WeightedLoss, class_weights, weighted_metrics
from flowtrain.train.options import StreamTrainOptions, TrainOptions, class_weight_option
from flowtrain.train.trainer import loss_function


def test_balanced_weights_make_every_class_count_as_much_and_average_one():
    w = class_weights("balanced", ["no", "yes"], [900, 100], "classification")
    np.testing.assert_allclose(w, [1000 / 1800, 1000 / 200])
    assert w[0] * 900 == pytest.approx(w[1] * 100) and (w * [900, 100]).sum() == pytest.approx(1000)
    np.testing.assert_allclose(class_weights("yes=5", ["no", "yes"], None, "classification"), [1.0, 5.0])
    np.testing.assert_allclose(class_weights("b=2,c=0.5", ["a", "b", "c"], None, "classification"), [1, 2, 0.5])
    assert class_weights(None, ["no", "yes"], [1, 1], "classification") is None


def test_a_wrong_class_weight_says_what_to_give():
    with pytest.raises(ValueError, match="'maybe' is not a class of the training split; the classes are no, yes"):
        class_weights("maybe=2", ["no", "yes"], [5, 5], "classification")
    with pytest.raises(ValueError, match="regression target"):
        class_weights("balanced", None, None, "regression")
    for bad in ("yes=0", "yes=-1", "yes", "=3", "yes=nan"):
        with pytest.raises(argparse.ArgumentTypeError):
            class_weight_option(bad)
    assert class_weight_option("balanced") == "balanced"
    assert "class_weight" in TrainOptions.__dataclass_fields__ and "class_weight" in StreamTrainOptions.__dataclass_fields__


@pytest.mark.parametrize("outputs", [1, 3])
def test_the_weighted_loss_is_the_sum_of_each_examples_loss_times_its_class_weight(outputs):
    g = torch.Generator().manual_seed(0)
    n = 64
    out = torch.randn(n, generator=g) if outputs == 1 else torch.randn(n, outputs, generator=g)
    y = torch.randint(0, max(outputs, 2), (n,), generator=g).float()
    w = torch.tensor([0.5, 4.0] if outputs == 1 else [0.5, 4.0, 1.5])
    fn = loss_function("classification", outputs, w)
    if outputs == 1:
        per = nn.functional.binary_cross_entropy_with_logits(out, y, reduction="none")
    else:
        per = nn.functional.cross_entropy(out, y.long(), reduction="none")
    assert fn.reduction == "sum"
    torch.testing.assert_close(fn(out, y), (per * w[y.long()]).sum())
    # with all weights 1: the unweighted loss, summed (the map/reduce engines divide by the global rows)
    ones = loss_function("classification", outputs, torch.ones(len(w)))
    torch.testing.assert_close(ones(out, y), per.sum())
    # the sum over two shards is the sum over the whole: replicas' sums and counts reduce to one device's
    torch.testing.assert_close(fn(out[:20], y[:20]) + fn(out[20:], y[20:]), fn(out, y))


def test_weighted_metrics_balanced_accuracy_and_weighted_log_loss():
    y = torch.tensor([0.0] * 8 + [1.0] * 2)
    out = torch.tensor([-3.0] * 8 + [3.0, -3.0])  # every negative right, one positive of two
    w = torch.tensor([10 / 16, 10 / 4])  # balanced
    m = weighted_metrics(out, y, w)
    assert m["weighted_accuracy"] == pytest.approx((1.0 + 0.5) / 2)  # the balanced accuracy
    per = nn.functional.binary_cross_entropy_with_logits(out.double(), y.double(), reduction="none")
    weights = w.double()[y.long()]
    assert m["weighted_log_loss"] == pytest.approx(float((per * weights).sum() / weights.sum()))
    assert weighted_metrics(out, y, None) == {}


@pytest.mark.parametrize("outputs", [1, 3])
def test_the_linear_starts_weighted_objective_has_its_own_gradient(outputs):
    """The linear start (``fit_linear``'s L-BFGS) is fitted on the class-weighted loss too; its hand-written gradient
    is autograd's of the weighted objective."""
    from flowtrain.train.baselines import _Chunks, _objective
    from flowtrain.train.loader import TabularSplit
    from flowtrain.train.models import LinearModel

    g = torch.Generator().manual_seed(1)
    n, k = 50, max(outputs, 2)
    split = TabularSplit(torch.randn(n, 2, generator=g), torch.randint(0, 4, (n, 1), generator=g),
                         torch.randint(0, k, (n,), generator=g).float())
    model = LinearModel(2, [4], outputs).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3)
    w = torch.tensor([0.5, 3.0] if outputs == 1 else [0.5, 3.0, 1.25])
    scales = [torch.ones(4, dtype=torch.float64)]
    kind = "binary" if outputs == 1 else "multiclass"
    value = _objective(model, _Chunks(split, kind, 0.0, 1.0), kind, 0.0, scales, class_weights=w)
    hand = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    for p in model.parameters():
        p.grad = None
    with torch.enable_grad():
        out = model(split.x_num.double(), split.x_cat.long())
        loss = WeightedLoss(w.double(), outputs)(out, split.y.double()) / n
        loss.backward()
    assert value == pytest.approx(float(loss.detach()), rel=1e-10)
    for name, p in model.named_parameters():
        if name in hand and name != "numeric.bias":  # the numeric bias is the model's bias (its gradient zeroed)
            torch.testing.assert_close(hand[name], p.grad, rtol=1e-8, atol=1e-10)

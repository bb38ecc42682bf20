"""Baselines a model is compared with, on the same features and the same splits.

- ``majority``: the majority class (class frequencies of the training split as probabilities)
  or the training mean.
- ``fit_linear``: logistic regression (binary), softmax regression (K classes) or ridge
  regression, fitted to convergence: full-batch L-BFGS in float64 on the training split, with
  the L2 penalty scikit-learn uses by default (``C = 1`` / ``alpha = 1``: ``||w||^2 / (2n)``
  on the mean log loss, ``||w||^2 / n`` on the mean squared error), the bias not penalized.
  Categoricals are one-hot (a weight per category per output), numerics standardized by the ETL.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from torch import nn

from flowtrain.train.loader import TabularDataset
from flowtrain.train.model import LinearModel


@dataclass
class LinearFit:
    model: LinearModel
    iterations: int
    grad_norm: float  # of the penalized objective at the end (converged: ~0)
    objective: float
    l2: float
    seconds: float


@torch.no_grad()
def _objective(model: LinearModel, x_num: torch.Tensor, codes: torch.Tensor, kind: str, target: torch.Tensor,
               l2: float, scales: list[torch.Tensor], *, grads: bool = True) -> float:
    """The penalized mean loss; with ``grads`` each parameter's ``.grad`` is set to its gradient.

    The category weights are optimized preconditioned: ``model.categories[j].weight`` holds
    ``V`` and the weights are ``V * scales[j]`` (``1 / sqrt(frequency)`` of each category), which
    makes the curvature of rare and common categories alike, so L-BFGS converges in tens of
    iterations instead of hundreds. The gradient is written out instead of taken by autograd:
    for one-hot categories it is a scatter-add of the residuals (autograd's embedding backward
    sorts all N indices per call)."""
    n = max(target.shape[0], 1)
    weights = [emb.weight * s.unsqueeze(1) for emb, s in zip(model.categories, scales)]
    out = model.bias.expand(target.shape[0], model.outputs)
    if model.numeric is not None:
        out = out + model.numeric(x_num)
    for j, w in enumerate(weights):
        out = out + w[codes[:, j]]
    if kind == "binary":
        o = out[:, 0]
        loss = nn.functional.binary_cross_entropy_with_logits(o, target)
        residual = ((torch.sigmoid(o) - target) / n).unsqueeze(1)
    elif kind == "multiclass":
        logp = torch.log_softmax(out, dim=1)
        loss = nn.functional.nll_loss(logp, target.long())
        residual = logp.exp()
        residual[torch.arange(residual.shape[0]), target.long()] -= 1.0
        residual /= n
    else:
        o = out[:, 0]
        loss = ((o - target) ** 2).mean()
        residual = (2 * (o - target) / n).unsqueeze(1)
    loss = float(loss) + l2 * (sum(float((w ** 2).sum()) for w in weights)
                               + (float((model.numeric.weight ** 2).sum()) if model.numeric is not None else 0.0))
    if grads:
        model.bias.grad = residual.sum(0)
        if model.numeric is not None:
            model.numeric.weight.grad = residual.T @ x_num + 2 * l2 * model.numeric.weight
            model.numeric.bias.grad = torch.zeros_like(model.numeric.bias)
        for j, (emb, w, s) in enumerate(zip(model.categories, weights, scales)):
            grad_w = torch.zeros_like(w).index_add_(0, codes[:, j], residual) + 2 * l2 * w
            emb.weight.grad = grad_w * s.unsqueeze(1)
    return loss


def fit_linear(data: TabularDataset, *, l2: float | None = None, max_iter: int = 500, tolerance: float = 1e-5,
               seed: int = 0) -> LinearFit:
    """The linear model on the training split, to convergence (see the module docstring)."""
    t0 = time.perf_counter()
    train = data.split("train")
    n = max(len(train), 1)
    kind = data.kind
    if l2 is None:
        l2 = 1.0 / n if kind == "regression" else 1.0 / (2 * n)
    shift, scale = (float(data.stats["label_mean"]), float(data.stats.get("label_std", 1.0))) \
        if kind == "regression" else (0.0, 1.0)
    target = (train.y.double() - shift) / scale
    x_num, codes = train.x_num.double(), train.x_cat.long()
    torch.manual_seed(seed)
    model = LinearModel(data.n_numeric, data.cardinalities, data.outputs).double()
    with torch.no_grad():
        if model.numeric is not None:
            model.numeric.weight.zero_()
            model.numeric.bias.zero_()
        if kind == "binary":
            p = float(train.y.double().mean()) if len(train) else 0.5
            p = min(max(p, 1e-6), 1 - 1e-6)
            model.bias.fill_(math.log(p / (1 - p)))
        elif kind == "multiclass":
            counts = torch.bincount(train.y.long(), minlength=data.outputs).double() + 1e-3
            model.bias.copy_(torch.log(counts / counts.sum()))
        elif len(train):
            model.bias.fill_(float(target.mean()))
    scales = [(torch.bincount(codes[:, j], minlength=c).double() / n).clamp(min=1.0 / n).rsqrt()
              for j, c in enumerate(data.cardinalities)]
    opt = torch.optim.LBFGS(model.parameters(), lr=1.0, max_iter=max_iter, max_eval=max_iter * 2,
                            tolerance_grad=tolerance, tolerance_change=1e-10, history_size=20,
                            line_search_fn="strong_wolfe")

    def closure():
        return torch.tensor(_objective(model, x_num, codes, kind, target, l2, scales), dtype=torch.float64)

    threads = torch.get_num_threads()
    if len(train) * (data.n_numeric + len(data.cardinalities) + 1) * data.outputs <= 1 << 16:
        torch.set_num_threads(1)  # a small problem: more threads only wait for each other
    try:
        opt.step(closure)
    finally:
        torch.set_num_threads(threads)
    iterations = int(opt.state[opt._params[0]].get("n_iter", 0))
    objective = _objective(model, x_num, codes, kind, target, l2, scales)
    grad = math.sqrt(sum(float((p.grad ** 2).sum()) for p in model.parameters() if p.grad is not None))
    with torch.no_grad():
        for emb, scale in zip(model.categories, scales):  # V back to the weights themselves
            emb.weight.mul_(scale.unsqueeze(1))
    for p in model.parameters():
        p.grad = None
    return LinearFit(model.float(), iterations, grad, objective, l2, time.perf_counter() - t0)


def majority_outputs(data: TabularDataset, n: int) -> torch.Tensor:
    """The majority baseline's outputs for ``n`` rows: class-frequency logits or the training mean."""
    kind = data.kind
    if kind == "regression":
        return torch.full((n,), float(data.stats["label_mean"]))
    counts = torch.tensor([float(c) for c in data.stats.get("class_counts") or []], dtype=torch.float64)
    if kind == "binary":
        p = float(counts[1] / counts.sum()) if counts.numel() == 2 and counts.sum() > 0 \
            else float(data.stats["label_mean"])
        p = min(max(p, 1e-6), 1 - 1e-6)
        return torch.full((n,), math.log(p / (1 - p)))
    probs = (counts + 1e-9) / (counts + 1e-9).sum()
    return torch.log(probs).float().expand(n, -1).clone()

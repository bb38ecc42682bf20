"""Baselines a model is compared with, on the same features and the same splits.

- ``majority``: the majority class (class frequencies of the training split as probabilities)
  or the training mean.
- ``fit_linear``: logistic regression (binary), softmax regression (K classes) or ridge
  regression, fitted to convergence: full-batch L-BFGS in float64 on the training split (streamed
  in chunks, one pass per evaluation, when it does not fit ``--memory-budget``), with
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

from flowtrain.train.loader import TabularDataset, TabularSplit
from flowtrain.train.models import LinearModel


@dataclass
class LinearFit:
    model: LinearModel
    iterations: int
    grad_norm: float  # of the penalized objective at the end (converged: ~0)
    objective: float
    l2: float
    seconds: float


#: Rows per chunk when the training split is streamed (each L-BFGS evaluation is one pass).
STREAM_CHUNK_ROWS = 65_536


class _Chunks:
    """The training split as float64 chunks: one chunk held in memory, or a streamed split read
    sequentially on every pass (``flowtrain.train.shards``). Every pass sees every row once."""

    def __init__(self, split, kind: str, shift: float, scale: float):
        self.split, self.kind, self.shift, self.scale = split, kind, shift, scale
        self.n = len(split)
        self.streamed = not isinstance(split, TabularSplit)
        self._held = None if self.streamed else self._convert(split)

    def _convert(self, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(numerics, codes, the fitted target, the raw label, the sample weights or None) of one chunk."""
        return (batch.x_num.double(), batch.x_cat.long(), (batch.y.double() - self.shift) / self.scale,
                batch.y.double(), None if getattr(batch, "w", None) is None else batch.w.double())

    def __iter__(self):
        if not self.streamed:
            yield self._held
            return
        for batch in self.split.batches(batch_size=STREAM_CHUNK_ROWS, seed=0, epoch=0, shuffle=False):
            yield self._convert(batch)


@torch.no_grad()
def _objective(model: LinearModel, chunks: _Chunks, kind: str, l2: float, scales: list[torch.Tensor], *,
               grads: bool = True, class_weights: torch.Tensor | None = None) -> float:
    """The penalized mean loss over every chunk; with ``grads`` each parameter's ``.grad`` is set to
    its gradient (summed chunk by chunk, so a streamed split gives the full-batch objective).

    The category weights are optimized preconditioned: ``model.categories[j].weight`` holds
    ``V`` and the weights are ``V * scales[j]`` (``1 / sqrt(frequency)`` of each category), which
    makes the curvature of rare and common categories alike, so L-BFGS converges in tens of
    iterations instead of hundreds. The gradient is written out instead of taken by autograd:
    for one-hot categories it is a scatter-add of the residuals (autograd's embedding backward
    sorts all N indices per call). ``class_weights`` (``--class-weight``): a classifier's loss of each row
    weighed by its class, as the network's (``flowtrain.train.class_weights``); a chunk's sample weights
    (``--weight-column``, averaging 1 over the split) weigh each row's loss too."""
    n = max(chunks.n, 1)
    weights = [emb.weight * s.unsqueeze(1) for emb, s in zip(model.categories, scales)]
    total = 0.0
    g_bias = torch.zeros_like(model.bias)
    g_num = torch.zeros_like(model.numeric.weight) if model.numeric is not None else None
    g_cat = [torch.zeros_like(w) for w in weights]
    for x_num, codes, target, _, sample in chunks:
        out = model.bias.expand(target.shape[0], model.outputs)
        if model.numeric is not None:
            out = out + model.numeric(x_num)
        for j, w in enumerate(weights):
            out = out + w[codes[:, j]]
        w = class_weights.double()[target.long()].unsqueeze(1) if class_weights is not None and kind != "regression" \
            else None
        if sample is not None:
            w = sample.unsqueeze(1) if w is None else w * sample.unsqueeze(1)
        if kind == "binary":
            o = out[:, 0]
            per = nn.functional.binary_cross_entropy_with_logits(o, target, reduction="none")
            total += float(per.sum() if w is None else (per * w[:, 0]).sum())
            residual = ((torch.sigmoid(o) - target) / n).unsqueeze(1)
        elif kind == "multiclass":
            logp = torch.log_softmax(out, dim=1)
            per = nn.functional.nll_loss(logp, target.long(), reduction="none")
            total += float(per.sum() if w is None else (per * w[:, 0]).sum())
            residual = logp.exp()
            residual[torch.arange(residual.shape[0]), target.long()] -= 1.0
            residual /= n
        else:
            o = out[:, 0]
            per = (o - target) ** 2
            total += float(per.sum() if w is None else (per * w[:, 0]).sum())
            residual = (2 * (o - target) / n).unsqueeze(1)
        if w is not None:
            residual = residual * w
        if grads:
            g_bias += residual.sum(0)
            if g_num is not None:
                g_num += residual.T @ x_num
            for j, g in enumerate(g_cat):
                g.index_add_(0, codes[:, j], residual)
    loss = total / n + l2 * (sum(float((w ** 2).sum()) for w in weights)
                             + (float((model.numeric.weight ** 2).sum()) if model.numeric is not None else 0.0))
    if grads:
        model.bias.grad = g_bias
        if model.numeric is not None:
            model.numeric.weight.grad = g_num + 2 * l2 * model.numeric.weight
            model.numeric.bias.grad = torch.zeros_like(model.numeric.bias)
        for emb, w, s, g in zip(model.categories, weights, scales, g_cat):
            emb.weight.grad = (g + 2 * l2 * w) * s.unsqueeze(1)
    return loss


def fit_linear(data: TabularDataset, *, l2: float | None = None, max_iter: int = 500, tolerance: float = 1e-5,
               seed: int = 0, memory_budget: int | float | str | None = None,
               class_weights: torch.Tensor | None = None) -> LinearFit:
    """The linear model on the training split, to convergence (see the module docstring); with ``class_weights``
    (``--class-weight``) on the class-weighted loss the network trains on, so its linear start is weighed alike.

    A training split over ``memory_budget`` (``flowtrain.train.shards.open_split``) is not loaded:
    every evaluation of the objective streams it from its shards in chunks, which gives the same
    full-batch objective and gradient (one pass over the split per evaluation)."""
    from flowtrain.train.shards import open_split

    t0 = time.perf_counter()
    from flowtrain.train.loader import target_scale

    kind = data.kind
    shift, scale = target_scale(data)
    chunks = _Chunks(open_split(data, "train", memory_budget=memory_budget), kind, shift, scale)
    n = max(chunks.n, 1)
    if l2 is None:
        l2 = 1.0 / n if kind == "regression" else 1.0 / (2 * n)
    # one pass: category frequencies, the label's mean / class counts
    counts_cat = [torch.zeros(c, dtype=torch.float64) for c in data.cardinalities]
    label_sum, target_sum = 0.0, 0.0
    class_counts = torch.zeros(max(data.outputs, 1), dtype=torch.float64)
    for _, codes, target, y, _ in chunks:
        for j, c in enumerate(data.cardinalities):
            counts_cat[j] += torch.bincount(codes[:, j], minlength=c).double()
        label_sum += float(y.sum())
        target_sum += float(target.sum())
        if kind == "multiclass":
            class_counts += torch.bincount(y.long(), minlength=data.outputs).double()
    torch.manual_seed(seed)
    model = LinearModel(data.n_numeric, data.cardinalities, data.outputs).double()
    with torch.no_grad():
        if model.numeric is not None:
            model.numeric.weight.zero_()
            model.numeric.bias.zero_()
        if class_weights is not None and kind == "binary" and chunks.n:  # the weighted positive rate
            w = class_weights.double()
            label_sum = float(w[1] * label_sum / (w[1] * label_sum + w[0] * (chunks.n - label_sum)) * chunks.n)
        elif class_weights is not None and kind == "multiclass":
            class_counts = class_counts * class_weights.double()
        if kind == "binary":
            p = label_sum / chunks.n if chunks.n else 0.5
            p = min(max(p, 1e-6), 1 - 1e-6)
            model.bias.fill_(math.log(p / (1 - p)))
        elif kind == "multiclass":
            counts = class_counts + 1e-3
            model.bias.copy_(torch.log(counts / counts.sum()))
        elif chunks.n:
            model.bias.fill_(target_sum / chunks.n)
    scales = [(c / n).clamp(min=1.0 / n).rsqrt() for c in counts_cat]
    opt = torch.optim.LBFGS(model.parameters(), lr=1.0, max_iter=max_iter, max_eval=max_iter * 2,
                            tolerance_grad=tolerance, tolerance_change=1e-10, history_size=20,
                            line_search_fn="strong_wolfe")

    def closure():
        return torch.tensor(_objective(model, chunks, kind, l2, scales, class_weights=class_weights),
                            dtype=torch.float64)

    threads = torch.get_num_threads()
    if chunks.n * (data.n_numeric + len(data.cardinalities) + 1) * data.outputs <= 1 << 16:
        torch.set_num_threads(1)  # a small problem: more threads only wait for each other
    try:
        opt.step(closure)
    finally:
        torch.set_num_threads(threads)
    iterations = int(opt.state[opt._params[0]].get("n_iter", 0))
    objective = _objective(model, chunks, kind, l2, scales, class_weights=class_weights)
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

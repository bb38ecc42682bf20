"""Your own model for ``flowtrain batch --model examples.my_model:build`` (or ``flowtrain.batch(model=...)``).

A factory takes the table's ``ModelSpec`` (``flowtrain.train.models``) and returns a ``torch.nn.Module`` whose
``forward(x_num, x_cat)`` takes

- ``x_num``: float32 ``[N, spec.n_numeric]``, the standardized numeric columns in ``spec.numeric`` order,
- ``x_cat``: int64 ``[N, len(spec.categorical)]``, category codes (0 = not seen in training, below
  ``spec.cardinalities[i]``),

and returns ``[N]`` when ``spec.outputs == 1`` (a binary logit, or the standardized regression target) or
``[N, spec.outputs]`` (class logits). flowtrain trains it with the task's loss and metrics, with data
parallelism over ``--workers``, and writes it into the run's bundle by this factory's path (the module must
be importable where the bundle is loaded).

``build_sequential`` is the same idea as a ``PackedSequential``, which pipeline parallelism (``--stages``)
can cut into stages: its first layer takes ``[x_num | x_cat as floats]``.
"""
from __future__ import annotations

import torch
from torch import nn

from flowtrain.train.models import ModelSpec, PackedSequential


class SmallNet(nn.Module):
    """Embeddings of each categorical beside the numerics, one hidden layer."""

    def __init__(self, spec: ModelSpec, hidden: int = 32):
        super().__init__()
        self.embeddings = nn.ModuleList(nn.Embedding(c, 4) for c in spec.cardinalities)
        width = spec.n_numeric + 4 * len(spec.cardinalities)
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, spec.outputs))
        self.outputs = spec.outputs

    def forward(self, x_num: torch.Tensor, x_cat: torch.Tensor) -> torch.Tensor:
        parts = [x_num] + [emb(x_cat[:, i]) for i, emb in enumerate(self.embeddings)]
        out = self.mlp(torch.cat(parts, dim=1))
        return out.squeeze(1) if self.outputs == 1 else out


def build(spec: ModelSpec) -> nn.Module:
    return SmallNet(spec)


class _Embed(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.n = spec.n_numeric
        self.embeddings = nn.ModuleList(nn.Embedding(c, 4) for c in spec.cardinalities)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        codes = x[:, self.n:].long()
        return torch.cat([x[:, : self.n]] + [e(codes[:, i]) for i, e in enumerate(self.embeddings)], dim=1)


class _Squeeze(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.squeeze(1)


def build_sequential(spec: ModelSpec) -> nn.Module:
    width = spec.n_numeric + 4 * len(spec.cardinalities)
    layers = [_Embed(spec), nn.Linear(width, 32), nn.ReLU(), nn.Linear(32, spec.outputs)]
    return PackedSequential(*layers, *([_Squeeze()] if spec.outputs == 1 else []))

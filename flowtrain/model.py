"""Models for tabular data: embeddings + MLP, and the linear baseline on the same inputs."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn


def embedding_dim(cardinality: int) -> int:
    """A common rule of thumb (fast.ai): grows like the 0.56 power, capped at 32."""
    return int(min(32, max(2, round(1.6 * cardinality ** 0.56))))


class TabularMLP(nn.Module):
    """Categoricals embedded, numerics concatenated, then an MLP to one output (logit or value)."""

    def __init__(self, n_numeric: int, cardinalities: Sequence[int], *, hidden: Sequence[int] = (256, 128),
                 dropout: float = 0.1):
        super().__init__()
        self.embeddings = nn.ModuleList(nn.Embedding(c, embedding_dim(c)) for c in cardinalities)
        width = n_numeric + sum(e.embedding_dim for e in self.embeddings)
        layers: list[nn.Module] = []
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU(), nn.Dropout(dropout)]
            width = h
        layers.append(nn.Linear(width, 1))
        self.mlp = nn.Sequential(*layers)

    def forward(self, x_num: torch.Tensor, x_cat: torch.Tensor) -> torch.Tensor:
        parts = [x_num] + [emb(x_cat[:, i]) for i, emb in enumerate(self.embeddings)]
        return self.mlp(torch.cat(parts, dim=1)).squeeze(1)


class LinearModel(nn.Module):
    """Logistic / linear regression: a weight per numeric and per category (one-hot, as embeddings)."""

    def __init__(self, n_numeric: int, cardinalities: Sequence[int]):
        super().__init__()
        self.numeric = nn.Linear(n_numeric, 1) if n_numeric else None
        self.categories = nn.ModuleList(nn.Embedding(c, 1) for c in cardinalities)
        for emb in self.categories:
            nn.init.zeros_(emb.weight)
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, x_num: torch.Tensor, x_cat: torch.Tensor) -> torch.Tensor:
        out = self.bias.expand(x_cat.shape[0] if x_cat.numel() else x_num.shape[0]).clone()
        if self.numeric is not None:
            out = out + self.numeric(x_num).squeeze(1)
        for i, emb in enumerate(self.categories):
            out = out + emb(x_cat[:, i]).squeeze(1)
        return out

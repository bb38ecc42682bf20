"""Models for tabular data: embeddings + MLP, and the linear baseline on the same inputs."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn


def embedding_dim(cardinality: int) -> int:
    """A common rule of thumb (fast.ai): grows like the 0.56 power, capped at 32."""
    return int(min(32, max(2, round(1.6 * cardinality ** 0.56))))


def pack(x_num: torch.Tensor, x_cat: torch.Tensor) -> torch.Tensor:
    """One float tensor [numerics | category codes] so a model can be an ``nn.Sequential`` (and be
    cut into pipeline stages); codes stay exact as floats up to 2**24."""
    return torch.cat([x_num, x_cat.to(x_num.dtype)], dim=1)


class TabularInput(nn.Module):
    """Packed [numerics | codes] -> [numerics | embeddings of each categorical]."""

    def __init__(self, n_numeric: int, cardinalities: Sequence[int]):
        super().__init__()
        self.n_numeric = n_numeric
        self.embeddings = nn.ModuleList(nn.Embedding(c, embedding_dim(c)) for c in cardinalities)

    @property
    def out_features(self) -> int:
        return self.n_numeric + sum(e.embedding_dim for e in self.embeddings)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        codes = x[:, self.n_numeric:].long()
        parts = [x[:, :self.n_numeric]] + [emb(codes[:, i]) for i, emb in enumerate(self.embeddings)]
        return torch.cat(parts, dim=1)


class TabularMLP(nn.Sequential):
    """Categoricals embedded, numerics concatenated, then an MLP to one output (logit or value).

    An ``nn.Sequential`` (input layer, Linear/ReLU/Dropout blocks, output) so that pipeline
    parallelism can cut it into stages; ``model(x_num, x_cat)`` or ``model(packed)``.
    """

    def __init__(self, n_numeric: int, cardinalities: Sequence[int], *, hidden: Sequence[int] = (256, 128),
                 dropout: float = 0.1):
        inp = TabularInput(n_numeric, cardinalities)
        layers: list[nn.Module] = [inp]
        width = inp.out_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU(), nn.Dropout(dropout)]
            width = h
        layers += [nn.Linear(width, 1), nn.Flatten(0)]
        super().__init__(*layers)

    def forward(self, x_num: torch.Tensor, x_cat: torch.Tensor | None = None) -> torch.Tensor:
        x = x_num if x_cat is None else pack(x_num, x_cat)
        for layer in self:
            x = layer(x)
        return x


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

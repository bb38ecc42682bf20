"""Models for tabular data: wide-and-deep (the default), and the linear model on the same inputs.

Outputs: one value per row (a regression target or a binary logit), or K logits per row for
a K-class label (K > 2).

The default ``TabularMLP`` is wide and deep: a linear part (a weight per numeric and per
category, exactly ``LinearModel``) beside an MLP over the numerics and category embeddings,
their outputs added. It is an ``nn.Sequential`` whose layers carry the linear part's output
beside the MLP's activations (``[activations | wide]``), so pipeline parallelism can cut it
anywhere. ``init_wide`` loads a fitted ``LinearModel`` into the linear part; with the MLP's last
layer starting at zero the untrained model then predicts exactly what the linear model does,
and training only has to add what the MLP finds beyond it.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def embedding_dim(cardinality: int) -> int:
    """A common rule of thumb (fast.ai): grows like the 0.56 power, capped at 32."""
    return int(min(32, max(2, round(1.6 * cardinality ** 0.56))))


def pack(x_num: torch.Tensor, x_cat: torch.Tensor) -> torch.Tensor:
    """One float tensor [numerics | category codes] so a model can be an ``nn.Sequential`` (and be
    cut into pipeline stages); codes stay exact as floats up to 2**24."""
    return torch.cat([x_num, x_cat.to(x_num.dtype)], dim=1)


class LinearModel(nn.Module):
    """Logistic / softmax / linear regression: a weight per numeric and per category (one-hot, as
    embeddings), per output."""

    def __init__(self, n_numeric: int, cardinalities: Sequence[int], outputs: int = 1):
        super().__init__()
        self.outputs = outputs
        self.numeric = nn.Linear(n_numeric, outputs) if n_numeric else None
        self.categories = nn.ModuleList(nn.Embedding(c, outputs) for c in cardinalities)
        for emb in self.categories:
            nn.init.zeros_(emb.weight)
        self.bias = nn.Parameter(torch.zeros(outputs))

    def scores(self, x_num: torch.Tensor, x_cat: torch.Tensor) -> torch.Tensor:
        """``[N, outputs]``."""
        n = x_num.shape[0] if x_num.dim() == 2 and x_num.shape[0] else x_cat.shape[0]
        out = self.bias.expand(n, self.outputs)
        if self.numeric is not None:
            out = out + self.numeric(x_num)
        for i, emb in enumerate(self.categories):
            out = out + emb(x_cat[:, i])
        return out

    def forward(self, x_num: torch.Tensor, x_cat: torch.Tensor) -> torch.Tensor:
        out = self.scores(x_num, x_cat)
        return out.squeeze(1) if self.outputs == 1 else out


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


class WideDeepInput(nn.Module):
    """Packed [numerics | codes] -> [deep features | wide scores]: the MLP's input (numerics and
    embeddings) and the linear part's ``outputs`` scores, carried along to the head."""

    def __init__(self, n_numeric: int, cardinalities: Sequence[int], outputs: int):
        super().__init__()
        self.deep = TabularInput(n_numeric, cardinalities)
        self.wide = LinearModel(n_numeric, cardinalities, outputs)

    @property
    def out_features(self) -> int:
        return self.deep.out_features + self.wide.outputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.deep.n_numeric
        wide = self.wide.scores(x[:, :n], x[:, n:].long())
        return torch.cat([self.deep(x), wide], dim=1)


class Carry(nn.Module):
    """Applies ``inner`` to the activations and passes the last ``width`` columns (the wide
    scores) through unchanged."""

    def __init__(self, inner: nn.Module, width: int):
        super().__init__()
        self.inner, self.width = inner, width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # split, not slices: a slice's backward zero-fills the whole input first (measured: a fifth of a step)
        inner, carried = x.split([x.shape[1] - self.width, self.width], dim=1)
        return torch.cat([self.inner(inner), carried], dim=1)


class WideDeepHead(nn.Module):
    """[activations | wide scores] -> deep output + wide scores (squeezed for one output)."""

    def __init__(self, width: int, outputs: int):
        super().__init__()
        self.outputs = outputs
        self.linear = nn.Linear(width, outputs)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        deep, wide = x.split([x.shape[1] - self.outputs, self.outputs], dim=1)
        out = self.linear(deep) + wide
        return out.squeeze(1) if self.outputs == 1 else out


class TabularMLP(nn.Sequential):
    """Wide and deep: categoricals embedded, numerics concatenated, an MLP, plus the linear part.

    An ``nn.Sequential`` (input layer, Linear/ReLU/Dropout blocks, output) so that pipeline
    parallelism can cut it into stages; ``model(x_num, x_cat)`` or ``model(packed)``.
    ``outputs``: 1 (a regression target or a binary logit) or K (K-class logits).
    """

    def __init__(self, n_numeric: int, cardinalities: Sequence[int], *, hidden: Sequence[int] = (256, 128),
                 dropout: float = 0.1, outputs: int = 1):
        inp = WideDeepInput(n_numeric, cardinalities, outputs)
        layers: list[nn.Module] = [inp]
        width = inp.out_features - outputs
        for h in hidden:
            layers += [Carry(nn.Linear(width, h), outputs), Carry(nn.ReLU(), outputs),
                       Carry(nn.Dropout(dropout), outputs)]
            width = h
        layers.append(WideDeepHead(width, outputs))
        super().__init__(*layers)
        self.outputs = outputs

    @property
    def wide(self) -> LinearModel:
        return self[0].wide

    def describe(self) -> str:
        """The architecture in words (the report's)."""
        hidden = [m.inner.out_features for m in self if isinstance(m, Carry) and isinstance(m.inner, nn.Linear)]
        return (f"wide and deep: a linear part beside an MLP (hidden {', '.join(map(str, hidden))}) over the "
                f"{self[0].deep.n_numeric} numeric(s) as they are and embeddings of {len(self[0].deep.embeddings)} "
                f"categorical(s)")

    def init_wide(self, linear_state: dict) -> None:
        """Start the linear part from a fitted ``LinearModel``'s ``state_dict``."""
        self.wide.load_state_dict(linear_state)

    def forward(self, x_num: torch.Tensor, x_cat: torch.Tensor | None = None) -> torch.Tensor:
        x = x_num if x_cat is None else pack(x_num, x_cat)
        for layer in self:
            x = layer(x)
        return x

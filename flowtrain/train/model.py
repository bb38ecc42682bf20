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
        return torch.cat([self.inner(x[:, : x.shape[1] - self.width]), x[:, x.shape[1] - self.width:]], dim=1)


class WideDeepHead(nn.Module):
    """[activations | wide scores] -> deep output + wide scores (squeezed for one output)."""

    def __init__(self, width: int, outputs: int):
        super().__init__()
        self.outputs = outputs
        self.linear = nn.Linear(width, outputs)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x[:, : x.shape[1] - self.outputs]) + x[:, x.shape[1] - self.outputs:]
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

    def init_wide(self, linear_state: dict) -> None:
        """Start the linear part from a fitted ``LinearModel``'s ``state_dict``."""
        self.wide.load_state_dict(linear_state)

    def forward(self, x_num: torch.Tensor, x_cat: torch.Tensor | None = None) -> torch.Tensor:
        x = x_num if x_cat is None else pack(x_num, x_cat)
        for layer in self:
            x = layer(x)
        return x


# ---------------------------------------------------------------------------------------------
# Your own model: --model MODULE:FACTORY
# ---------------------------------------------------------------------------------------------
class PackedSequential(nn.Sequential):
    """An ``nn.Sequential`` over the packed input ``[x_num | x_cat as floats]`` that is also called as
    ``model(x_num, x_cat)``: what a ``--model`` factory returns for pipeline parallelism (``--stages``)."""

    def forward(self, x_num: torch.Tensor, x_cat: torch.Tensor | None = None) -> torch.Tensor:
        x = x_num if x_cat is None else pack(x_num, x_cat)
        for layer in self:
            x = layer(x)
        return x


class ModelSpec:
    """What a model factory gets: the inputs and outputs of the table's model.

    A factory ``(spec) -> nn.Module`` returns a module whose ``forward(x_num, x_cat)`` takes
    ``x_num``: float32 ``[N, n_numeric]`` (standardized numerics, in ``numeric`` order) and ``x_cat``:
    int64 ``[N, len(cardinalities)]`` (category codes, ``0`` = out of vocabulary, below the column's
    cardinality) and returns ``[N]`` (``outputs == 1``: a binary logit or a standardized regression
    value) or ``[N, outputs]`` (K-class logits). For pipeline parallelism (``--stages``) it returns an
    ``PackedSequential`` (an ``nn.Sequential`` whose first layer takes the packed
    ``[x_num | x_cat as floats]``, see ``pack``).
    """

    def __init__(self, numeric: Sequence[str], categorical: Sequence[str], cardinalities: Sequence[int],
                 outputs: int, task: str, classes: Sequence[str] | None = None):
        self.numeric, self.categorical = list(numeric), list(categorical)
        self.cardinalities, self.outputs, self.task = [int(c) for c in cardinalities], int(outputs), task
        self.classes = list(classes) if classes else None

    @property
    def n_numeric(self) -> int:
        return len(self.numeric)

    def to_dict(self) -> dict:
        return {"numeric": self.numeric, "categorical": self.categorical, "cardinalities": self.cardinalities,
                "outputs": self.outputs, "task": self.task, "classes": self.classes}

    @classmethod
    def from_dict(cls, d: dict) -> ModelSpec:
        return cls(d["numeric"], d["categorical"], d["cardinalities"], d["outputs"], d["task"], d.get("classes"))

    def __repr__(self) -> str:
        return f"ModelSpec({self.to_dict()})"


def load_factory(path: str):
    """``"module:function"`` -> the function; an error naming ``--model`` and what is wrong."""
    import importlib

    from flowtrain.errors import FlowtrainError

    module, sep, name = str(path).partition(":")
    if not sep or not module or not name:
        raise FlowtrainError(f"--model {path}: expected MODULE:FACTORY, e.g. examples.my_model:build")
    try:
        factory = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as err:
        raise FlowtrainError(f"--model {path}: cannot import {err.name} (is it on PYTHONPATH?)") from None
    except AttributeError:
        raise FlowtrainError(f"--model {path}: module {module} has no {name}") from None
    if not callable(factory):
        raise FlowtrainError(f"--model {path}: {name} is not a function (spec) -> nn.Module")
    return factory


def from_factory(path: str, spec: ModelSpec, seed: int = 0) -> nn.Module:
    """The module ``path``'s factory returns for ``spec`` (seeded, so every replica starts alike)."""
    from flowtrain.errors import FlowtrainError

    torch.manual_seed(seed)
    model = load_factory(path)(spec)
    if not isinstance(model, nn.Module):
        raise FlowtrainError(f"--model {path}: the factory returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def tabular_mlp(spec: ModelSpec, hidden: Sequence[int], dropout: float, seed: int = 0) -> TabularMLP:
    torch.manual_seed(seed)
    return TabularMLP(spec.n_numeric, spec.cardinalities, hidden=tuple(hidden), dropout=dropout,
                      outputs=spec.outputs)


def model_spec(data) -> ModelSpec:
    """The ``ModelSpec`` of a ``TabularDataset``."""
    return ModelSpec(data.spec.all_numeric, data.spec.categorical, data.cardinalities, data.outputs,
                     data.spec.task, data.classes)


def build_run_model(factory: str | None, data, config) -> nn.Module:
    """The model of a batch run: the user's ``factory`` (``--model``), else ``build_model("mlp")``."""
    if factory:
        return from_factory(factory, model_spec(data), config.seed)
    from flowtrain.train.loop import build_model

    return build_model("mlp", data, config)


def check_factory_parallelism(factory: str, data, config) -> None:
    """``--stages`` / ``--tensor-parallel`` with a model that is not an ``nn.Sequential``: an error naming them."""
    from flowtrain.errors import FlowtrainError

    model = from_factory(factory, model_spec(data), config.seed)
    if (config.stages > 1 or config.tensor_parallel > 1) and not isinstance(model, PackedSequential):
        raise FlowtrainError(f"--model {factory} returns a {type(model).__name__}, not a "
                             f"flowtrain.train.model.PackedSequential: --stages {config.stages} / --tensor-parallel "
                             f"{config.tensor_parallel} cut the model into stages, which needs an nn.Sequential over "
                             f"the packed input; return one, or "
                             f"leave out --stages and --tensor-parallel (data parallelism with --workers needs "
                             f"neither)")

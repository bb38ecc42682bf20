"""The user's model family: ``--model MODULE:FACTORY``, a function ``(ModelSpec) -> nn.Module``.

``ModelSpec`` is what a factory gets (the table's inputs and outputs); ``PackedSequential`` is what it returns
for pipeline or tensor parallelism (``--stages``, ``--tensor-parallel``). See docs/python-api.md and
examples/my_model.py.
"""
from __future__ import annotations

import importlib
from collections.abc import Sequence

import torch
from torch import nn

from flowtrain.errors import FlowtrainError
from flowtrain.train.models.ensemble import wide_and_deep
from flowtrain.train.models.tabular import TabularMLP, pack


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
    torch.manual_seed(seed)
    model = load_factory(path)(spec)
    if not isinstance(model, nn.Module):
        raise FlowtrainError(f"--model {path}: the factory returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def tabular_mlp(spec: ModelSpec, hidden: Sequence[int], dropout: float, seed: int = 0, *, ensemble: int = 1,
                numeric_embedding: int = 0) -> TabularMLP:
    """flowtrain's wide and deep for ``spec``: plain, or with the default recipe's ensemble of ``ensemble`` members
    and periodic numeric embeddings ``numeric_embedding`` wide (``flowtrain.train.models.ensemble``)."""
    torch.manual_seed(seed)
    return wide_and_deep(spec.n_numeric, spec.cardinalities, hidden=hidden, dropout=dropout, outputs=spec.outputs,
                         ensemble=ensemble, numeric_embedding=numeric_embedding)


def model_spec(data) -> ModelSpec:
    """The ``ModelSpec`` of a ``TabularDataset``."""
    return ModelSpec(data.spec.all_numeric, data.spec.categorical, data.cardinalities, data.outputs,
                     data.spec.task, data.classes)


def check_factory_parallelism(factory: str, data, config) -> None:
    """``--stages`` / ``--tensor-parallel`` with a model that is not an ``nn.Sequential``: an error naming them."""
    model = from_factory(factory, model_spec(data), config.seed)
    if (config.stages > 1 or config.tensor_parallel > 1) and not isinstance(model, PackedSequential):
        raise FlowtrainError(f"--model {factory} returns a {type(model).__name__}, not a "
                             f"flowtrain.train.models.PackedSequential: --stages {config.stages} / --tensor-parallel "
                             f"{config.tensor_parallel} cut the model into stages, which needs an nn.Sequential over "
                             f"the packed input; return one, or "
                             f"leave out --stages and --tensor-parallel (data parallelism with --workers needs "
                             f"neither)")

"""Model families in one registry, used by batch and stream (issue 30 item 5): ``flowtrain.train.models``
builds linear, wide-and-deep and the user's ``MODULE:FACTORY`` by name; the online trainer's ``Architecture``
builds through it; ``flowtrain.train.model`` is gone (no alias module) and ``flowtrain.train`` has no import
cycle (the model <-> loop and published <-> stream cycles ended; import-linter checks it too)."""
from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch

from flowtrain.errors import FlowtrainError
from flowtrain.train import models
from flowtrain.train.models import Architecture, LinearModel, ModelOptions, TabularMLP, build_model


def _data(id_columns=()):
    """What a model family reads of a ``TabularDataset``."""
    spec = SimpleNamespace(all_numeric=["a", "b"], categorical=["c"], id_columns=list(id_columns),
                           task="classification")
    return SimpleNamespace(n_numeric=2, cardinalities=[4], outputs=1, spec=spec, classes=["0", "1"])


def test_the_registry_builds_each_family_seeded():
    assert {"linear", "mlp"} <= set(models.model_families())
    assert isinstance(build_model("linear", _data(), ModelOptions()), LinearModel)
    a, b = (build_model("mlp", _data(), ModelOptions(hidden=(8,), seed=3)) for _ in range(2))
    assert isinstance(a, TabularMLP)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    with pytest.raises(FlowtrainError, match="model 'nope': not a model family"):
        build_model("nope", _data(), ModelOptions())


def test_the_users_factory_is_a_family_by_module_and_name():
    model = build_model("examples.my_model:build_sequential", _data(), ModelOptions())
    assert isinstance(model, models.PackedSequential)
    assert model(torch.zeros(3, 2), torch.zeros(3, 1, dtype=torch.int64)).shape[0] == 3
    with pytest.raises(FlowtrainError, match="--model examples.my_model:nothing: module examples.my_model has no"):
        build_model("examples.my_model:nothing", _data(), ModelOptions())


def test_a_registered_family_reaches_the_online_trainers_architecture():
    models.register_model("tiny-linear", lambda data, options: torch.nn.Linear(data.n_numeric, 1))
    try:
        arch = Architecture.from_dict({"kind": "tiny-linear"}, "test")
        assert isinstance(arch.build(_data()), torch.nn.Linear)
    finally:
        models._FAMILIES.pop("tiny-linear")
    mlp = Architecture.from_dict({"hidden": [8], "dropout": 0.0, "seed": 1}, "test").build(_data())
    assert isinstance(mlp, TabularMLP)


def test_the_old_model_module_is_gone_and_stream_and_published_share_the_architecture():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("flowtrain.train.model")
    from flowtrain.train import published
    from flowtrain.train.stream import config as stream_config

    assert stream_config.Architecture is published.Architecture is Architecture

"""Model families, one registry for batch and stream.

A family is a name and a builder ``(data, options) -> nn.Module`` (``register_model``): ``linear`` (the
``LinearModel``), ``mlp`` (wide and deep, ``TabularMLP``; beside ID tables when the dataset has ID columns,
``flowtrain.train.ids``), and the user's own, ``MODULE:FACTORY`` (``--model``: a function
``(ModelSpec) -> nn.Module``, ``factory``). ``build_model`` builds any of them seeded, so every replica and the
online trainer start alike; ``Architecture`` is the record a checkpoint or a published version carries to
build its model again.

Where a new model family goes: a module here with its builder, registered below (or, outside flowtrain, a
factory passed as ``--model MODULE:FACTORY``).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from flowtrain.errors import FlowtrainError
from flowtrain.parallel.deferred import deferred as deferred_build
from flowtrain.parallel.deferred import materialize
from flowtrain.train.models.ensemble import (
    FREQUENCY_SCALE,
    TabularEnsemble,
    choose_ensemble,
    choose_numeric_embedding,
    recipe_line,
    wide_and_deep,
)
from flowtrain.train.models.factory import (
    ModelSpec,
    PackedSequential,
    check_factory_parallelism,
    from_factory,
    load_factory,
    model_spec,
    tabular_mlp,
)
from flowtrain.train.models.ids import IdWideDeep
from flowtrain.train.models.skeleton import skeleton
from flowtrain.train.models.tabular import LinearModel, TabularMLP, embedding_dim, pack
from flowtrain.train.options import ModelOptions

ModelBuilder = Callable[..., nn.Module]  # (data: TabularDataset, options: ModelOptions) -> nn.Module
_FAMILIES: dict[str, ModelBuilder] = {}


def register_model(name: str, builder: ModelBuilder) -> None:
    """Make ``build_model(name, ...)`` build with ``builder(data, options)``."""
    if ":" in name:
        raise ValueError(f"model family {name!r}: a name without ':' (MODULE:FACTORY is the user's own)")
    _FAMILIES[name] = builder


def model_families() -> list[str]:
    return sorted(_FAMILIES)


def build_model(kind: str, data, options, *, deferred: bool = False) -> nn.Module:
    """The model of family ``kind`` (a registered name, or ``MODULE:FACTORY``) for the ``TabularDataset``
    ``data``, seeded with ``options.seed``. Built on the meta device and each parameter initialised from its own
    seed (``flowtrain.parallel.deferred``): the same values however it is materialised; ``deferred``: left on the
    meta device (a ZeRO-3 rank materialises only the slices it owns)."""
    if ":" not in kind and kind not in _FAMILIES:
        raise FlowtrainError(f"model {kind!r}: not a model family ({', '.join(model_families())}, or "
                             f"MODULE:FACTORY for your own)")

    def build() -> nn.Module:
        if ":" in kind:
            return from_factory(kind, model_spec(data), options.seed)
        torch.manual_seed(options.seed)
        return _FAMILIES[kind](data, options)
    model = deferred_build(build, options.seed)
    return model if deferred else materialize(model)


def build_run_model(factory: str | None, data, options, *, deferred: bool = False) -> nn.Module:
    """The model of a batch run: the user's ``factory`` (``--model``), else the ``mlp`` family."""
    return build_model(factory or "mlp", data, options, deferred=deferred)


def _linear(data, options) -> nn.Module:
    return LinearModel(data.n_numeric, data.cardinalities, data.outputs)


def _wide_and_deep(data, options) -> nn.Module:
    """Wide and deep (its linear part from ``options.init_wide`` when given: a batch run's ``TrainConfig``); with
    the dataset's ID columns, dynamic embedding tables beside it."""
    rows = train_rows(data)
    members = options.ensemble if options.ensemble is not None else choose_ensemble(rows)
    width = options.numeric_embedding if options.numeric_embedding is not None else choose_numeric_embedding(rows)
    recipe = {"ensemble": members, "numeric_embedding": width,
              "frequency_scale": getattr(options, "frequency_scale", FREQUENCY_SCALE)}
    if data.spec.id_columns:
        model = IdWideDeep(data.n_numeric, data.cardinalities, data.spec.id_columns, id_dim=options.id_dim,
                           hidden=options.hidden, dropout=options.dropout, outputs=data.outputs,
                           table={"min_count": options.min_id_count, "ttl": options.id_ttl,
                                  "max_ids": options.max_ids, "seed": options.seed}, **recipe)
    else:
        model = wide_and_deep(data.n_numeric, data.cardinalities, hidden=options.hidden, dropout=options.dropout,
                              outputs=data.outputs, **recipe)
    init_wide = getattr(options, "init_wide", None)  # ModelOptions alone (an Architecture's) has none
    if init_wide:
        model.init_wide(torch.load(init_wide, weights_only=True))
    return model


def train_rows(data) -> int:
    """The training rows of a ``TabularDataset`` (0 when it does not say: one member)."""
    return int(((getattr(data, "manifest", None) or {}).get("rows") or {}).get("train", 1 << 30))


def _recorded(record: dict, name: str, before: int) -> int | None:
    """A record's ``ensemble`` / ``numeric_embedding``: absent (written before the recipe) is ``before`` (one
    network, numerics as they are); None is the table's choice."""
    if name not in record:
        return before
    return None if record[name] is None else int(record[name])


register_model("linear", _linear)
register_model("mlp", _wide_and_deep)


@dataclass(frozen=True)
class Architecture:
    """What a trained model is: its family and the ``ModelOptions`` that shape it, as a checkpoint or a published
    version records them (``to_dict``) to build the same model again (``build``)."""
    kind: str
    hidden: tuple[int, ...]
    dropout: float
    seed: int
    source: str = "config"  # where it came from, for messages
    id_dim: int = 16  # the ID tables' width (a dataset with id_columns; flowtrain.train.ids)
    # the default recipe (flowtrain.train.models.ensemble); absent from a record: the plain wide and deep of
    # the runs before it; None: chosen from the table, as the batch run chose it
    ensemble: int | None = 1
    numeric_embedding: int | None = 0

    def to_dict(self) -> dict:
        out = {"kind": self.kind, "hidden": list(self.hidden), "dropout": self.dropout, "seed": self.seed}
        for name in ("id_dim", "ensemble", "numeric_embedding"):  # only when it differs: from_dict gives it back
            if getattr(self, name) != getattr(Architecture, name):
                out[name] = getattr(self, name)
        return out

    @classmethod
    def from_dict(cls, d: dict, source: str) -> Architecture:
        defaults = ModelOptions()
        return cls(kind=str(d.get("kind") or d.get("model") or "mlp"),
                   hidden=tuple(int(h) for h in d.get("hidden", defaults.hidden)),
                   dropout=float(d.get("dropout", defaults.dropout)), seed=int(d.get("seed", defaults.seed)),
                   source=source, id_dim=int(d.get("id_dim", defaults.id_dim)),
                   ensemble=_recorded(d, "ensemble", 1), numeric_embedding=_recorded(d, "numeric_embedding", 0))

    def build(self, data) -> nn.Module:
        """The same model the batch job builds for these settings (seeded: the same initial weights)."""
        return build_model(self.kind, data, ModelOptions(hidden=self.hidden, dropout=self.dropout, seed=self.seed,
                                                         id_dim=self.id_dim, ensemble=self.ensemble,
                                                         numeric_embedding=self.numeric_embedding))


__all__ = ["Architecture", "LinearModel", "ModelOptions", "ModelSpec", "PackedSequential", "TabularEnsemble",
           "TabularMLP", "build_model", "build_run_model", "check_factory_parallelism", "choose_ensemble",
           "choose_numeric_embedding",
           "embedding_dim", "from_factory", "load_factory", "model_families", "model_spec", "pack", "recipe_line",
           "register_model", "skeleton", "tabular_mlp", "train_rows"]

"""Tensor parallelism inside a layer, as in Megatron-LM, and the shard plan of an ``nn.Sequential``.

A column-parallel ``Linear`` (shard t holds rows [lo, hi) of the weight: a slice of the output
features) is paired with a row-parallel ``Linear`` (shard t holds the matching columns of its
weight: the same slice of its input features). Between them the activations stay sharded, so
elementwise layers (ReLU, Tanh, Dropout ...) run on the shards; the row layer's partial outputs
are summed by one all-reduce. Two conjugate autograd functions carry the communication:

- ``copy_to_tensor_group`` (Megatron's *f*): identity forward, all-reduce of the gradient backward;
- ``reduce_from_tensor_group`` (*g*): all-reduce forward, identity backward;

so a pair costs exactly one all-reduce in forward (g, after the row layer) and one in backward
(f, before the column layer) of ``batch x features`` each. Embedding tables are split by
vocabulary: shard t holds rows [lo, hi) of every table, looks up the codes it owns (zeros for
the others), and one all-reduce sums the partial embeddings of all tables.

Sizes that do not divide by T are handled: shards differ by at most one row or column
(``shard_bounds``), and the plan prints the sizes. A layer too small to give every shard a part
is an error that names it.

The plan is plain data (``ShardPlan``), made in one process, printable like the stage plan::

    | layer | module | role | split | per shard |
    | 1 | Linear(75->128) | column | output features | 64, 64 |
    | 2 | ReLU | on shards | | |
    | 4 | Linear(128->64) | row (1 all-reduce fwd) | input features | 64, 64 |

A layer that fails in the sharded module raises ``TensorParallelError`` with that plan and the
failing layer marked. ``ShardPlan.merge`` turns the shards' ``state_dict``s into the unsharded
model's, ``ShardPlan.shard_state`` cuts a full one into a shard's.

Dropout inside a pair draws the mask of the *full* width and keeps its shard's slice, and the
shards of a tensor group share their random state (the engine seeds them alike), so every
shard drops what one device would drop, and replicated layers get identical masks, inputs
and gradients on every shard.
"""
from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import nn

from flowtrain.parallel.mapreduce import shard_bounds
from flowtrain.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardedDropout,
    TensorGroup,
    VocabParallelEmbedding,
    VocabParallelTabularInput,
)

__all__ = ["ShardedSequential", "LayerShard", "ShardPlan", "plan_tensor_parallel", "shard_module",
           "TensorParallelError", "ELEMENTWISE"]

#: layers that act on each feature alone: they may run on a column-parallel layer's shards
ELEMENTWISE = (nn.ReLU, nn.Tanh, nn.GELU, nn.SiLU, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.Identity, nn.Dropout)


class TensorParallelError(RuntimeError):
    """A tensor-parallel layer (or plan) failed; the message shows the plan with it marked."""


# -- the plan ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LayerShard:
    """How one child of the ``nn.Sequential`` is split over T shards."""

    index: int
    name: str
    module: str  # e.g. "Linear(75->128)"
    role: str  # column, row, vocab, on shards, replicated
    split: str = ""  # what is split: "output features", "input features", "embedding rows"
    #: parameter (name inside the child) -> (dimension split, [lo, hi) of each shard)
    params: tuple[tuple[str, int, tuple[tuple[int, int], ...]], ...] = ()
    width: int = 0  # full width of the features a layer "on shards" sees
    targets: tuple[str, ...] = ()  # submodules replaced by their parallel form ("": the child itself)

    def sizes(self) -> str:
        if not self.params:
            return ""
        by_param = [", ".join(str(hi - lo) for lo, hi in ranges) for _, _, ranges in self.params]
        if self.role == "vocab":
            return " | ".join(by_param)
        return by_param[0]


@dataclass
class ShardPlan:
    tensor: int
    layers: list[LayerShard] = field(default_factory=list)

    def table(self, mark: int | None = None) -> str:
        """The plan as a Markdown table; ``mark`` (a layer index) flags a failing layer."""
        rows = [f"tensor parallel plan, T = {self.tensor}", "| layer | module | role | split | per shard |",
                "|---|---|---|---|---|"]
        for layer in self.layers:
            flag = ">> " if mark == layer.index else ""
            rows.append(f"| {flag}{layer.name} | {layer.module} | {layer.role} | {layer.split} | {layer.sizes()} |")
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.table()

    def sharded_params(self) -> dict[str, tuple[int, tuple[tuple[int, int], ...]]]:
        """Full parameter name -> (split dimension, each shard's [lo, hi))."""
        return {f"{layer.name}.{key}": (dim, ranges) for layer in self.layers for key, dim, ranges in layer.params}

    @property
    def all_reduces_per_step(self) -> tuple[int, int]:
        """(forward, backward) all-reduces a training step pays (T > 1)."""
        if self.tensor == 1:
            return 0, 0
        fwd = sum(1 for layer in self.layers if layer.role.startswith("row")) + \
            sum(len(layer.targets) for layer in self.layers if layer.role == "vocab")
        bwd = sum(1 for layer in self.layers if layer.role == "column")
        return fwd, bwd

    def shard_state(self, full: dict, shard: int) -> dict:
        """Shard ``shard``'s ``state_dict`` cut from the unsharded module's."""
        sharded = self.sharded_params()
        out = {}
        for key, value in full.items():
            if key in sharded:
                dim, ranges = sharded[key]
                lo, hi = ranges[shard]
                value = value.narrow(dim, lo, hi - lo)
            out[key] = value.clone()
        return out

    def merge(self, states: list[dict]) -> dict:
        """The unsharded module's ``state_dict`` from the T shards' (in shard order).

        Replicated parameters must be equal on every shard (they are, when training is right);
        a difference is an error, never silently resolved by taking one."""
        if len(states) != self.tensor:
            raise ValueError(f"merging a tensor-parallel state needs {self.tensor} shards, got {len(states)}")
        sharded = self.sharded_params()
        merged = {}
        for key, first in states[0].items():
            if key in sharded:
                merged[key] = torch.cat([s[key] for s in states], dim=sharded[key][0])
            else:
                for t, s in enumerate(states[1:], start=1):
                    if not torch.equal(s[key], first):
                        diff = float((s[key].double() - first.double()).abs().max()) \
                            if first.is_floating_point() else float("nan")
                        raise TensorParallelError(
                            f"replicated {key!r} differs between tensor shards 0 and {t} (max abs diff "
                            f"{diff:g}): the shards did not train alike\n{self.table()}")
                merged[key] = first
        return merged


def _core(module: nn.Module) -> tuple[str, nn.Module]:
    """The layer a child stands for: itself, or what a carrying wrapper applies.

    A wrapper is a module with an ``inner`` layer and an integer ``width`` that applies
    ``inner`` to its input's features but the last ``width`` and passes those through
    unchanged (``flowtrain.train.models.Carry``); it is split by its ``inner``."""
    path, core = "", module
    while (not isinstance(core, (nn.Linear, nn.Embedding, *ELEMENTWISE))
           and isinstance(getattr(core, "inner", None), nn.Module) and isinstance(getattr(core, "width", None), int)):
        path, core = (f"{path}.inner" if path else "inner"), core.inner
    return path, core


def _is_tabular_input(module: nn.Module) -> bool:
    """The tabular model's input layer (``flowtrain.train.models.TabularInput``): ``n_numeric``
    and a ``ModuleList`` of plain embeddings, over packed [numerics | codes]."""
    return (isinstance(getattr(module, "n_numeric", None), int)
            and isinstance(getattr(module, "embeddings", None), nn.ModuleList)
            and len(module.embeddings) > 0
            and all(isinstance(e, nn.Embedding) for e in module.embeddings)
            and not list(module.parameters(recurse=False)))


def _describe(module: nn.Module) -> str:
    path, core = _core(module)
    if path:
        return f"{type(module).__name__}({_describe(core)})"
    if isinstance(module, nn.Linear):
        return f"Linear({module.in_features}->{module.out_features})"
    if isinstance(module, nn.Embedding):
        return f"Embedding({module.num_embeddings}x{module.embedding_dim})"
    if isinstance(module, nn.Dropout):
        return f"Dropout({module.p})"
    if _is_tabular_input(module):
        return f"{type(module).__name__}({module.n_numeric} numeric, {len(module.embeddings)} tables)"
    inputs = [n for n, m in module.named_modules() if n and _is_tabular_input(m)]
    if inputs:
        return f"{type(module).__name__}({', '.join(inputs)}: {_describe(module.get_submodule(inputs[0]))})"
    return type(module).__name__


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def plan_tensor_parallel(model: nn.Sequential, tensor: int) -> ShardPlan:
    """Pair the ``Linear`` layers of ``model`` as column/row (Megatron's MLP split) and split
    embedding tables by vocabulary; everything else is replicated.

    A ``Linear`` (or a wrapper of one, see ``_core``) becomes a column layer when the next
    ``Linear`` follows after elementwise layers only (``ELEMENTWISE``); that one becomes its row
    layer. A ``Linear`` with no such partner (e.g. the output layer after a pair) stays
    replicated. Every tabular input layer (numerics + embedding tables, also inside a child) has
    its tables split by vocabulary, with one all-reduce for all of them.
    """
    if tensor < 1:
        raise ValueError(f"--tensor-parallel must be at least 1 (got {tensor})")
    children = list(model._modules.items())
    cores = [_core(child) for _, child in children]
    pairs: list[tuple[int, int]] = []
    open_column: int | None = None
    for i, (_path, core) in enumerate(cores):
        if isinstance(core, nn.Linear):
            if open_column is not None:
                pairs.append((open_column, i))
                open_column = None
            else:
                open_column = i
        elif not isinstance(core, ELEMENTWISE):
            open_column = None
    roles: dict[int, str] = {}
    inside: dict[int, int] = {}  # index of a layer between a pair -> the pair's hidden width
    for col, row in pairs:
        roles[col], roles[row] = "column", "row"
        width = cores[col][1].out_features
        if tensor > 1 and width < tensor:
            raise ValueError(f"cannot split layer {children[col][0]} ({_describe(children[col][1])}) over "
                             f"--tensor-parallel {tensor}: its {width} output feature(s) are fewer than the shards; "
                             f"use hidden sizes of at least {tensor} or a smaller --tensor-parallel")
        for j in range(col + 1, row):
            inside[j] = width

    def ranges(n: int) -> tuple[tuple[int, int], ...]:
        return tuple(shard_bounds(n, t, tensor) for t in range(tensor))

    layers: list[LayerShard] = []
    for i, (name, child) in enumerate(children):
        desc = _describe(child)
        path, core = cores[i]
        if tensor == 1:
            layers.append(LayerShard(i, name, desc, "replicated"))
        elif roles.get(i) == "column":
            r = ranges(core.out_features)
            params = ((_join(path, "weight"), 0, r),)
            if core.bias is not None:
                params += ((_join(path, "bias"), 0, r),)
            layers.append(LayerShard(i, name, desc, "column", "output features", params, targets=(path,)))
        elif roles.get(i) == "row":
            layers.append(LayerShard(i, name, desc, "row (1 all-reduce fwd)", "input features",
                                     ((_join(path, "weight"), 1, ranges(core.in_features)),), targets=(path,)))
        elif i in inside:
            dropout = isinstance(core, nn.Dropout)
            layers.append(LayerShard(i, name, desc, "on shards", width=inside[i], targets=(path,) if dropout else ()))
        elif isinstance(core, nn.Embedding) and not path:
            layers.append(LayerShard(i, name, desc, "vocab", "embedding rows",
                                     (("weight", 0, ranges(core.num_embeddings)),), targets=("",)))
        else:
            inputs = [n for n, m in child.named_modules() if _is_tabular_input(m)]
            inputs = [n for n in inputs if not any(n.startswith(o + ".") for o in inputs if o and o != n)]
            if inputs:
                params = tuple((_join(n, f"embeddings.{k}.weight"), 0, ranges(e.num_embeddings))
                               for n in inputs for k, e in enumerate(child.get_submodule(n).embeddings))
                layers.append(LayerShard(i, name, desc, "vocab", "embedding rows", params, targets=tuple(inputs)))
            else:
                layers.append(LayerShard(i, name, desc, "replicated"))
    return ShardPlan(tensor, layers)


class ShardedSequential(nn.Sequential):
    """A shard's layers (the model's child names kept); a failing layer raises
    ``TensorParallelError`` with the plan and that layer marked."""

    def __init__(self, layers: OrderedDict[str, nn.Module], plan: ShardPlan, tg: TensorGroup):
        super().__init__(layers)
        self.plan, self.tg = plan, tg

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer, module in zip(self.plan.layers, self):
            try:
                x = module(x)
            except TensorParallelError:
                raise
            except Exception as err:  # noqa: BLE001 - re-raised with the plan marked
                raise TensorParallelError(
                    f"tensor shard {self.tg.rank} of {self.tg.size} failed in layer {layer.name} ({layer.module}, "
                    f"{layer.role}): {type(err).__name__}: {err}\n{self.plan.table(mark=layer.index)}") from err
        return x


def _parallel_form(layer: LayerShard, target: nn.Module, tg: TensorGroup) -> nn.Module:
    if layer.role == "column":
        return ColumnParallelLinear.from_linear(target, tg)
    if layer.role.startswith("row"):
        return RowParallelLinear.from_linear(target, tg)
    if layer.role == "on shards":
        lo, hi = tg.split(layer.width)
        return ShardedDropout(target.p, layer.width, lo, hi)
    if isinstance(target, nn.Embedding):
        return VocabParallelEmbedding.from_embedding(target, tg)
    return VocabParallelTabularInput.from_module(target, tg)


def shard_module(model: nn.Sequential, plan: ShardPlan, tg: TensorGroup) -> ShardedSequential:
    """Shard ``tg.rank`` of ``model`` by ``plan``: new modules holding copies of its slices of
    the weights (``model`` is left as it is); the child names stay the model's, so the shard's
    ``state_dict`` keys are the unsharded keys."""
    if tg.size != plan.tensor:
        raise ValueError(f"the plan is for T = {plan.tensor}, the tensor group has {tg.size} shards")
    children = list(model._modules.items())
    if len(children) != len(plan.layers):
        raise ValueError(f"the plan has {len(plan.layers)} layers, the module {len(children)}")
    out: OrderedDict[str, nn.Module] = OrderedDict()
    for layer, (name, child) in zip(plan.layers, children):
        replace = {}
        for path in layer.targets:
            target = child.get_submodule(path) if path else child
            replace[id(target)] = _parallel_form(layer, target, tg)
        if "" in layer.targets:
            out[name] = replace[id(child)]
        else:  # a copy of the child with each target swapped for its parallel form (not copied first)
            out[name] = copy.deepcopy(child, memo=dict(replace))
    return ShardedSequential(out, plan, tg)

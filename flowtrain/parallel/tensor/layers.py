"""The tensor-parallel layers, as in Megatron-LM (the plan that places them: ``flowtrain.parallel.tensor.plan``).

A column-parallel ``Linear`` (shard t holds rows [lo, hi) of the weight: a slice of the output features) is paired
with a row-parallel ``Linear`` (shard t holds the matching columns of its weight: the same slice of its input
features); the row layer's partial outputs are summed by one all-reduce. Two conjugate autograd functions carry
the communication: ``copy_to_tensor_group`` (Megatron's *f*: identity forward, all-reduce of the gradient
backward) and ``reduce_from_tensor_group`` (*g*: all-reduce forward, identity backward). Embedding tables are
split by vocabulary (``VocabParallelEmbedding``, ``VocabParallelTabularInput``); ``ShardedDropout`` draws the mask
of the full width and keeps its shard's slice.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from flowtrain.parallel.mapreduce import shard_bounds

__all__ = ["TensorGroup", "copy_to_tensor_group", "reduce_from_tensor_group", "ColumnParallelLinear",
           "RowParallelLinear", "VocabParallelEmbedding", "VocabParallelTabularInput", "ShardedDropout"]


class TensorGroup:
    """This rank's tensor group: the process group, its shard index and T; counts the traffic
    (all-reduces and bytes), which the benchmark compares with the theory."""

    def __init__(self, group=None, rank: int = 0, size: int = 1):
        self.group, self.rank, self.size = group, rank, size
        self.all_reduces = 0
        self.bytes = 0

    def split(self, n: int) -> tuple[int, int]:
        return shard_bounds(n, self.rank, self.size)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        if self.size == 1:
            return
        dist.all_reduce(tensor, group=self.group)
        self.all_reduces += 1
        self.bytes += tensor.numel() * tensor.element_size()


class _CopyToTensorGroup(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, tg):
        ctx.tg = tg
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        ctx.tg.all_reduce(grad)
        return grad, None


class _ReduceFromTensorGroup(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, tg):
        if x.is_contiguous() and not x._is_view():  # a fresh result (a matmul's): reduce it in place
            ctx.mark_dirty(x)
            tg.all_reduce(x)
            return x
        out = x.contiguous().clone()
        tg.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tensor_group(x: torch.Tensor, tg: TensorGroup) -> torch.Tensor:
    return x if tg.size == 1 else _CopyToTensorGroup.apply(x, tg)


def reduce_from_tensor_group(x: torch.Tensor, tg: TensorGroup) -> torch.Tensor:
    return x if tg.size == 1 else _ReduceFromTensorGroup.apply(x, tg)


class ColumnParallelLinear(nn.Module):
    """Output features [lo, hi) of a ``Linear``; the output stays sharded."""

    def __init__(self, in_features: int, out_features: int, tg: TensorGroup, *, bias: bool = True):
        super().__init__()
        self.in_features, self.out_features, self.tg = in_features, out_features, tg
        self.lo, self.hi = tg.split(out_features)
        self.weight = nn.Parameter(torch.empty(self.hi - self.lo, in_features))
        self.bias = nn.Parameter(torch.empty(self.hi - self.lo)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, tg: TensorGroup) -> ColumnParallelLinear:
        layer = cls(linear.in_features, linear.out_features, tg, bias=linear.bias is not None)
        with torch.no_grad():
            layer.weight = nn.Parameter(linear.weight[layer.lo:layer.hi].detach().clone())
            if linear.bias is not None:
                layer.bias = nn.Parameter(linear.bias[layer.lo:layer.hi].detach().clone())
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tensor_group(x, self.tg), self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_features}->{self.out_features}, shard {self.tg.rank}/{self.tg.size}: out[{self.lo}:{self.hi}]"


class RowParallelLinear(nn.Module):
    """Input features [lo, hi) of a ``Linear``: partial outputs summed by one all-reduce; the
    bias (replicated) is added once, after it."""

    def __init__(self, in_features: int, out_features: int, tg: TensorGroup, *, bias: bool = True):
        super().__init__()
        self.in_features, self.out_features, self.tg = in_features, out_features, tg
        self.lo, self.hi = tg.split(in_features)
        self.weight = nn.Parameter(torch.empty(out_features, self.hi - self.lo))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, tg: TensorGroup) -> RowParallelLinear:
        layer = cls(linear.in_features, linear.out_features, tg, bias=linear.bias is not None)
        with torch.no_grad():
            layer.weight = nn.Parameter(linear.weight[:, layer.lo:layer.hi].detach().clone())
            if linear.bias is not None:
                layer.bias = nn.Parameter(linear.bias.detach().clone())
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = reduce_from_tensor_group(F.linear(x, self.weight), self.tg)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"{self.in_features}->{self.out_features}, shard {self.tg.rank}/{self.tg.size}: in[{self.lo}:{self.hi}]"


class VocabParallelEmbedding(nn.Module):
    """Rows [lo, hi) of an embedding table; codes outside them look up zeros, and one
    all-reduce sums the shards' partial lookups."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tg: TensorGroup):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.tg = num_embeddings, embedding_dim, tg
        self.lo, self.hi = tg.split(num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.hi - self.lo, embedding_dim))

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, tg: TensorGroup) -> VocabParallelEmbedding:
        if emb.padding_idx is not None or emb.max_norm is not None or emb.sparse:
            raise ValueError("vocabulary-parallel embeddings take plain tables (no padding_idx, max_norm, sparse)")
        layer = cls(emb.num_embeddings, emb.embedding_dim, tg)
        with torch.no_grad():
            layer.weight = nn.Parameter(emb.weight[layer.lo:layer.hi].detach().clone())
        return layer

    def local_lookup(self, codes: torch.Tensor) -> torch.Tensor:
        """This shard's part of the lookup (no communication)."""
        if self.hi == self.lo:  # a vocabulary smaller than T: this shard owns no rows
            return self.weight.new_zeros(*codes.shape, self.embedding_dim)
        local = codes - self.lo
        outside = (local < 0) | (local >= self.hi - self.lo)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return out.masked_fill(outside.unsqueeze(-1), 0.0)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        return reduce_from_tensor_group(self.local_lookup(codes), self.tg)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}x{self.embedding_dim}, shard {self.tg.rank}/{self.tg.size}: "
                f"rows[{self.lo}:{self.hi}]")


class VocabParallelTabularInput(nn.Module):
    """The tabular model's input layer (packed [numerics | codes] -> [numerics | embeddings],
    ``flowtrain.train.models.TabularInput``) with every table split by vocabulary and one
    all-reduce for all tables together."""

    def __init__(self, n_numeric: int, tables: list[VocabParallelEmbedding], tg: TensorGroup):
        super().__init__()
        self.n_numeric, self.tg = n_numeric, tg
        self.embeddings = nn.ModuleList(tables)

    @classmethod
    def from_module(cls, module: nn.Module, tg: TensorGroup) -> VocabParallelTabularInput:
        return cls(module.n_numeric, [VocabParallelEmbedding.from_embedding(e, tg) for e in module.embeddings], tg)

    @property
    def out_features(self) -> int:
        return self.n_numeric + sum(e.embedding_dim for e in self.embeddings)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        codes = x[:, self.n_numeric:].long()
        if not len(self.embeddings):
            return x[:, :self.n_numeric]
        parts = [emb.local_lookup(codes[:, i]) for i, emb in enumerate(self.embeddings)]
        embedded = reduce_from_tensor_group(torch.cat(parts, dim=1), self.tg)
        return torch.cat([x[:, :self.n_numeric], embedded], dim=1)


class ShardedDropout(nn.Module):
    """Dropout on a shard of ``full_width`` features: the mask is drawn for the full width (the
    same random numbers one device would use) and sliced, so shards stay consistent."""

    def __init__(self, p: float, full_width: int, lo: int, hi: int):
        super().__init__()
        self.p, self.full_width, self.lo, self.hi = p, full_width, lo, hi

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.p >= 1.0:
            return x * 0.0
        keep = torch.empty(*x.shape[:-1], self.full_width, dtype=x.dtype, device=x.device).bernoulli_(1 - self.p)
        return x * keep[..., self.lo:self.hi] / (1 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, features[{self.lo}:{self.hi}] of {self.full_width}"

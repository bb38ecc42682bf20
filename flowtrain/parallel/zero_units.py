"""The per-unit flat-shard machinery of ``flowtrain.parallel.zero``: which layers a stage shards together
(``shard_units``), a unit's parameters as views of one flat buffer padded to a multiple of N with this
rank's shard and optimizer pieces (``ShardUnit``), ZeRO-3's regather before a unit's backward
(``RegatherBeforeBackward``, ``wrap_output``), and the byte counts the memory reports use
(``storage_bytes``, ``peak_rss_bytes``).
"""
from __future__ import annotations

import resource

import torch
import torch.distributed as dist
from torch import nn

from flowtrain.parallel.mapreduce import size_buckets

__all__ = ["RegatherBeforeBackward", "ShardUnit", "Works", "peak_rss_bytes", "per_rank_collectives", "shard_units",
           "storage_bytes", "wrap_output"]


def per_rank_collectives(group) -> bool:
    """Whether ``group``'s reduce-scatter and all-gather are faster as one reduce / broadcast per rank's slice,
    issued together: on gloo (CPU) with 2 ranks. Measured on this project's 2-core machine, 1 M floats, 2 ranks:
    a reduce-scatter 7.5 ms (gloo's is an all-reduce and a copy inside: all_reduce 5.8 ms) against 4.6 ms as two
    reduces, an all-gather 4.9 ms against 3.1 ms as two broadcasts; ``bench memory``: ZeRO-1 0.79x -> 0.90x plain
    DP's speed. With 4 ranks the reduces were no faster and ZeRO-3's per-layer gathers slower (8 small collectives
    a layer), so gloo's own collectives stay there, as NCCL's do everywhere."""
    return (dist.is_initialized() and dist.get_world_size(group) == 2 and dist.get_backend(group) == "gloo")


class Works:
    """Several async collectives as one handle."""

    def __init__(self, works: list):
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def shard_units(module: nn.Module, stage: str, bucket_mb: float = 1.0) -> list[tuple[list[nn.Module], list[nn.Parameter]]]:
    """The units a stage shards, in forward order: (their modules, their trainable parameters).

    ZeRO-3 (``parameters``): one unit per layer (a root's own parameters, then each top-level child
    with parameters), gathered for its forward and backward. ZeRO-1/2: consecutive layers merged into
    buckets of up to ``bucket_mb`` (filled from the last layer, as the map/reduce's buckets are; a layer
    is never split), so a step costs one reduce-scatter and one all-gather per bucket, not per layer."""
    layers: list[tuple[list[nn.Module], list[nn.Parameter]]] = []
    own = [p for p in module.parameters(recurse=False) if p.requires_grad]
    if own:
        layers.append(([module], own))
    for child in module.children():
        params = [p for p in child.parameters() if p.requires_grad]
        if params:
            layers.append(([child], params))
    if stage == "parameters":
        return layers
    buckets = size_buckets(list(reversed(layers)), lambda layer: sum(p.numel() * p.element_size() for p in layer[1]),
                           bucket_mb)
    return [([m for mods, _ in reversed(b) for m in mods], [p for _, ps in reversed(b) for p in ps])
            for b in reversed(buckets)]


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view counts its storage once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        key = (s.data_ptr(), s.nbytes()) if s.nbytes() else None
        if key is None or key in seen:
            continue
        seen.add(key)
        total += s.nbytes()
    return total


def peak_rss_bytes() -> int:
    """The process's peak resident set size (Linux reports KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class ShardUnit:
    """One layer's parameters as views of a flat buffer padded to a multiple of ``world``."""

    def __init__(self, index: int, params: list[nn.Parameter], rank: int, world: int, device,
                 flat_grad: bool = False, per_rank: bool = False):
        self.index, self.params = index, params
        self.world, self.per_rank = world, per_rank  # per_rank: per_rank_collectives
        self.sizes = [p.numel() for p in params]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(params))]
        self.numel = sum(self.sizes)
        self.shard_numel = -(-self.numel // world)  # ceil: the last shard is padded
        self.padded = self.shard_numel * world
        self.lo = rank * self.shard_numel
        self.full = torch.zeros(self.padded, dtype=torch.float32, device=device)
        with torch.no_grad():
            for p, off, n in zip(params, self.offsets, self.sizes):
                self.full[off:off + n].copy_(p.detach().reshape(-1))
                p.data = self.full[off:off + n].view_as(p)
        self.views = [p.data for p in params]
        self.empty = torch.empty(0, dtype=torch.float32, device=device)
        self.shard = self.full[self.lo:self.lo + self.shard_numel].clone()
        self.grad_shard = torch.zeros(self.shard_numel, dtype=torch.float32, device=device)
        self.grad_buffer: torch.Tensor | None = None
        self.reduced: torch.Tensor | None = None  # per-rank reduces in flight into this buffer
        # ZeRO-1 keeps whole gradients: as views of one flat buffer that autograd accumulates into and the
        # reduce-scatter reads directly (no copy, no allocation per step)
        self.flat_grad = torch.zeros(self.padded, dtype=torch.float32, device=device) if flat_grad else None
        self.grad_views = [self.flat_grad[off:off + n].view_as(p) for p, off, n in zip(params, self.offsets, self.sizes)] \
            if flat_grad else []
        # pieces: (parameter index in the unit, its elements [a, b) of the parameter, view of the shard)
        self.pieces: list[tuple[int, int, int, torch.Tensor]] = []
        for i, (off, n) in enumerate(zip(self.offsets, self.sizes)):
            a, b = max(off, self.lo), min(off + n, self.lo + self.shard_numel)
            if b > a:
                self.pieces.append((i, a - off, b - off, self.shard[a - self.lo:b - self.lo]))
        self.pending = len(params)
        self.handle = None
        self.gathered = True

    def reduce_to_owners(self, buf: torch.Tensor, group) -> Works:
        """Each rank's slice of ``buf`` summed on that rank (``per_rank``: one reduce per slice, issued
        together); ``grad_shard_from`` takes this rank's sum when they are done."""
        n = self.shard_numel
        self.reduced = buf
        return Works([dist.reduce(buf[r * n:(r + 1) * n], group=group, group_dst=r, async_op=True)
                      for r in range(self.world)])

    def grad_shard_from_reduced(self) -> None:
        if self.reduced is not None:
            self.grad_shard.copy_(self.reduced[self.lo:self.lo + self.shard_numel])
            self.reduced = None

    # -- parameter storage (ZeRO-3) -----------------------------------------------------------------
    def free_params(self) -> None:
        """Free the unit's storage; its parameters become empty tensors (a use of one between steps is a
        shape error, never a read of freed memory), autograd's saved views keep the (empty) storage."""
        self.full.untyped_storage().resize_(0)
        for p in self.params:
            p.data = self.empty
        self.gathered = False

    def gather_params(self, group) -> None:
        if not self.gathered:
            self.full.untyped_storage().resize_(self.padded * self.full.element_size())
        if self.per_rank:  # each rank's slice broadcast by its owner, all issued together
            n = self.shard_numel
            with torch.no_grad():
                self.full[self.lo:self.lo + n].copy_(self.shard)
            Works([dist.broadcast(self.full[r * n:(r + 1) * n], group=group, group_src=r, async_op=True)
                   for r in range(self.world)]).wait()
        elif dist.is_initialized():
            dist.all_gather_single(self.full, self.shard, group=group)
        else:  # one rank: the shard is the whole
            with torch.no_grad():
                self.full.copy_(self.shard)
        for p, view in zip(self.params, self.views):
            p.data = view
        self.gathered = True


class RegatherBeforeBackward(torch.autograd.Function):
    """Identity on a unit's output whose backward gathers the unit's parameters (ZeRO-3)."""

    @staticmethod
    def forward(ctx, sharder, unit, x):
        ctx.sharder, ctx.unit = sharder, unit
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.unit.gathered:
            ctx.unit.gather_params(ctx.sharder.group)
        return None, None, grad


def wrap_output(output, fn):
    """``fn`` applied to each tensor of a module's output that requires a gradient (tuples and lists kept)."""
    if torch.is_tensor(output):
        return fn(output) if output.requires_grad else output
    if isinstance(output, tuple):
        return tuple(wrap_output(o, fn) for o in output)
    if isinstance(output, list):
        return [wrap_output(o, fn) for o in output]
    return output

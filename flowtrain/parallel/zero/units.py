"""The per-unit flat-shard machinery of ``flowtrain.parallel.zero.sharder``: which layers a stage shards together
(``shard_units``), a unit's parameters as views of one flat buffer padded to a multiple of N with this
rank's shard and optimizer pieces (``ShardUnit``), how its reduce-scatter and all-gather run on a group
(``choose_collectives``), ZeRO-3's regather before a unit's backward
(``RegatherBeforeBackward``, ``wrap_output``), and the byte counts the memory reports use
(``storage_bytes``, ``peak_rss_bytes``).
"""
from __future__ import annotations

import resource
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from flowtrain.parallel.deferred import Materializer, swap_in_placeholder
from flowtrain.parallel.mapreduce import size_buckets

__all__ = ["GATHER_WAYS", "GLOO_COLLECTIVES", "REDUCE_WAYS", "RegatherBeforeBackward", "ShardUnit", "Works",
           "ZeroCollectives", "choose_collectives", "peak_rss_bytes", "shard_units", "storage_bytes", "wrap_output"]


#: How ZeRO reduce-scatters a unit's gradients (``ZeroCollectives``): ``native``, the backend's
#: ``reduce_scatter_single``; ``all_to_all``, one ``all_to_all_single`` (each rank sends slice j to rank j) and the
#: sum of the N slices received, when the collective is waited on.
REDUCE_WAYS = ("native", "all_to_all")
#: How ZeRO all-gathers a unit's parameters: ``native``, the backend's ``all_gather_single``; ``per_rank``, one
#: ``broadcast`` per rank's slice from its owner, issued together; ``all_to_all``, one ``all_to_all_single`` of the
#: shard repeated N times (each rank sends its shard to every rank).
GATHER_WAYS = ("native", "per_rank", "all_to_all")


@dataclass(frozen=True)
class ZeroCollectives:
    """The way (``REDUCE_WAYS``, ``GATHER_WAYS``) of each of ZeRO's collectives on one group: the reduce-scatter
    of the gradients, the all-gather of a ZeRO-1/2 bucket after the step, the all-gather of a ZeRO-3 layer before
    its forward and its backward (smaller and more of them)."""

    reduce_scatter: str = "native"
    bucket_gather: str = "native"
    layer_gather: str = "native"

    def gather(self, stage: str) -> str:
        """The all-gather's way for ``stage``'s units (ZeRO-3: layers; ZeRO-1/2: buckets)."""
        return self.layer_gather if stage == "parameters" else self.bucket_gather


#: gloo's choice by number of ranks (``choose_collectives``); more ranks than listed: the largest's
GLOO_COLLECTIVES = {
    2: ZeroCollectives(reduce_scatter="all_to_all", bucket_gather="per_rank", layer_gather="per_rank"),
    3: ZeroCollectives(reduce_scatter="all_to_all", bucket_gather="per_rank", layer_gather="per_rank"),
    4: ZeroCollectives(reduce_scatter="all_to_all", bucket_gather="per_rank", layer_gather="all_to_all"),
}


def choose_collectives(group) -> ZeroCollectives:
    """ZeRO's collectives on ``group``: the backend's own on NCCL (and without a process group); on gloo (CPU)
    ``GLOO_COLLECTIVES``, the fastest measured per N, because gloo's reduce-scatter is an all-reduce and a copy
    inside (ZeRO paid an all-reduce and an all-gather where plain data parallelism pays one all-reduce).

    Measured on this project's 2-core machine (2026-12-02, shared: load average 2-7), ms per collective, the
    median of 5 interleaved rounds of 10-20, float32, 1 thread per rank, 1-3 runs (a range); 1.05 M floats is
    ``bench memory``'s ZeRO-1/2 bucket, 263 K one of its ZeRO-3 layers; plain DP's all-reduce for scale:

    - N = 2, 1.05 M: all-reduce 5.7-6.9; reduce-scatter native 7.1-8.6, per-rank reduces 3.9-5.3, all-to-all
      2.4-4.3; all-gather native 3.6-5.4, per-rank broadcasts 2.6-3.3, all-to-all 3.4-4.4
    - N = 2, 263 K: all-reduce 1.5-1.9; reduce-scatter 2.3-3.2 / 1.4-2.2 / 1.3-1.4; all-gather 1.2-1.9 /
      1.2-1.4 / 2.0-2.1
    - N = 3, 1.05 M: all-reduce 11.7; reduce-scatter 16.1 / 13.2 / 10.8; all-gather 14.5 / 8.4 / 8.3
    - N = 3, 263 K: all-reduce 6.4; reduce-scatter 12.1 / 10.7 / 6.8; all-gather 8.6 / 2.4 / 3.6
    - N = 4, 1.05 M: all-reduce 15.9-18.6; reduce-scatter 17.3-20.6 / 18.0-19.3 / 7.4-9.8; all-gather
      9.5-12.1 / 7.4-8.2 / 9.4-11.7
    - N = 4, 263 K: all-reduce 8.4-9.6; reduce-scatter 8.8-10.6 / 13.4-14.3 / 3.6-5.7; all-gather 4.7-8.4 /
      4.4-5.6 / 3.9-4.9

    The all-to-all reduce-scatter moves half an all-reduce's bytes and is the fastest at every N (per-rank
    reduces, the earlier choice at N = 2, are gone); the all-gathers: per-rank broadcasts for buckets, and for
    ZeRO-3's layers up to 3 ranks; the all-to-all for layers on 4."""
    if not dist.is_initialized() or dist.get_backend(group) != "gloo":
        return ZeroCollectives()
    world = dist.get_world_size(group)
    if world < 2:
        return ZeroCollectives()
    return GLOO_COLLECTIVES[min(world, max(GLOO_COLLECTIVES))]


class Works:
    """Async collectives as one handle; ``then`` runs once, when they are waited on: the local half of a
    collective (the sum of an all-to-all's received slices)."""

    def __init__(self, works: list, then: Callable[[], object] | None = None):
        self.works, self.then = works, then

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        if self.then is not None:
            then, self.then = self.then, None  # its buffers go with it
            then()

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
    """One layer's parameters as views of a flat buffer padded to a multiple of ``world``; ``reduce_way`` and
    ``gather_way``: how its reduce-scatter and all-gather run (``REDUCE_WAYS``, ``GATHER_WAYS``,
    ``choose_collectives``)."""

    def __init__(self, index: int, params: list[nn.Parameter], rank: int, world: int, device,
                 flat_grad: bool = False, reduce_way: str = "native", gather_way: str = "native",
                 source: Materializer | None = None, sharded: bool = False):
        if reduce_way not in REDUCE_WAYS:
            raise ValueError(f"ZeRO reduce-scatter way {reduce_way!r}: use one of {', '.join(REDUCE_WAYS)}")
        if gather_way not in GATHER_WAYS:
            raise ValueError(f"ZeRO all-gather way {gather_way!r}: use one of {', '.join(GATHER_WAYS)}")
        self.index, self.params = index, params
        self.world, self.reduce_way, self.gather_way = world, reduce_way, gather_way
        self.sizes = [p.numel() for p in params]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(params))]
        self.numel = sum(self.sizes)
        self.shard_numel = -(-self.numel // world)  # ceil: the last shard is padded
        self.padded = self.shard_numel * world
        self.lo = rank * self.shard_numel
        shapes = [p.shape for p in params]
        dtype = source.dtype_of(params[0]) if source is not None else params[0].dtype
        # deferred construction (flowtrain.parallel.deferred): the parameters are meta tensors until here; each
        # becomes a real, empty one (the same object) and takes its values from ``source``, one at a time
        metas = [swap_in_placeholder(p, device, dtype)[1] for p in params] if source is not None else None
        if metas is not None and sharded:  # ZeRO-3: only this rank's shard is made, never the whole unit
            self.full = torch.empty(self.padded, dtype=dtype, device=device)  # untouched, freed below
            self.shard = torch.zeros(self.shard_numel, dtype=dtype, device=device)
            with torch.no_grad():
                for meta, off, n in zip(metas, self.offsets, self.sizes):
                    a, b = max(off, self.lo), min(off + n, self.lo + self.shard_numel)
                    if b > a:  # the parameter whole for a moment (its initial values), its owned range kept
                        self.shard[a - self.lo:b - self.lo].copy_(source.value(meta).reshape(-1)[a - off:b - off])
        else:
            self.full = torch.zeros(self.padded, dtype=dtype, device=device)
            with torch.no_grad():
                for i, (p, off, n) in enumerate(zip(params, self.offsets, self.sizes)):
                    value = source.value(metas[i]) if metas is not None else p.detach()
                    self.full[off:off + n].copy_(value.reshape(-1))
            self.shard = self.full[self.lo:self.lo + self.shard_numel].clone()
        for p, shape, off, n in zip(params, shapes, self.offsets, self.sizes):
            p.data = self.full[off:off + n].view(shape)
        self.views = [p.data for p in params]
        self.empty = torch.empty(0, dtype=dtype, device=device)
        self.grad_shard = torch.zeros(self.shard_numel, dtype=dtype, device=device)
        self.grad_buffer: torch.Tensor | None = None
        # ZeRO-1 keeps whole gradients: as views of one flat buffer that autograd accumulates into and the
        # reduce-scatter reads directly (no copy, no allocation per step)
        self.flat_grad = torch.zeros(self.padded, dtype=dtype, device=device) if flat_grad else None
        self.grad_views = [self.flat_grad[off:off + n].view(shape) for shape, off, n in
                           zip(shapes, self.offsets, self.sizes)] if flat_grad else []
        # pieces: (parameter index in the unit, its elements [a, b) of the parameter, view of the shard)
        self.pieces: list[tuple[int, int, int, torch.Tensor]] = []
        for i, (off, n) in enumerate(zip(self.offsets, self.sizes)):
            a, b = max(off, self.lo), min(off + n, self.lo + self.shard_numel)
            if b > a:
                self.pieces.append((i, a - off, b - off, self.shard[a - self.lo:b - self.lo]))
        self.pending = len(params)
        self.handle = None
        self.received: torch.Tensor | None = None  # the all-to-all reduce-scatter's receive buffer, in flight
        self.prefetched: Works | None = None  # a gather started ahead of the unit's use (ZeRO-3's prefetch)
        self.observe: Callable[[torch.Tensor], None] | None = None  # the sharder's peak of a temporary's moment
        self.gathered = True
        self.gathered_for_eval = False  # gathered by a forward without gradients (ZeRO-3's evaluation): freed after
        if metas is not None and sharded:
            self.free_params()

    def reduce_scatter(self, buf: torch.Tensor, group):
        """Async: this rank's slice of the sum over the ranks of ``buf`` (the unit's padded gradients) into
        ``grad_shard``, done when the returned handle is waited on (``reduce_way``; ``all_to_all``: the N
        received slices are summed then, in rank order, and the padded receive buffer, ``received`` until then, is
        freed: the collective's workspace, counted by the memory plan and the sharder's measured peak)."""
        n = self.shard_numel
        if self.reduce_way == "all_to_all":
            self.received = received = torch.empty_like(buf)
            work = dist.all_to_all_single(received, buf, group=group, async_op=True)

            def then() -> None:
                torch.sum(received.view(self.world, n), 0, out=self.grad_shard)
                self.received = None
            return Works([work], then=then)
        return dist.reduce_scatter_single(self.grad_shard, buf, group=group, async_op=True)

    # -- parameter storage (ZeRO-3) -----------------------------------------------------------------
    def free_params(self) -> None:
        """Free the unit's storage; its parameters become empty tensors (a use of one between steps is a
        shape error, never a read of freed memory), autograd's saved views keep the (empty) storage."""
        self.wait_prefetch()  # never free a storage a collective still writes into
        self.full.untyped_storage().resize_(0)
        for p in self.params:
            p.data = self.empty
        self.gathered = self.gathered_for_eval = False

    def gather_params(self, group) -> None:
        """The unit whole on every rank (a collective; waits for a prefetch already in flight)."""
        if self.prefetched is not None:
            self.wait_prefetch()
            return
        self.gather_async(group).wait()

    def gather_async(self, group) -> Works:
        """Start gathering the unit (a collective, every rank in the same order); its parameters become views of the
        whole when the returned handle is waited on (``prefetch``: while the layer before it computes)."""
        if not self.gathered:
            self.full.untyped_storage().resize_(self.padded * self.full.element_size())
        works, keep = [], None
        if self.world == 1:  # one rank: the shard is the whole
            with torch.no_grad():
                self.full.copy_(self.shard)
        elif self.gather_way == "all_to_all":  # this rank's shard to every rank
            keep = self.shard.repeat(self.world)  # a temporary of the padded unit's size (the memory plan's)
            if self.observe is not None:
                self.observe(keep)
            works = [dist.all_to_all_single(self.full, keep, group=group, async_op=True)]
        elif self.gather_way == "per_rank":  # each rank's slice broadcast by its owner, all issued together
            n = self.shard_numel
            with torch.no_grad():
                self.full[self.lo:self.lo + n].copy_(self.shard)
            works = [dist.broadcast(self.full[r * n:(r + 1) * n], group=group, group_src=r, async_op=True)
                     for r in range(self.world)]
        else:
            works = [dist.all_gather_single(self.full, self.shard, group=group, async_op=True)]
        self.gathered = True  # its storage is allocated; the values are there once waited on

        def done() -> None:
            del keep_alive[:]  # the all-to-all's temporary goes with the collective
            for p, view in zip(self.params, self.views):
                p.data = view
            self.gathered_for_eval = False
        keep_alive = [keep]
        return Works(works, then=done)

    def prefetch(self, group) -> None:
        """Start gathering the unit now, to be waited on when it is needed (``wait_prefetch``)."""
        if not self.gathered and self.prefetched is None:
            self.prefetched = self.gather_async(group)

    def wait_prefetch(self) -> None:
        if self.prefetched is not None:
            handle, self.prefetched = self.prefetched, None
            handle.wait()


class RegatherBeforeBackward(torch.autograd.Function):
    """Identity on a unit's output whose backward gathers the unit's parameters (ZeRO-3)."""

    @staticmethod
    def forward(ctx, sharder, unit, x):
        ctx.sharder, ctx.unit = sharder, unit
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.sharder.before_backward(ctx.unit)
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

"""Data parallelism as map/reduce gradient aggregation.

Map: each replica computes the gradient of the *sum* of its examples' losses and counts its
examples. Reduce: gradients and counts are summed across replicas with ``torch.distributed``
collectives, the summed gradient is divided by the global count, and every replica applies the
same optimizer step. Because sums and counts are reduced (not per-replica means, as DDP
does), the step equals single-device training on the whole global batch for any split of it,
uneven or empty: a replica with no examples contributes zeros and a count of 0 and takes
part in every collective, so nobody waits for it forever.

Gradients are reduced in buckets (reverse parameter order, ``bucket_mb`` each) launched
asynchronously from post-accumulate-grad hooks while backward still runs. Buckets are launched
strictly in order on every rank (a ready bucket waits for the ones before it), so the
collectives match across ranks whatever order autograd produces gradients in.

Parameters that get no gradient on any replica in a step keep ``grad = None`` (the optimizer
skips them, as it would on one device); a parameter with a gradient on some replicas gets the
sum over those, divided by the global count.

Buffers (e.g. BatchNorm running statistics) follow one rule: after every optimizer step,
floating-point buffers become the example-weighted average over replicas and integer buffers
(``num_batches_tracked``) take rank 0's value, so all replicas hold identical state.
BatchNorm *normalizes* with per-replica batch statistics in training mode, so a model with
BatchNorm is not exactly equivalent to one device; use ``nn.SyncBatchNorm`` or LayerNorm.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flowtrain.parallel.context import DistContext

__all__ = ["shard_bounds", "sum_loss", "GradientReducer", "LocalReducer", "check_one_dtype", "empty_forward",
           "make_reducer",
           "local_rows"]


def shard_bounds(n: int, rank: int, world: int) -> tuple[int, int]:
    """Rows [lo, hi) of a global batch of ``n`` that ``rank`` gets: contiguous, sizes differ by
    at most one, every row exactly once (``numpy.array_split``'s rule)."""
    base, extra = divmod(n, world)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


def sum_loss(loss_fn: nn.Module, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The loss summed over examples, whatever the user's loss reduces with."""
    reduction = getattr(loss_fn, "reduction", "mean")
    loss = loss_fn(output, target)
    if reduction == "mean":
        return loss * target.shape[0]
    if reduction == "sum":
        return loss
    raise ValueError(f"loss reduction {reduction!r} is not supported: use 'mean' or 'sum'")


def _broadcast_from_first(tensor: torch.Tensor, group) -> None:
    """Broadcast from the group's first member (rank 0 of the world when ``group`` is None)."""
    if group is None:
        dist.broadcast(tensor, src=0)
    else:
        dist.broadcast(tensor, group=group, group_src=0)


class LocalReducer:
    """One replica: the same interface, no communication."""

    def __init__(self, module: nn.Module):
        self.params = [p for p in module.parameters() if p.requires_grad]

    def backward(self, loss_sum: torch.Tensor | None, n_local: int) -> tuple[int, float]:
        if loss_sum is None or n_local == 0:
            return 0, 0.0
        loss_sum.backward()
        for p in self.params:
            if p.grad is not None:
                p.grad.div_(n_local)
        return n_local, float(loss_sum.detach()) / n_local

    def reduce_accumulated(self, n_local: int, loss_local: float = 0.0) -> tuple[int, float]:
        for p in self.params:
            if p.grad is not None and n_local:
                p.grad.div_(n_local)
        return n_local, loss_local / n_local if n_local else 0.0

    def sync_buffers(self, n_local: int) -> None:
        pass

    def close(self) -> None:
        pass


class _Bucket:
    def __init__(self, index: int, params: list[nn.Parameter], extra: int = 0):
        self.index = index
        self.params = params
        self.numel = sum(p.numel() for p in params)
        # ``extra`` trailing slots carry the step's metadata in the last bucket.
        self.buffer = torch.zeros(self.numel + extra, dtype=params[0].dtype, device=params[0].device)
        self.pending = len(params)
        self.handle = None


class GradientReducer:
    """Bucketed, overlapped all-reduce of gradient sums and example counts (see module doc).

    The last bucket launched in a step also carries the replica's example count, loss sum and
    one "got a gradient" flag per parameter, so a step costs one collective per bucket, as
    DDP's does: a model under ``bucket_mb`` is one all-reduce per step.
    """

    def __init__(self, module: nn.Module, *, bucket_mb: float = 1.0, group=None):
        self.group = group
        self.module = module
        self.params = [p for p in module.parameters() if p.requires_grad]
        check_one_dtype(self.params, "GradientReducer")
        self._index = {id(p): i for i, p in enumerate(self.params)}
        # Buckets in reverse parameter order: the last layers' gradients are ready first.
        groups = size_buckets(list(reversed(self.params)), lambda p: p.numel() * p.element_size(), bucket_mb)
        self._meta = 2 + len(self.params)  # count, loss sum, flags
        self.buckets = [_Bucket(i, g, self._meta if i == len(groups) - 1 else 0) for i, g in enumerate(groups)]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        self._had_grad = torch.zeros(len(self.params), dtype=torch.float32)
        self._n_local, self._loss_local = 0.0, 0.0
        self._next = 0
        self._active = False
        self.broadcast_state()

    # -- setup -----------------------------------------------------------------------------------
    def broadcast_state(self) -> None:
        """Start from rank 0's parameters and buffers on every replica."""
        with torch.no_grad():
            for t in [*self.module.parameters(), *self.module.buffers()]:
                _broadcast_from_first(t.data, self.group)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # -- one step --------------------------------------------------------------------------------
    def _on_grad(self, p: nn.Parameter) -> None:
        if not self._active:
            return
        self._had_grad[self._index[id(p)]] = 1.0
        self._bucket_of[id(p)].pending -= 1
        self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        """Launch buckets strictly in order; ``force`` launches the rest (backward is over)."""
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            if bucket.pending > 0 and not force:
                return
            buf = bucket.buffer
            offset = 0
            for p in bucket.params:
                n = p.numel()
                if p.grad is None:
                    buf[offset:offset + n].zero_()
                else:
                    buf[offset:offset + n].copy_(p.grad.reshape(-1))
                offset += n
            if self._next == len(self.buckets) - 1:
                # Every earlier bucket is launched, so every gradient flag is final now.
                buf[offset] = self._n_local
                buf[offset + 1] = self._loss_local
                buf[offset + 2:].copy_(self._had_grad)
            bucket.handle = dist.all_reduce(buf, group=self.group, async_op=True)
            self._next += 1

    def _begin(self, n_local: int, loss_local: float) -> None:
        for b in self.buckets:
            b.pending, b.handle = len(b.params), None
        self._had_grad.zero_()
        self._next = 0
        self._n_local, self._loss_local = float(n_local), loss_local

    def backward(self, loss_sum: torch.Tensor | None, n_local: int) -> tuple[int, float]:
        """Backward of this replica's loss sum, then the reduce; returns (global count, mean loss).

        ``loss_sum`` is None (or ``n_local`` 0) on a replica without examples this step.
        """
        has_work = loss_sum is not None and n_local > 0
        self._begin(n_local, float(loss_sum.detach()) if has_work else 0.0)
        self._active = True
        try:
            if has_work:
                loss_sum.backward()
        finally:
            self._active = False
        return self._finish()

    def reduce_accumulated(self, n_local: int, loss_local: float = 0.0) -> tuple[int, float]:
        """Reduce gradient sums already accumulated (e.g. over a pipeline's micro-batches)."""
        self._begin(n_local, loss_local)
        for i, p in enumerate(self.params):
            if p.grad is not None:
                self._had_grad[i] = 1.0
        return self._finish()

    def _finish(self) -> tuple[int, float]:
        self._launch_ready(force=True)  # buckets whose parameters got no gradient here
        for b in self.buckets:
            b.handle.wait()
            b.handle = None  # no Work object outlives its step (or the process group)
        last = self.buckets[-1]
        meta = last.buffer[last.numel:].tolist()  # one device-to-host copy, not one per parameter
        global_n = int(round(meta[0]))
        mean_loss = meta[1] / global_n if global_n else 0.0
        got_grad = [flag > 0 for flag in meta[2:]]
        scale = 1.0 / global_n if global_n else 0.0
        with torch.no_grad():
            for b in self.buckets:
                grads = b.buffer[:b.numel]
                grads.mul_(scale)
                offset = 0
                for p in b.params:
                    n = p.numel()
                    if got_grad[self._index[id(p)]]:
                        view = grads[offset:offset + n].view_as(p)
                        if p.grad is None:
                            p.grad = view.clone()
                        else:
                            p.grad.copy_(view)
                    else:
                        p.grad = None
                    offset += n
        return global_n, mean_loss

    def sync_buffers(self, n_local: int) -> None:
        """The buffer rule (``sync_buffers``) over this reducer's group."""
        sync_buffers(self.module, n_local, self.group)


def empty_forward(module: nn.Module, *inputs: torch.Tensor) -> torch.Tensor:
    """``module`` on zero rows, as a rank with no rows runs it to take part in ZeRO-3's gathers: in eval mode, so a
    BatchNorm neither fails on an empty batch ("expected more than 1 value per channel") nor moves its running
    statistics (its buffers then count with weight 0 in ``sync_buffers``); its output's gradient is zero."""
    was = module.training
    module.eval()
    try:
        return module(*inputs)
    finally:
        module.train(was)


def check_one_dtype(params: list[torch.Tensor], who: str) -> torch.dtype:
    """The one floating-point type of ``params`` (float32, or float64: ``--dtype``); mixed types are a TypeError."""
    kinds = {p.dtype for p in params}
    if len(kinds) > 1 or any(not k.is_floating_point for k in kinds):
        raise TypeError(f"{who} reduces parameters of one floating-point type, not {sorted(map(str, kinds))}; cast the "
                        f"model with .float() or .double()")
    return kinds.pop() if kinds else torch.float32


def size_buckets(items: list, nbytes: Callable[[Any], int], bucket_mb: float) -> list[list]:
    """``items`` cut in order into runs of at most ``bucket_mb`` MiB (an item bigger than that is a run of its
    own): the gradient buckets of the map/reduce and of ZeRO's reduce-scatters."""
    cap = max(1, int(bucket_mb * 1024 * 1024))
    runs: list[list] = []
    current: list = []
    size = 0
    for item in items:
        n = nbytes(item)
        if current and size + n > cap:
            runs.append(current)
            current, size = [], 0
        current.append(item)
        size += n
    if current:
        runs.append(current)
    return runs


def sync_buffers(module: nn.Module, n_local: int, group=None) -> None:
    """The map/reduce buffer rule: example-weighted mean for floats, the group's first member's value for
    integers (``n_local``: this rank's examples of the global batch)."""
    buffers = list(module.buffers())
    if not buffers:
        return
    weight = torch.tensor([float(n_local)], dtype=torch.float64, device=buffers[0].device)
    dist.all_reduce(weight, group=group)
    total = float(weight.item())
    with torch.no_grad():
        for buf in buffers:
            if buf.is_floating_point() and total > 0:
                buf.mul_(n_local / total)
                dist.all_reduce(buf, group=group)
            else:
                _broadcast_from_first(buf, group)


def make_reducer(module: nn.Module, ctx: DistContext, *, bucket_mb: float = 1.0, group=None):
    if ctx.distributed:
        return GradientReducer(module, bucket_mb=bucket_mb, group=group)
    return LocalReducer(module)


def local_rows(n: int, ctx: DistContext, sizes: Sequence[int] | None = None) -> tuple[int, int]:
    """This rank's rows of a global batch: ``shard_bounds``, or explicit per-rank ``sizes``."""
    if sizes is None:
        return shard_bounds(n, ctx.rank, ctx.world_size)
    lo = sum(sizes[: ctx.rank])
    return lo, lo + sizes[ctx.rank]

"""ZeRO-sharded training state on the map/reduce data parallelism (``--shard-states``).

The map/reduce of ``flowtrain.parallel.mapreduce`` keeps N full copies of parameters, gradients
and optimizer state. Here the reduce becomes a *reduce-scatter*: each rank receives the sum over
replicas of the gradient shard it owns, divides it by the global example count (the same sums
and counts, so the step still equals one device on the whole global batch), and steps the
optimizer on its shard only; the shards are all-gathered back when the next step needs them.

Layout: the model's top-level children with parameters (its layers) are *units*; a root module's
own parameters are one more unit. A unit's parameters live as views of one flat float32 buffer,
padded to a multiple of N (uneven shards: N need not divide anything), and rank r owns elements
``[r * S, (r + 1) * S)`` of every unit (``S = padded / N``). The optimizer (any
``torch.optim`` class, elementwise as Adam and SGD are) steps one *piece* per (parameter, owned
range): a view of the rank's shard, so it keeps its state for its shard only and its per-parameter
step counts match one device's.

Stages (DeepSpeed's ZeRO-1/2/3, ``STAGES``):

- ``optimizer``: optimizer state sharded; gradients computed whole (and kept until the next step),
  reduce-scattered per unit through a buffer freed when the collective is done (launched in
  reverse unit order from post-accumulate-grad hooks while backward runs), parameters all-gathered
  into every replica after the step.
- ``gradients``: as ``optimizer``, and each unit's gradients are freed as soon as they are copied
  into its reduce-scatter buffer (which is freed when the collective is done): a rank keeps only its
  shard of the reduced gradient.
- ``parameters``: as ``gradients``, and parameters are sharded too: a unit's storage is allocated
  and all-gathered just before its forward (forward pre-hook), freed after it (``resize_(0)`` of
  the storage, as FSDP1 does, so autograd's saved views see the refilled storage), all-gathered
  again just before its backward (an identity autograd function on its output) and freed when its
  gradients are launched. Every rank runs forward and backward every step, also on zero rows (it
  still takes part in the gathers; its count is 0 and its gradient zeros).

Collectives (``zero_units.choose_collectives``): on NCCL ``reduce_scatter_single`` / ``all_gather_single``; on
gloo (CPU), whose reduce-scatter is an all-reduce and a copy inside, the reduce-scatter is one ``all_to_all_single``
(each rank sends slice j to rank j) and a local sum of the N slices received, when the collective is waited on
(half an all-reduce's bytes), and the all-gathers are the way measured fastest for N and for ZeRO-1/2's buckets
and ZeRO-3's layers (``GLOO_COLLECTIVES``); one small all-reduce per step for the count, loss sum and "got a
gradient" flags. A parameter no replica produced a gradient for keeps no gradient (the optimizer
skips its pieces, as one device skips it).

Checkpoints: ``optimizer_state`` gathers the shards into the state dict a plain optimizer over
``module.parameters()`` has (so a checkpoint resumes with any N, any stage or none), and ``load``
cuts such a state into this rank's pieces.

The units and their flat buffers are ``flowtrain.parallel.zero.units``; ``fit``'s engine over a
``ZeroSharder`` is ``flowtrain.parallel.zero.engine.ZeroEngine``.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from flowtrain.parallel.context import DistContext
from flowtrain.parallel.deferred import Materializer, is_deferred, materialize
from flowtrain.parallel.mapreduce import check_one_dtype, sync_buffers
from flowtrain.parallel.zero.state import ZeroCheckpointing
from flowtrain.parallel.zero.units import (
    RegatherBeforeBackward,
    ShardUnit,
    ZeroCollectives,
    choose_collectives,
    shard_units,
    storage_bytes,
    wrap_output,
)

__all__ = ["STAGES", "ZeroSharder", "check_stage", "shard_stage_worker"]

#: ``--shard-states`` values: nothing sharded (plain map/reduce), ZeRO-1, ZeRO-2, ZeRO-3.
STAGES = ("none", "optimizer", "gradients", "parameters")


def check_stage(stage: str) -> str:
    if stage not in STAGES:
        raise ValueError(f"--shard-states {stage!r} is not a stage: use one of {', '.join(STAGES)}")
    return stage



class ZeroSharder(ZeroCheckpointing):
    """A module's training state sharded over the data-parallel ranks of ``group`` (module doc).

    Per step: ``zero_grad()``, forward, ``backward(loss_sum, n_local)`` (returns the global count and
    mean loss), ``step()``; ``sync_buffers(n_local)`` after it when the module has buffers.
    ``gather()`` makes the whole model present on every rank (evaluation, checkpoints).
    """

    def __init__(self, module: nn.Module, ctx: DistContext, *, stage: str,
                 make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer], group=None,
                 bucket_mb: float = 1.0, prefetch: bool = False):
        check_stage(stage)
        if stage == "none":
            raise ValueError("ZeroSharder shards state: stage 'none' is the plain map/reduce (GradientReducer)")
        self.module, self.ctx, self.stage, self.group = module, ctx, stage, group
        # ZeRO-3: start each layer's gather while the layer before it computes (forward) or after it (backward)
        self.prefetch = bool(prefetch) and stage == "parameters"
        self.world = dist.get_world_size(group) if ctx.distributed else 1
        self.rank = dist.get_rank(group) if ctx.distributed else 0
        self.collectives = choose_collectives(group) if ctx.distributed else ZeroCollectives()
        trainable = [p for p in module.parameters() if p.requires_grad]
        # deferred construction (flowtrain.parallel.deferred): every rank makes its own parameters' values, the
        # same as one process's, so nothing is broadcast; with ZeRO-3 only the slices it owns
        source = Materializer(module) if is_deferred(module) else None
        if source is None:
            check_one_dtype(trainable, "--shard-states")
            self._broadcast_state()
        device = source.device if source is not None else trainable[0].device if trainable else torch.device("cpu")
        self.bucket_mb = bucket_mb
        groups = shard_units(module, stage, bucket_mb)
        self.units = [ShardUnit(i, ps, self.rank, self.world, device, flat_grad=stage == "optimizer",
                                reduce_way=self.collectives.reduce_scatter,
                                gather_way=self.collectives.gather(stage), source=source,
                                sharded=stage == "parameters")
                      for i, (_, ps) in enumerate(groups)]
        for u in self.units:
            u.observe = self._observe
        if source is not None:
            materialize(module)  # what is not sharded (buffers, frozen parameters): whole, the same on every rank
        self.params = [p for u in self.units for p in u.params]
        self._where = {id(p): (u, i) for u in self.units for i, p in enumerate(u.params)}
        self._flag_index = {id(p): k for k, p in enumerate(self.params)}
        self._had_grad = torch.zeros(len(self.params), dtype=torch.float32)
        self._touched = torch.zeros(len(self.params), dtype=torch.float32)  # got a gradient since zero_grad
        self.optimizer = make_optimizer([t for u in self.units for (_, _, _, t) in u.pieces])
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        self._active = False
        self._next = 0
        self._n_local, self._loss_local = 0.0, 0.0
        self.peak_state_bytes = 0
        self._static_bytes: int | None = None  # _held_bytes' fixed part
        self._static_known = False
        self._closed = False
        if stage == "parameters":
            for ([mod], _), unit in zip(groups, self.units):
                self._hooks.append(mod.register_forward_pre_hook(self._pre_forward(unit)))
                self._hooks.append(mod.register_forward_hook(self._post_forward(unit, mod is module)))
            # the units stay gathered until their first forward frees them

    # -- setup ----------------------------------------------------------------------------------------
    def _broadcast_state(self) -> None:
        if not self.ctx.distributed:
            return
        with torch.no_grad():
            for t in [*self.module.parameters(), *self.module.buffers()]:
                if self.group is None:
                    dist.broadcast(t.data, src=0)
                else:
                    dist.broadcast(t.data, group=self.group, group_src=0)

    # -- ZeRO-3 hooks ---------------------------------------------------------------------------------
    def _pre_forward(self, unit: ShardUnit):
        def hook(_module, _args):
            if not unit.gathered or unit.prefetched is not None:
                unit.gather_params(self.group)  # a prefetch in flight is waited on
                # an evaluation (no gradients) of a sharded model: each layer gathered for its forward, then freed
                unit.gathered_for_eval = not torch.is_grad_enabled()
            if self.prefetch and unit.index + 1 < len(self.units):  # the next layer's gather under this one's compute
                self.units[unit.index + 1].prefetch(self.group)
        return hook

    def before_backward(self, unit: ShardUnit) -> None:
        """ZeRO-3: ``unit`` whole for its backward (gathered again, or its prefetch waited on), and the unit before it
        (the next to run backward) started gathering under this one's compute."""
        if not unit.gathered or unit.prefetched is not None:
            unit.gather_params(self.group)
        if self.prefetch and unit.index > 0:
            self.units[unit.index - 1].prefetch(self.group)

    def _post_forward(self, unit: ShardUnit, is_root: bool):
        def hook(_module, _args, output):
            if not torch.is_grad_enabled():
                if unit.gathered_for_eval:  # not a model gathered whole before (``gather``): it stays whole
                    unit.free_params()
                return output
            if is_root:  # the root's own parameters stay until backward
                return output
            unit.free_params()
            return wrap_output(output, lambda t: RegatherBeforeBackward.apply(self, unit, t))
        return hook

    # -- one step -------------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self._touched.zero_()
        for u in self.units:
            if u.flat_grad is not None:  # ZeRO-1: autograd accumulates into the flat buffer's views
                u.flat_grad.zero_()
                for p, view in zip(u.params, u.grad_views):
                    p.grad = view
            else:
                for p in u.params:
                    p.grad = None

    def _on_grad(self, p: nn.Parameter) -> None:
        self._touched[self._flag_index[id(p)]] = 1.0
        if not self._active:
            return
        unit, _ = self._where[id(p)]
        if self._n_local > 0:
            self._had_grad[self._flag_index[id(p)]] = 1.0
        unit.pending -= 1
        self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        """Reduce-scatter units strictly in reverse order (the same collectives on every rank)."""
        order = len(self.units) - 1 - self._next
        while self._next < len(self.units):
            unit = self.units[order]
            if unit.pending > 0 and not force:
                return
            if unit.flat_grad is not None and all(p.grad is v for p, v in zip(unit.params, unit.grad_views)):
                buf = unit.flat_grad  # ZeRO-1: the gradients are its views already (padding stays zero)
            else:
                buf = torch.empty(unit.padded, dtype=unit.full.dtype, device=unit.full.device)
                buf[unit.numel:].zero_()  # the padding
                for p, off, n in zip(unit.params, unit.offsets, unit.sizes):
                    if p.grad is None:
                        buf[off:off + n].zero_()
                    else:
                        buf[off:off + n].copy_(p.grad.reshape(-1))
            unit.grad_buffer = buf if buf is not unit.flat_grad else None  # until the collective is done
            if self.stage != "optimizer":  # ZeRO-1 keeps whole gradients
                # the step's peak: this unit's gradients and buffer (ZeRO-3: its parameters gathered), the one
                # before it maybe still in flight (what the memory plan's ``transient`` counts)
                self._observe()
                for p in unit.params:
                    p.grad = None  # only this rank's shard of the reduced gradient stays
            if self.stage == "parameters" and unit.gathered:
                unit.free_params()
            if self.world > 1:  # this rank's slice of the sum lands in grad_shard when the handle is waited on
                unit.handle = unit.reduce_scatter(buf, self.group)
                self._observe()  # launched: its buffer and receive buffer, the one before it still in flight
                self._release_done(keep=1)
            else:
                unit.grad_shard.copy_(buf)
                unit.grad_buffer = None
            self._next += 1
            order -= 1

    def _release_done(self, keep: int) -> None:
        """Free the buffers of finished reduce-scatters, waiting for the oldest while more than ``keep`` are in
        flight (ZeRO-2/3: a rank holds at most ``keep`` + 1 units' gradient buffers, not the whole model's)."""
        flight = [u for u in reversed(self.units) if u.handle is not None]  # launch order
        for k, u in enumerate(flight):
            if k >= len(flight) - keep and not u.handle.is_completed():
                continue
            self._complete(u)

    @staticmethod
    def _complete(u: ShardUnit) -> None:
        """Wait for ``u``'s reduce-scatter (its local half too: ``ShardUnit.reduce_scatter``); its buffer is freed."""
        u.handle.wait()
        u.handle, u.grad_buffer = None, None

    def backward(self, loss_sum: torch.Tensor | None, n_local: int) -> tuple[int, float]:
        """Backward of this rank's loss sum (None: no examples and no graph), the reduce-scatter, the
        division by the global count; returns (global count, mean loss)."""
        for u in self.units:
            u.pending, u.handle = len(u.params), None
        self._had_grad.zero_()
        self._next = 0
        has_work = loss_sum is not None and n_local > 0
        self._n_local = float(n_local)
        self._loss_local = float(loss_sum.detach()) if has_work else 0.0
        self._active = True
        try:
            if loss_sum is not None and loss_sum.requires_grad:
                loss_sum.backward()
        finally:
            self._active = False
        self._launch_ready(force=True)
        return self._finish()

    def _finish(self) -> tuple[int, float]:
        meta = torch.cat([torch.tensor([self._n_local, self._loss_local]), self._had_grad]).to(torch.float64)
        if self.world > 1:
            meta = meta.to(self.units[0].full.device) if self.units else meta
            dist.all_reduce(meta, group=self.group)
        meta_list = meta.tolist()
        self._observe()
        for u in self.units:
            if u.handle is not None:
                self._complete(u)
            u.grad_buffer = None
        global_n = int(round(meta_list[0]))
        mean_loss = meta_list[1] / global_n if global_n else 0.0
        got = meta_list[2:]
        scale = 1.0 / global_n if global_n else 0.0
        with torch.no_grad():
            for u in self.units:
                u.grad_shard.mul_(scale)
                for i, a, b, piece in u.pieces:
                    if got[self._flag_index[id(u.params[i])]] > 0:
                        lo = u.offsets[i] + a - u.lo
                        piece.grad = u.grad_shard[lo:lo + (b - a)]
                    else:
                        piece.grad = None
        return global_n, mean_loss

    def reduce_accumulated(self, n_local: int, loss_local: float = 0.0) -> tuple[int, float]:
        """Reduce-scatter gradient sums already accumulated (a pipeline stage's micro-batches): the
        reducer interface of ``flowtrain.parallel.pipeline.StageWorker``."""
        for u in self.units:
            u.pending, u.handle = len(u.params), None
        self._had_grad.zero_()
        if n_local > 0:
            self._had_grad.copy_(self._touched)  # ZeRO-1's gradient views are never None: the hook's record
        self._next = 0
        self._n_local, self._loss_local = float(n_local), float(loss_local)
        self._launch_ready(force=True)
        return self._finish()

    def step(self) -> None:
        """The optimizer on this rank's shards; ZeRO-1/2 then all-gather the parameters."""
        self.optimizer.step()
        if self.stage != "parameters":
            for u in self.units:
                self._gather_unit(u)

    def _gather_unit(self, u: ShardUnit) -> None:
        u.gather_params(self.group)

    def gather(self) -> None:
        """The whole current model on every rank (evaluation, checkpoints, the end of training)."""
        for u in self.units:
            self._gather_unit(u)

    @property
    def collective_forward(self) -> bool:
        """ZeRO-3: a forward and a backward gather each layer on the replicas' group, so every replica must run
        them (on zero rows too) in the same order (``flowtrain.parallel.pipeline.StageWorker``)."""
        return self.stage == "parameters"

    def release(self) -> None:
        """ZeRO-3: free the units ``gather`` left whole (their next forward gathers them again); else nothing."""
        if self.stage == "parameters":
            for u in self.units:
                if u.gathered:
                    u.free_params()

    def set_lr(self, lr: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    def sync_buffers(self, n_local: int) -> None:
        """The map/reduce buffer rule (``flowtrain.parallel.mapreduce.sync_buffers``) over the replicas."""
        if self.world > 1:
            sync_buffers(self.module, n_local, self.group)

    # -- memory -----------------------------------------------------------------------------------------
    def _observe(self, temporary: torch.Tensor | None = None) -> None:
        """The measured peak (``peak_state_bytes``) at one of a step's busiest moments: what ``state_bytes`` counts
        (``_held_bytes``), and a collective's ``temporary`` (the all-to-all gather's repeated shard)."""
        extra = temporary.untyped_storage().nbytes() if temporary is not None else 0
        self.peak_state_bytes = max(self.peak_state_bytes, self._held_bytes() + extra)

    def _held_bytes(self) -> int:
        """``state_bytes()["total"]`` without a storage walk per unit (it is asked at every unit's launch): the
        shards, reduced gradients and optimizer state are known sizes; what changes within a step (units gathered,
        buffers and receive buffers in flight, the gradients autograd holds) is counted from the units' flags."""
        if self._static_bytes is None:  # the optimizer's state exists from the first step on: then fixed
            self._static_bytes = storage_bytes([u.shard for u in self.units]) + storage_bytes(
                [u.grad_shard for u in self.units]) + storage_bytes(
                [v for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v)])
            self._static_known = bool(self.optimizer.state)
        held = self._static_bytes
        for u in self.units:
            size = u.padded * u.full.element_size()
            held += (size if u.gathered else 0) + (size if u.grad_buffer is not None else 0) + \
                (size if u.received is not None else 0)
        held += storage_bytes([p.grad for p in self.params if p.grad is not None])
        if not self._static_known:
            self._static_bytes = None
        return held

    def state_bytes(self) -> dict:
        """Bytes this rank holds now: parameters (gathered units and shards), gradients (whole, buffers,
        reduced shards), optimizer state, and the collectives' workspace in flight (the all-to-all reduce-scatters'
        receive buffers; between steps none)."""
        params = storage_bytes([u.full for u in self.units]) + storage_bytes([u.shard for u in self.units])
        grads = storage_bytes([p.grad for p in self.params]) + storage_bytes(
            [u.grad_buffer for u in self.units]) + storage_bytes([u.grad_shard for u in self.units])
        opt = storage_bytes([v for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v)])
        work = storage_bytes([u.received for u in self.units])
        return {"parameters": params, "gradients": grads, "optimizer": opt, "workspace": work,
                "total": params + grads + opt + work}

    def close(self, gather: bool = True) -> None:
        """Remove the hooks; ``gather``: the module leaves whole (else as it is: ZeRO-3's units freed, their shards
        still here for ``write_whole``)."""
        if self._closed:
            return
        self._closed = True
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if gather:
            self.gather()


def shard_stage_worker(worker, ctx: DistContext, *, stage: str,
                       make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
                       bucket_mb: float = 1.0) -> ZeroSharder | None:
    """ZeRO-1/2/3 on the data-parallel group of a pipeline stage / tensor shard (``GridEngine``): the
    ``StageWorker``'s reducer becomes a ``ZeroSharder`` over its module; None when the stage has no
    replicas to shard over (the state stays whole). With ZeRO-3 (``collective_forward``) the worker runs
    every micro-batch, an empty one on zero rows, so every replica issues the same gathers in the same order."""
    check_stage(stage)
    if stage == "none" or worker.group is None:
        return None
    worker.reducer.close()  # its hooks go; the sharder reduces instead
    sharder = ZeroSharder(worker.module, ctx, stage=stage, make_optimizer=make_optimizer, group=worker.group,
                          bucket_mb=bucket_mb)
    worker.reducer = sharder
    return sharder

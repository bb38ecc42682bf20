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

The units and their flat buffers are ``flowtrain.parallel.zero_units``; ``fit``'s engine over a
``ZeroSharder`` is ``flowtrain.parallel.zero_engine.ZeroEngine``.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from flowtrain.parallel.context import DistContext
from flowtrain.parallel.mapreduce import sync_buffers
from flowtrain.parallel.zero_units import (
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



class ZeroSharder:
    """A module's training state sharded over the data-parallel ranks of ``group`` (module doc).

    Per step: ``zero_grad()``, forward, ``backward(loss_sum, n_local)`` (returns the global count and
    mean loss), ``step()``; ``sync_buffers(n_local)`` after it when the module has buffers.
    ``gather()`` makes the whole model present on every rank (evaluation, checkpoints).
    """

    def __init__(self, module: nn.Module, ctx: DistContext, *, stage: str,
                 make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer], group=None,
                 bucket_mb: float = 1.0):
        check_stage(stage)
        if stage == "none":
            raise ValueError("ZeroSharder shards state: stage 'none' is the plain map/reduce (GradientReducer)")
        self.module, self.ctx, self.stage, self.group = module, ctx, stage, group
        self.world = dist.get_world_size(group) if ctx.distributed else 1
        self.rank = dist.get_rank(group) if ctx.distributed else 0
        self.collectives = choose_collectives(group) if ctx.distributed else ZeroCollectives()
        trainable = [p for p in module.parameters() if p.requires_grad]
        if any(p.dtype != torch.float32 for p in trainable):
            raise TypeError("--shard-states shards float32 parameters; cast the model with .float()")
        device = trainable[0].device if trainable else torch.device("cpu")
        self._broadcast_state()
        self.bucket_mb = bucket_mb
        groups = shard_units(module, stage, bucket_mb)
        self.units = [ShardUnit(i, ps, self.rank, self.world, device, flat_grad=stage == "optimizer",
                                reduce_way=self.collectives.reduce_scatter,
                                gather_way=self.collectives.gather(stage))
                      for i, (_, ps) in enumerate(groups)]
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
            if torch.is_grad_enabled() and not unit.gathered:
                unit.gather_params(self.group)
        return hook

    def _post_forward(self, unit: ShardUnit, is_root: bool):
        def hook(_module, _args, output):
            if not torch.is_grad_enabled() or is_root:  # the root's own parameters stay until backward
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
                buf = torch.empty(unit.padded, dtype=torch.float32, device=unit.full.device)
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
                self.peak_state_bytes = max(self.peak_state_bytes, self.state_bytes()["total"])
                for p in unit.params:
                    p.grad = None  # only this rank's shard of the reduced gradient stays
            if self.stage == "parameters" and unit.gathered:
                unit.free_params()
            if self.world > 1:  # this rank's slice of the sum lands in grad_shard when the handle is waited on
                unit.handle = unit.reduce_scatter(buf, self.group)
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
        self.peak_state_bytes = max(self.peak_state_bytes, self.state_bytes()["total"])
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

    # -- checkpoints ------------------------------------------------------------------------------------
    def optimizer_state(self) -> dict:
        """The state dict a plain optimizer over ``module.parameters()`` would have (a collective)."""
        order = {id(p): k for k, p in enumerate(self.module.parameters())}
        sd = self.optimizer.state_dict()
        piece_ids = [(u, i, a, b) for u in self.units for (i, a, b, _) in u.pieces]
        state: dict[int, dict] = {}
        keys = sorted({k for s in sd["state"].values() for k, v in s.items()
                       if torch.is_tensor(v) and v.dim() == 1})
        for u in self.units:
            # each per-element state of the unit, as a flat shard, then all-gathered
            for key in keys:
                shard = torch.zeros(u.shard_numel, dtype=torch.float32, device=u.full.device)
                for j, (uu, i, a, b) in enumerate(piece_ids):
                    if uu is u and j in sd["state"] and key in sd["state"][j]:
                        lo = u.offsets[i] + a - u.lo
                        shard[lo:lo + (b - a)] = sd["state"][j][key]
                whole = torch.zeros(u.padded, dtype=torch.float32, device=u.full.device)
                if self.world > 1:
                    dist.all_gather_single(whole, shard, group=self.group)
                else:
                    whole.copy_(shard)
                for p, view, off, n in zip(u.params, u.views, u.offsets, u.sizes):
                    state.setdefault(order[id(p)], {})[key] = whole[off:off + n].view(view.shape).cpu().clone()
        # scalar state (Adam's step) and which parameters have state at all: from every rank's pieces
        scalars: dict[int, dict] = {}
        for j, (u, i, _, _) in enumerate(piece_ids):
            for k, v in sd["state"].get(j, {}).items():
                if not (torch.is_tensor(v) and v.dim() == 1):
                    scalars.setdefault(order[id(u.params[i])], {})[k] = v
        if self.world > 1:
            everyone: list = [None] * self.world
            dist.all_gather_object(everyone, {k: {n: (v.cpu() if torch.is_tensor(v) else v) for n, v in d.items()}
                                              for k, d in scalars.items()}, group=self.group)
            for other in everyone:
                for k, d in other.items():
                    scalars.setdefault(k, {}).update(d)
        out_state = {k: {**scalars[k], **state[k]} for k in sorted(scalars)}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(range(len(order)))}
                  for g in sd["param_groups"]]
        return {"state": out_state, "param_groups": groups}

    def load_optimizer_state(self, full: dict) -> None:
        """Cut a plain optimizer's state dict (over ``module.parameters()``) into this rank's pieces."""
        order = {id(p): k for k, p in enumerate(self.module.parameters())}
        pieces = [(u, i, a, b) for u in self.units for (i, a, b, _) in u.pieces]
        state = {}
        for j, (u, i, a, b) in enumerate(pieces):
            mine = full["state"].get(order[id(u.params[i])], full["state"].get(str(order[id(u.params[i])])))
            if mine is None:
                continue
            state[j] = {k: (v.reshape(-1)[a:b].clone() if torch.is_tensor(v) and v.dim() > 0 else v)
                        for k, v in mine.items()}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(range(len(pieces)))}
                  for g in full["param_groups"][:1]]
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})

    # -- sharded checkpoints (flowtrain.train.checkpoint.save_shards / load_shards: DCP) -------------------
    def _names(self) -> dict[int, str]:
        return {id(p): n for n, p in self.module.named_parameters() if id(p) in self._where}

    def _own_ranges(self):
        """(parameter name, its elements [a, b) this rank owns, its whole size, the shard's view, the optimizer piece)."""
        names = self._names()
        for u in self.units:
            for i, a, b, piece in u.pieces:
                lo = u.offsets[i] + a - u.lo
                yield names[id(u.params[i])], a, b, u.sizes[i], u.shard[lo:lo + (b - a)], piece

    def shard_pieces(self, whole: dict[str, dict] | None = None) -> tuple[dict, dict]:
        """What this rank writes into a sharded checkpoint: ``model.<name>`` (its shard of each parameter, a
        flat range), ``optim.<name>.<key>`` (its pieces' optimizer state; a scalar such as Adam's step whole),
        and for each ``prefix: state dict`` of ``whole`` (state this rank holds whole, e.g. the best weights)
        ``<prefix>.<name>``: the same ranges of it. Rank 0 adds what is not sharded (buffers, frozen
        parameters) whole. Returns (tensors, chunks: name -> (offset, whole length))."""
        tensors, chunks = {}, {}
        for name, a, b, n, shard, piece in self._own_ranges():
            tensors[f"model.{name}"], chunks[f"model.{name}"] = shard, (a, n)
            for key, v in self.optimizer.state.get(piece, {}).items():
                if torch.is_tensor(v) and v.dim() == 1:
                    tensors[f"optim.{name}.{key}"], chunks[f"optim.{name}.{key}"] = v, (a, n)
                else:  # the same on every rank holding a piece of the parameter: one copy is kept
                    tensors[f"optim.{name}.{key}"] = torch.as_tensor(v)
            for prefix, state in (whole or {}).items():
                tensors[f"{prefix}.{name}"], chunks[f"{prefix}.{name}"] = state[name].reshape(-1)[a:b], (a, n)
        if self.rank == 0:
            sharded = set(self._names().values())
            for prefix, state in (("model", self.module.state_dict()), *(whole or {}).items()):
                tensors.update({f"{prefix}.{k}": v for k, v in state.items() if k not in sharded})
        return tensors, chunks

    def shard_targets(self, saved: dict[str, tuple]) -> tuple[dict, dict]:
        """Where a resume reads this rank's pieces of a sharded checkpoint holding ``saved`` (name -> shape), written
        by any number of ranks: its shard of each parameter (read in place), its pieces' optimizer state, the
        module's other state whole. Returns (tensors, chunks) for ``load_shards``, then ``take_shards``."""
        tensors, chunks = {}, {}
        for name, a, b, n, shard, _ in self._own_ranges():
            tensors[f"model.{name}"], chunks[f"model.{name}"] = shard, (a, n)
            for key in saved:
                if key.startswith(f"optim.{name}.") and "." not in key[len(f"optim.{name}."):]:
                    if len(saved[key]) == 1:
                        tensors[key], chunks[key] = torch.zeros(b - a, dtype=torch.float32, device=shard.device), (a, n)
                    else:
                        tensors[key] = torch.zeros(saved[key])
        sharded = set(self._names().values())
        for k, v in self.module.state_dict().items():
            if k not in sharded:
                tensors[f"model.{k}"] = torch.empty_like(v)
        return tensors, chunks

    def take_shards(self, tensors: dict) -> None:
        """After ``load_shards`` filled ``shard_targets``' tensors: the optimizer's pieces take their state, the
        module its other state, and every rank gathers the parameters from the shards read."""
        state, pieces = {}, [t for u in self.units for (_, _, _, t) in u.pieces]
        index = {id(t): j for j, t in enumerate(pieces)}
        for name, _, _, _, _, piece in self._own_ranges():
            mine = {k[len(f"optim.{name}."):]: v for k, v in tensors.items() if k.startswith(f"optim.{name}.")
                    and "." not in k[len(f"optim.{name}."):]}
            if mine:
                state[index[id(piece)]] = mine
        groups = [{**g, "params": list(range(len(pieces)))} for g in self.optimizer.state_dict()["param_groups"][:1]]
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})
        sharded = set(self._names().values())
        others = {k: tensors[f"model.{k}"] for k in self.module.state_dict() if k not in sharded}
        if others:
            self.module.load_state_dict(others, strict=False)
        self.gather()  # the parameters whole again, from the shards just read

    def load_parameters(self) -> None:
        """After the module's parameters were overwritten whole (a resume): take this rank's shards."""
        with torch.no_grad():
            for u in self.units:
                u.shard.copy_(u.full[u.lo:u.lo + u.shard_numel])

    # -- memory -----------------------------------------------------------------------------------------
    def state_bytes(self) -> dict:
        """Bytes this rank holds now: parameters (gathered units and shards), gradients (whole, buffers,
        reduced shards), optimizer state."""
        params = storage_bytes([u.full for u in self.units]) + storage_bytes([u.shard for u in self.units])
        grads = storage_bytes([p.grad for p in self.params]) + storage_bytes(
            [u.grad_buffer for u in self.units]) + storage_bytes([u.grad_shard for u in self.units])
        opt = storage_bytes([v for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v)])
        return {"parameters": params, "gradients": grads, "optimizer": opt, "total": params + grads + opt}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.gather()  # the module leaves whole


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

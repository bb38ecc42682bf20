"""Pipeline parallelism as a staged operator graph, and its place in the D x S x T grid.

Stages are operators, each in its own worker; micro-batches are the records on the edges
between them; a schedule (``flowtrain.parallel.schedules``) says which operator runs which micro-batch
when. Activations travel forward and their gradients backward with ``torch.distributed``
point-to-point ops (``isend``, blocking ``recv``; shapes come from the stage plan and the
micro-batch sizes every stage computes the same way, never guessed), each direction on its
own process group (``flowtrain.parallel.grid``), so that a forward send never queues behind a
backward send between the same two stages (NCCL runs one stream per communicator and peer).
The last stage computes the loss *sum* of each micro-batch; gradients accumulate over all
micro-batches and every stage steps once per global batch, after dividing by the global example
count, so no stage computes with stale parameters and a step equals single-device training on
the global batch.

Hybrid: ranks form a grid (``flowtrain.parallel.grid``: ``rank = (replica * S + stage) * T +
shard``). The replicas of one stage (and shard) share a process group, and after the
micro-batches they reduce their accumulated gradient sums and counts with the data-parallel
engine (``GradientReducer.reduce_accumulated``). A stage may itself be tensor-parallel
(``flowtrain.parallel.tensor.plan``): its shards exchange activations with the same shard of the
neighbouring stages; stage boundaries carry whole (replicated) activations.

Exit: every send a stage starts is waited for before its step returns (and again in
``close``), so no process leaves with point-to-point work in flight.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from flowtrain.parallel import DistContext, GradientReducer, LocalReducer, shard_bounds, sum_loss
from flowtrain.parallel.grid import Grid, GridPosition, build_groups
from flowtrain.parallel.mapreduce import empty_forward
from flowtrain.parallel.schedules import Schedule, ScheduleError, add_communication, format_schedule, microbatch_sizes

__all__ = ["GridPosition", "grid_position", "StageWorker", "StepStats", "PipelineStepError", "replica_rows"]


class PipelineStepError(RuntimeError):
    """An action of the schedule failed; the message shows the schedule with it marked."""


def grid_position(ctx: DistContext, stages: int, tensor: int = 1) -> tuple[GridPosition, object]:
    """This rank's place in the D x S (x T) grid and its data-parallel group (None if D = 1).

    Builds every group of the grid (``flowtrain.parallel.grid.build_groups``: all ranks, same
    order); use ``build_groups`` directly to get the tensor and pipeline groups as well.
    """
    groups = build_groups(Grid.from_world(ctx.world_size, stages=stages, tensor=tensor), ctx.rank)
    return groups.pos, groups.data


@dataclass
class StepStats:
    loss_sum: float = 0.0
    examples: int = 0
    busy_s: float = 0.0
    total_s: float = 0.0
    peak_activation_bytes: int = 0
    timeline: list = field(default_factory=list)

    @property
    def idle_fraction(self) -> float:
        return 1.0 - self.busy_s / self.total_s if self.total_s else 0.0


def _tag(kind: str, microbatch: int) -> int:
    return microbatch * 2 + (0 if kind == "F" else 1)


class StageWorker:
    """Runs one stage's share of a schedule for each global batch.

    Args:
      module: this stage's layers (a slice of the model's ``nn.Sequential``).
      pos: the grid position; ``group``: the stage's data-parallel group (None: no replicas).
      schedule: compute actions for every stage (GPipe or 1F1B); transfers are added here.
      in_shape: per-example input shape of this stage (not used on stage 0).
      loss_fn: the ordinary loss (mean or sum reduction), used on the last stage.
      p2p_groups: (forward, backward) groups for activations and gradients (``ProcessGroups``'s
        ``forward``/``backward``); None uses the default group.
      device: where receive buffers live (default: the module's parameters' device).
    """

    def __init__(self, module: nn.Module, pos: GridPosition, group, schedule: Schedule, microbatches: int,
                 in_shape: Sequence[int], loss_fn: nn.Module, *, bucket_mb: float = 1.0,
                 p2p_groups: tuple = (None, None), device: torch.device | str | None = None):
        self.module, self.pos, self.group = module, pos, group
        self.program = add_communication(schedule)
        self.actions = self.program[pos.stage]
        self.microbatches = microbatches
        self.in_shape = tuple(in_shape)
        self.loss_fn = loss_fn
        self.forward_group, self.backward_group = p2p_groups  # None: the default group
        if device is None:
            first = next(module.parameters(), None)
            device = first.device if first is not None else "cpu"
        self.device = torch.device(device)
        first = next((p for p in module.parameters() if p.is_floating_point()), None)
        self.dtype = first.dtype if first is not None else torch.float32  # activations cross stages in it (--dtype)
        self.reducer = GradientReducer(module, bucket_mb=bucket_mb, group=group) if group is not None \
            else LocalReducer(module)
        self._sends: list = []  # (work, payload) of isends not yet waited for

    def _fail(self, index: int, err: BaseException) -> PipelineStepError:
        return PipelineStepError(
            f"stage {self.pos.stage} (replica {self.pos.replica}) failed at action {self.actions[index]} "
            f"({type(err).__name__}: {err})\n" + format_schedule(self.program, mark=(self.pos.stage, index)))

    def step(self, inputs: torch.Tensor | None, targets: torch.Tensor | None, n_local: int, *,
             record_timeline: bool = False) -> StepStats:
        """Forward and backward of this replica's rows of a global batch; gradients end up as
        the mean over the *global* batch (sums reduced, divided by the global count)."""
        pos = self.pos
        sizes = microbatch_sizes(n_local, self.microbatches)
        starts = [sum(sizes[:m]) for m in range(self.microbatches)]
        stats = StepStats(examples=n_local)
        held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # micro-batch -> (input, output)
        received: dict[tuple[str, int], torch.Tensor] = {}
        losses: dict[int, torch.Tensor] = {}
        held_bytes = 0
        t_step = time.perf_counter()
        # ZeRO-3 gathers a layer's parameters on the replicas' group in each forward and backward: every replica
        # then runs every micro-batch, an empty one on zero rows locally (no transfer: every stage knows the sizes)
        every = getattr(self.reducer, "collective_forward", False)
        for index, action in enumerate(self.actions):
            m = action.microbatch
            if sizes[m] == 0 and not (every and action.is_compute):
                continue  # every stage skips an empty micro-batch's transfers (and without ZeRO-3 its compute)
            try:
                t0 = time.perf_counter()
                if sizes[m] == 0:
                    self._empty_microbatch(action.kind, m, inputs, held, losses)
                elif action.comm == "r":
                    if action.kind == "F":
                        buf = torch.empty((sizes[m], *self.in_shape), dtype=self.dtype, device=self.device)
                        dist.recv(buf, src=pos.rank_of(pos.stage - 1), tag=_tag("F", m), group=self.forward_group)
                    else:
                        buf = torch.empty_like(held[m][1])
                        dist.recv(buf, src=pos.rank_of(pos.stage + 1), tag=_tag("B", m), group=self.backward_group)
                    received[(action.kind, m)] = buf
                elif action.comm == "s":
                    if action.kind == "F":
                        payload, dst, group = held[m][1].detach().contiguous(), pos.rank_of(pos.stage + 1), \
                            self.forward_group
                    else:
                        payload, dst, group = held.pop(m)[0].grad.contiguous(), pos.rank_of(pos.stage - 1), \
                            self.backward_group
                    self._sends.append((dist.isend(payload, dst=dst, tag=_tag(action.kind, m), group=group),
                                        payload))
                elif action.kind == "F":
                    if pos.is_first:
                        x = inputs[starts[m]: starts[m] + sizes[m]]
                    else:
                        x = received.pop(("F", m)).requires_grad_(True)
                    out = self.module(x)
                    held[m] = (x, out)
                    held_bytes += out.numel() * out.element_size() + (x.numel() * x.element_size() if not pos.is_first else 0)
                    stats.peak_activation_bytes = max(stats.peak_activation_bytes, held_bytes)
                    if pos.is_last:
                        losses[m] = sum_loss(self.loss_fn, out, targets[starts[m]: starts[m] + sizes[m]])
                else:
                    x, out = held[m]
                    if pos.is_last:
                        loss = losses.pop(m)
                        stats.loss_sum += float(loss.detach())
                        loss.backward()
                    else:
                        out.backward(received.pop(("B", m)))
                    held_bytes -= out.numel() * out.element_size() + (x.numel() * x.element_size() if not pos.is_first else 0)
                    if pos.is_first:
                        held.pop(m)
                    else:
                        held[m] = (x, out.detach())  # the input's gradient is sent next (sB)
                if action.is_compute:
                    t1 = time.perf_counter()
                    stats.busy_s += t1 - t0
                    if record_timeline:
                        stats.timeline.append((str(action), t0 - t_step, t1 - t_step))
            except (ScheduleError, PipelineStepError):
                raise
            except Exception as err:  # noqa: BLE001 - re-raised with the schedule marked
                raise self._fail(index, err) from err
        self.wait_sends()
        self.reducer.reduce_accumulated(n_local)
        self.reducer.sync_buffers(n_local)
        stats.total_s = time.perf_counter() - t_step
        return stats

    def _empty_microbatch(self, kind: str, m: int, inputs, held: dict, losses: dict) -> None:
        """Forward or backward of a zero-row micro-batch (ZeRO-3: the replica still takes part in the layers'
        gathers, in the schedule's order); its gradient contribution is zero."""
        if kind == "F":
            x = inputs[:0] if self.pos.is_first and inputs is not None else \
                torch.zeros((0, *self.in_shape), dtype=self.dtype, device=self.device)
            out = empty_forward(self.module, x)  # eval mode: a BatchNorm on zero rows neither fails nor moves
            held[m] = (x, out)
            if self.pos.is_last:
                losses[m] = out.sum() * 0.0
            return
        x, out = held.pop(m)
        loss = losses.pop(m) if self.pos.is_last else None
        if loss is not None and loss.requires_grad:
            loss.backward()
        elif loss is None and out.requires_grad:
            out.backward(torch.zeros_like(out))

    def wait_sends(self) -> None:
        """Wait for every send this stage started (their buffers stay referenced until then)."""
        sends, self._sends = self._sends, []
        for handle, _payload in sends:
            handle.wait()

    def close(self) -> None:
        """Wait for outstanding sends and release the reducer's hooks (before the groups go)."""
        try:
            self.wait_sends()
        finally:
            self.reducer.close()


def replica_rows(n: int, pos: GridPosition) -> tuple[int, int]:
    """This replica's rows of an n-row global batch."""
    return shard_bounds(n, pos.replica, pos.replicas)

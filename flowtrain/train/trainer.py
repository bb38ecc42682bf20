"""The one training core of batch and stream: a model, its *engine*, and the step.

``loop.fit`` (a source of seeded batches from the dataset's shards) and ``stream.StreamTrainer`` (the
Kafka features topic with its exactly-once ledger) both train through a ``Trainer``: ``Trainer.step`` is
the one place a training step runs (``engine.train_step``). The engine does the step under the layout
asked for (``make_engine``): ``DataParallelEngine`` (map/reduce of gradient sums), ``ZeroEngine``
(``flowtrain.parallel.zero.engine``: ``--shard-states``) or ``GridEngine`` (``flowtrain.train.hybrid``: the
D x S x T grid of ``--stages`` and ``--tensor-parallel``); an engine has ``train_step``, ``set_lr``,
``sync_model``, ``optimizer``, ``optimizer_state``, ``stage_states``, ``shard_states``, ``load``,
``close`` and ``rng_rank``.

An engine takes a *global* batch and trains its replica's rows of it, except ``DataParallelEngine``
made with ``local_batches=True``: each replica's batch is its own (the stream trainer's replicas read
their own feature partitions). A source whose replicas read their own rows but whose engine takes a
global batch shares them first (``Trainer.global_batch``: the readers' rows, in rank order, on every rank).

The engine's config is the trainer's own: ``plan.TrainConfig`` (batch) or ``stream_config.StreamTrainConfig``
(stream), both ``flowtrain.train.options.ParallelOptions`` plus ``lr`` and ``EngineSettings`` (a
resumed grid's stage cut), so every engine option reaches both trainers from one declaration.

``skip_non_finite`` (the stream trainer): a step whose gradient is not finite on any rank changes no
weight (the optimizer step is skipped on every rank, ``StepResult.skipped``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from flowtrain.parallel import DistContext, local_rows, make_reducer, sum_loss
from flowtrain.parallel.deferred import is_deferred, materialize
from flowtrain.train.class_weights import WeightedLoss
from flowtrain.train.hybrid import GridEngine
from flowtrain.train.loader import Batch
from flowtrain.train.memory_plan import id_tables_held, plan_memory
from flowtrain.train.models import pack
from flowtrain.train.models.ensemble import MembersLoss
from flowtrain.train.precision import cast_batch, torch_dtype, use_dtype


@dataclass
class StepResult:
    rows: int  # the global batch's rows trained (0: nothing was)
    loss: float  # their mean loss
    skipped: bool = False  # the gradient was not finite: no weight changed


class ClassCrossEntropy(nn.CrossEntropyLoss):
    """Cross-entropy over K logits with the class index given as a float target (as datasets
    store labels), so every engine passes targets the same way."""

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return super().forward(logits, target.long())


def loss_function(task: str, outputs: int = 1, class_weights: torch.Tensor | None = None, *,
                  sample_weights: bool = False) -> nn.Module:
    """Mean squared error, binary or K-class cross-entropy (with ``class_weights``: each example weighed by its class;
    with ``sample_weights`` (``--weight-column``) by its own weight, which the target carries as a second column:
    ``flowtrain.train.class_weights.WeightedLoss``); over an ensemble's members (a training output with a members
    dimension) the mean of each member's loss (``flowtrain.train.models.ensemble.MembersLoss``)."""
    if class_weights is not None or sample_weights:
        return MembersLoss(WeightedLoss(class_weights, outputs, regression=task == "regression"), outputs)
    if task == "regression":
        return MembersLoss(nn.MSELoss(), outputs)
    return MembersLoss(ClassCrossEntropy() if outputs > 1 else nn.BCEWithLogitsLoss(), outputs)


class Trainer:
    """A model and the engine that trains it; ``step`` runs one training step."""

    def __init__(self, model: nn.Module, ctx: DistContext, config, loss_fn: nn.Module, sample: Batch | None, *,
                 seed: int, target_scale: tuple[float, float] = (0.0, 1.0), local_batches: bool = False,
                 skip_non_finite: bool = False):
        self.model, self.ctx, self.loss_fn, self.seed = model, ctx, loss_fn, int(seed)
        self.shift, self.scale = target_scale
        self.dtype = torch_dtype(getattr(config, "dtype", "float32"))  # --dtype (flowtrain.train.precision)
        use_dtype(model, self.dtype)
        sample = cast_batch(sample, self.dtype) if sample is not None else None
        self.engine = make_engine(model, ctx, config, loss_fn, sample, local_batches=local_batches)
        self.device = getattr(self.engine, "device", None) or next(model.parameters()).device
        self.sample = sample
        self.guard = _FiniteGuard(self.engine, ctx) if skip_non_finite else None
        self.scheduler = None  # a torch.optim.lr_scheduler on the engine's optimizer (none: a constant rate)

    def schedule(self, scheduler) -> None:
        """Step ``scheduler`` (``torch.optim.lr_scheduler``, on ``engine.optimizer``) after every training step."""
        self.scheduler = scheduler

    @property
    def local_batches(self) -> bool:
        """Whether each replica's batch is its own (else the engine takes a global batch)."""
        return bool(getattr(self.engine, "local_batches", False))

    @property
    def whole_model_is_current(self) -> bool:
        """Whether ``model`` holds the current weights without ``sync_model`` (data parallelism)."""
        return isinstance(self.engine, DataParallelEngine)

    def step(self, batch: Batch, step: int) -> StepResult:
        """One training step of ``batch`` (a global batch, or this replica's own with ``local_batches``)
        at step number ``step`` (dropout seeded per step and rank), then the learning-rate schedule's."""
        # dropout: per step and rank (the shards of a tensor group share it: engine.rng_rank)
        torch.manual_seed(self.seed * 1_000_003 + step * 1009 + self.engine.rng_rank)
        if self.guard is not None:
            self.guard.skipped = False
        batch = cast_batch(batch, self.dtype)
        target = (batch.y - self.shift) / self.scale
        if batch.w is not None:  # --weight-column: each row's weight travels with its target (engines slice rows)
            target = torch.stack([target, batch.w.to(target.device, target.dtype)], dim=1)
        rows, loss = self.engine.train_step(batch, target)
        if self.scheduler is not None:
            self.scheduler.step()
        skipped = bool(self.guard is not None and self.guard.skipped)
        return StepResult(int(rows), float(loss) if not skipped else math.nan, skipped)

    def global_batch(self, local: Batch | None) -> Batch | None:
        """Every replica's own rows (``local``, None: none), concatenated in rank order, on every rank:
        the global batch of an engine that takes one. A collective."""
        import torch.distributed as dist

        if not self.ctx.distributed:
            return local
        device = self.device
        n = torch.tensor([len(local) if local is not None else 0], dtype=torch.int64, device=device)
        counts = [torch.zeros_like(n) for _ in range(self.ctx.world_size)]
        dist.all_gather(counts, n)
        like = self.sample
        parts = []
        for rank, count in enumerate(int(c.item()) for c in counts):
            if not count:
                continue
            weighted = like.w is not None  # --weight-column: the sample weights travel with the rows
            if rank == self.ctx.rank:
                tensors = [local.x_num.to(device, like.x_num.dtype).contiguous(),
                           local.x_cat.to(device, like.x_cat.dtype).contiguous(),
                           local.y.to(device, like.y.dtype).contiguous()]
                if weighted:
                    tensors.append(local.w.to(device, like.y.dtype).contiguous())
            else:
                tensors = [torch.empty((count, *like.x_num.shape[1:]), dtype=like.x_num.dtype, device=device),
                           torch.empty((count, *like.x_cat.shape[1:]), dtype=like.x_cat.dtype, device=device),
                           torch.empty((count,), dtype=like.y.dtype, device=device)]
                if weighted:
                    tensors.append(torch.empty((count,), dtype=like.y.dtype, device=device))
            for t in tensors:
                dist.broadcast(t, src=rank)
            parts.append(tensors)
        if not parts:
            return None
        return Batch(*(torch.cat([p[i] for p in parts]) for i in range(len(parts[0]))))

    def close(self) -> None:
        self.engine.close()


class _FiniteGuard:
    """An optimizer step pre-hook: when the gradient is not finite on any rank, every rank drops its
    gradients (the optimizer then changes nothing) and the engine's step is marked ``skipped``."""

    def __init__(self, engine, ctx: DistContext):
        self.engine, self.ctx = engine, ctx
        # data parallelism reduces the gradient before the step: the same answer on every replica
        self.collective = ctx.distributed and not isinstance(engine, DataParallelEngine)
        self.skipped = False
        engine.optimizer.register_step_pre_hook(self._before_step)

    def _before_step(self, optimizer, args, kwargs) -> None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        grads = [p.grad for p in params if p.grad is not None]
        # the largest |value| (never overflows; NaN if any is NaN): one fused reduction, one copy to host
        finite = not grads or math.isfinite(torch.nn.utils.get_total_norm(grads, norm_type=math.inf))
        if self.collective:
            import torch.distributed as dist

            flag = torch.tensor([float(finite)], dtype=torch.float64,
                                device=grads[0].device if grads else "cpu")
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            finite = bool(flag.item() > 0)
        if not finite:
            for p in params:
                p.grad = None  # Adam skips a parameter without a gradient: no weight, no moment changes
            self.skipped = True
        self.engine.skipped_step = self.skipped


def make_engine(model: nn.Module, ctx: DistContext, config, loss_fn: nn.Module, sample: Batch | None, *,
                local_batches: bool = False):
    """The engine that runs the steps: the D x S x T grid (``config.stages`` or
    ``config.tensor_parallel`` > 1: ``flowtrain.train.hybrid``), ZeRO (``config.shard_states``) or data
    parallelism. ``sample``: a few rows of the input (the grid measures its layers on them)."""
    if hasattr(model, "id_step") and (config.stages > 1 or config.tensor_parallel > 1
                                      or config.shard_states != "none"):
        raise ValueError("--id-columns trains with data parallelism (--workers) only so far: leave out --stages, "
                         "--tensor-parallel and --shard-states")
    zero = config.shard_states != "none" and ctx.world_size > 1 and config.stages == 1 and config.tensor_parallel == 1
    if is_deferred(model) and not zero:  # a model built on the meta device: whole here (ZeRO makes its own shards)
        materialize(model)
    if hasattr(model, "shard_ids") and ctx.world_size > 1:  # ID tables row-wise over the ranks (flowtrain.train.ids)
        model.shard_ids(ctx.rank, ctx.world_size)
    if config.stages > 1 or config.tensor_parallel > 1:
        return GridEngine(model, ctx, config, loss_fn, pack(sample.x_num, sample.x_cat),
                          device=next(model.parameters()).device)
    if config.shard_states != "none":
        if ctx.world_size > 1:
            from flowtrain.parallel.zero.engine import ZeroEngine

            return ZeroEngine(model, ctx, config, loss_fn)
        if ctx.is_main:
            print(f"--shard-states {config.shard_states} with one worker: nothing to shard, the state stays whole",
                  flush=True)
    return DataParallelEngine(model, ctx, config, loss_fn, local_batches=local_batches)


class DataParallelEngine:
    """Every replica holds the whole model and trains its shard of each global batch (with
    ``local_batches``: the batch it is given, its own)."""

    def __init__(self, model: nn.Module, ctx: DistContext, config, loss_fn: nn.Module, *,
                 local_batches: bool = False):
        self.model, self.ctx, self.loss_fn = model, ctx, loss_fn
        self.local_batches = local_batches
        self.rng_rank = ctx.rank
        self.skipped_step = False  # set by a finite-gradient guard (Trainer(skip_non_finite=True))
        self.reducer = make_reducer(model, ctx, bucket_mb=config.bucket_mb)
        # --weight-decay (batch); the stream trainer has none
        self.optimizer = torch.optim.Adam(model.parameters(), lr=config.lr,
                                          weight_decay=getattr(config, "weight_decay", None) or 0.0)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def train_step(self, batch: Batch, target: torch.Tensor) -> tuple[int, float]:
        lo, hi = (0, len(batch)) if self.local_batches else local_rows(len(batch), self.ctx)
        loss_sum = None
        if hi > lo:
            loss_sum = sum_loss(self.loss_fn, self.model(batch.x_num[lo:hi], batch.x_cat[lo:hi]), target[lo:hi])
        elif getattr(self.model, "sharded", False):  # sharded ID tables: every rank takes part in the lookups
            self.model(batch.x_num[lo:hi], batch.x_cat[lo:hi])
        self.optimizer.zero_grad(set_to_none=True)
        global_n, mean_loss = self.reducer.backward(loss_sum, hi - lo)
        if not global_n:  # no replica had a row: nothing to step (Adam's moments would move the weights)
            return 0, 0.0
        self.optimizer.step()
        if hasattr(self.model, "id_step") and not self.skipped_step:  # ID tables: their own sparse optimizer step
            self.model.id_step(global_n, self.optimizer.param_groups[0]["lr"])
        self.reducer.sync_buffers(hi - lo)
        return global_n, mean_loss

    def sync_model(self) -> None:
        """The whole model is already here."""

    def optimizer_state(self) -> dict:
        return self.optimizer.state_dict()

    def stage_states(self) -> list[dict]:
        return [self.model.state_dict()]

    def shard_states(self) -> list:
        """No tensor shards: the model is whole."""
        return []

    def load(self, model_state: dict, optimizer_state: dict) -> None:
        self.model.load_state_dict(model_state)
        if "stages" in optimizer_state:
            grid = optimizer_state.get("grid", {})
            raise ValueError(f"this checkpoint was written with --stages {grid.get('stages', '?')} "
                             f"--tensor-parallel {grid.get('tensor_parallel', 1)}: resume it with the same options")
        self.optimizer.load_state_dict(optimizer_state)

    def close(self) -> None:
        self.reducer.close()


def memory_plan_of(model: nn.Module, ctx: DistContext, config, batch_size: int, id_rows: int | None = None,
                   keeps_best: bool = False):
    """The memory plan of this run's layout (``flowtrain.train.memory_plan``); ``id_rows``: the rows an ID table
    without ``--max-ids`` is planned for (the training rows); ``keeps_best``: ``fit``'s copy of the best weights."""
    replicas = max(1, ctx.world_size // (config.stages * config.tensor_parallel))
    return plan_memory(model, workers=replicas, shard_states=config.shard_states if replicas > 1 else "none",
                       stages=config.stages, tensor_parallel=config.tensor_parallel, batch_size=batch_size,
                       bucket_mb=config.bucket_mb, id_rows=id_rows,
                       dtype=torch_dtype(getattr(config, "dtype", "float32")), keeps_best=keeps_best)


def measured_memory(engine) -> dict:
    """Bytes of state this rank holds now (distinct tensor storages) and its peak RSS."""
    from flowtrain.parallel.zero.units import peak_rss_bytes, storage_bytes

    ids = id_tables_held(engine.model) if isinstance(getattr(engine, "model", None), nn.Module) else 0
    if hasattr(engine, "memory"):
        held = engine.memory()
        return {**held, "id_tables": ids, "total": held.get("total", 0) + ids} if ids else held
    params = [p for g in engine.optimizer.param_groups for p in g["params"]]
    state = [v for s in engine.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    buffers = [b.buffer for b in getattr(getattr(engine, "reducer", None), "buckets", [])]
    out = {"parameters": storage_bytes(params), "gradients": storage_bytes([p.grad for p in params]),
           "optimizer": storage_bytes(state), "buffers": storage_bytes(buffers)}
    if ids:  # the ID tables' rows, Adam state, bookkeeping and key index (IdTable.state_bytes)
        out["id_tables"] = ids
    return {**out, "total": sum(out.values()), "peak_rss": peak_rss_bytes()}

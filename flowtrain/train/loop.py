"""The single-process training loop: reads top to bottom, config is a plain dataclass.

Each epoch: shuffled batches (order from seed and epoch only), forward, loss, backward, step;
then validation; the best weights by validation loss are kept; early stopping after
``patience`` epochs without improvement; a checkpoint after every epoch with everything a
resume needs (model, optimizer, RNG, epoch, step, early-stopping state).
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from flowtrain.train import checkpoint
from flowtrain.train.loader import Batch, TabularDataset, TabularSplit, iter_batches
from flowtrain.train.metrics import MetricsLog, classification_metrics, regression_metrics
from flowtrain.parallel.launch import heartbeat
from flowtrain.train.model import LinearModel, TabularMLP, pack
from flowtrain.parallel import DistContext, local_rows, make_reducer, sum_loss


@dataclass
class TrainConfig:
    epochs: int = 8
    batch_size: int = 2048
    lr: float = 1e-3
    weight_decay: float = 0.0
    patience: int = 2
    seed: int = 0
    hidden: tuple[int, ...] = (128, 64)
    dropout: float = 0.3
    threads: int | None = None
    log_every: int = 50
    progress: bool = True
    bucket_mb: float = 1.0
    stages: int = 1  # pipeline stages (workers = replicas x stages)
    microbatches: int = 4
    schedule: str = "1f1b"  # or "gpipe"


@dataclass
class FitResult:
    model: nn.Module
    steps: int
    epochs_run: int
    best_epoch: int
    best_valid: dict
    stopped_early: bool
    seconds: float
    data_wait_seconds: float
    step_seconds: float
    history: list[dict] = field(default_factory=list)

    @property
    def data_wait_fraction(self) -> float:
        return self.data_wait_seconds / self.step_seconds if self.step_seconds else 0.0


def loss_function(task: str) -> nn.Module:
    return nn.BCEWithLogitsLoss() if task == "classification" else nn.MSELoss()


def target_scale(data: TabularDataset) -> tuple[float, float]:
    """Regression trains on a standardized target (mean 0, std 1 over the training split), so
    learning rates do not depend on the label's units; predictions are scaled back."""
    if data.spec.task != "regression":
        return 0.0, 1.0
    return float(data.stats["label_mean"]), float(data.stats.get("label_std", 1.0))


@torch.no_grad()
def predict(model: nn.Module, split: TabularSplit, batch_size: int = 65_536,
            scale: tuple[float, float] = (0.0, 1.0)) -> torch.Tensor:
    """Logits (classification) or predictions in the label's units (regression)."""
    model.eval()
    outs = [model(b.x_num, b.x_cat) for b in iter_batches(split, batch_size=batch_size, seed=0, epoch=0,
                                                         shuffle=False)]
    out = torch.cat(outs) if outs else torch.zeros(0)
    return out * scale[1] + scale[0]


def evaluate(model: nn.Module, split: TabularSplit, task: str, scale: tuple[float, float] = (0.0, 1.0)
             ) -> dict[str, float]:
    out = predict(model, split, scale=scale)
    return classification_metrics(out, split.y) if task == "classification" else regression_metrics(out, split.y)


def build_model(kind: str, data: TabularDataset, config: TrainConfig) -> nn.Module:
    torch.manual_seed(config.seed)
    if kind == "linear":
        return LinearModel(data.n_numeric, data.cardinalities)
    return TabularMLP(data.n_numeric, data.cardinalities, hidden=config.hidden, dropout=config.dropout)


def check_label(data: TabularDataset) -> None:
    values = data.stats.get("label_values", [])
    if len(values) < 2:
        raise ValueError(f"label column {data.spec.label!r} has a single value ({values[0] if values else 'none'}) "
                         f"in the training split: there is nothing to learn. Check --label, or for "
                         f"classification --positive-above.")


def fit(model: nn.Module, data: TabularDataset, config: TrainConfig, *, run_dir: Path | None = None,
        resume: bool = False, name: str = "model", ctx: DistContext | None = None) -> FitResult:
    """Train ``model``; with a distributed ``ctx`` every replica trains its shard of each global
    batch and gradients are reduced as sums and counts (``flowtrain.parallel``). Only rank 0
    writes metrics and checkpoints."""
    ctx = ctx or DistContext()
    if config.threads:
        torch.set_num_threads(config.threads)
    train, valid = data.split("train"), data.split("valid")
    loss_fn = loss_function(data.spec.task)
    shift, scale = target_scale(data)
    if config.stages > 1:
        sample = pack(train.x_num[:256], train.x_cat[:256])
        engine = PipelineEngine(model, ctx, config, loss_fn, sample)
    else:
        engine = DataParallelEngine(model, ctx, config, loss_fn)
    steps_per_epoch = math.ceil(len(train) / config.batch_size)
    writer = run_dir is not None and ctx.is_main
    log = MetricsLog(run_dir / "metrics.jsonl") if writer else None
    ckpt_dir = run_dir / "checkpoints" if run_dir else None

    # --- state, fresh or from the last checkpoint ---------------------------------------------
    epoch, step, best_loss, best_epoch, bad_epochs = 0, 0, math.inf, -1, 0
    best_state = {k: v.clone() for k, v in model.state_dict().items()}
    best_valid: dict = {}
    torch.manual_seed(config.seed)
    if resume and ckpt_dir and (path := checkpoint.latest(ckpt_dir)) is not None:
        state = checkpoint.load(path)
        engine.load(state["model"], state["optimizer"])
        torch.set_rng_state(state["rng"])
        epoch, step = int(state["epoch"]), int(state["step"])
        best_loss, best_epoch, bad_epochs = float(state["best_loss"]), int(state["best_epoch"]), int(state["bad_epochs"])
        best_state, best_valid = state["best_model"], dict(state["best_valid"])
        if log:
            log.truncate_after(step)
        if ctx.is_main:
            print(f"{name}: resumed from {path.name} (epoch {epoch}, step {step})", flush=True)
    elif log and not resume:
        log.path.unlink(missing_ok=True)

    def log_train(step_: int, epoch_: int, loss_sum: float, rows: int, since: float) -> None:
        log.write({"kind": "train", "model": name, "step": step_, "epoch": epoch_, "loss": loss_sum / rows,
                   "rows_per_s": rows / max(time.perf_counter() - since, 1e-9)})

    t_start = time.perf_counter()
    data_wait = step_time = 0.0
    stopped_early = False
    while epoch < config.epochs and bad_epochs < config.patience:
        # --- one epoch of training: each replica maps its shard, the reducer reduces -------------
        model.train()
        torch.manual_seed(config.seed * 1_000_003 + epoch * 1009 + ctx.rank)  # dropout: per epoch, rank
        bar = _progress(steps_per_epoch, f"{name} epoch {epoch + 1}/{config.epochs}", config.progress and ctx.is_main)
        batches = iter_batches(train, batch_size=config.batch_size, seed=config.seed, epoch=epoch)
        running, seen, t_log = 0.0, 0, time.perf_counter()
        while True:
            t0 = time.perf_counter()
            batch: Batch | None = next(batches, None)
            t1 = time.perf_counter()
            if batch is None:
                break
            global_n, mean_loss = engine.train_step(batch, (batch.y - shift) / scale)
            t2 = time.perf_counter()
            heartbeat()
            data_wait += t1 - t0
            step_time += t2 - t0
            step += 1
            running += mean_loss * global_n
            seen += global_n
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{mean_loss:.4f}", rows_s=f"{global_n / max(t2 - t0, 1e-9):,.0f}",
                                refresh=False)
            if log and step % config.log_every == 0:
                log_train(step, epoch, running, seen, t_log)
                running, seen, t_log = 0.0, 0, time.perf_counter()
        if log and seen:
            log_train(step, epoch, running, seen, t_log)
        if bar is not None:
            bar.close()

        # --- validation, best weights, early stopping --------------------------------------------
        engine.sync_model()  # pipeline stages: every rank gets the whole current model
        metrics = evaluate(model, valid, data.spec.task, (shift, scale))
        if metrics["loss"] < best_loss - 1e-6:
            best_loss, best_epoch, bad_epochs, best_valid = metrics["loss"], epoch, 0, metrics
            best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        else:
            bad_epochs += 1
        epoch += 1
        if log:
            log.write({"kind": "valid", "model": name, "step": step, "epoch": epoch - 1, **metrics})
        if ctx.is_main:
            print(f"{name}: epoch {epoch} valid " + " ".join(f"{k}={v:.4f}" for k, v in metrics.items()),
                  flush=True)

        # --- checkpoint ---------------------------------------------------------------------------
        optimizer_state = engine.optimizer_state()  # a collective under pipeline parallelism
        if ckpt_dir and writer:
            checkpoint.save(ckpt_dir, step, {
                "model": model.state_dict(), "stages": engine.stage_states(),
                "optimizer": optimizer_state, "rng": torch.get_rng_state(),
                "epoch": epoch, "step": step, "best_loss": best_loss, "best_epoch": best_epoch,
                "bad_epochs": bad_epochs, "best_model": best_state, "best_valid": best_valid,
                "data_position": {"split": "train", "epoch": epoch, "batch": 0, "world_size": ctx.world_size,
                                  "stages": config.stages},
                "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(config).items()},
            })
    stopped_early = bad_epochs >= config.patience and epoch < config.epochs
    engine.close()
    model.load_state_dict(best_state)
    return FitResult(model, step, epoch, best_epoch + 1, best_valid, stopped_early,
                     time.perf_counter() - t_start, data_wait, step_time,
                     history=log.read() if log else [])


class DataParallelEngine:
    """Every replica holds the whole model and trains its shard of each global batch."""

    def __init__(self, model: nn.Module, ctx: DistContext, config: TrainConfig, loss_fn: nn.Module):
        self.model, self.ctx, self.loss_fn = model, ctx, loss_fn
        self.reducer = make_reducer(model, ctx, bucket_mb=config.bucket_mb)
        self.optimizer = torch.optim.Adam(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)

    def train_step(self, batch: Batch, target: torch.Tensor) -> tuple[int, float]:
        lo, hi = local_rows(len(batch), self.ctx)
        loss_sum = None
        if hi > lo:
            loss_sum = sum_loss(self.loss_fn, self.model(batch.x_num[lo:hi], batch.x_cat[lo:hi]), target[lo:hi])
        self.optimizer.zero_grad(set_to_none=True)
        global_n, mean_loss = self.reducer.backward(loss_sum, hi - lo)
        self.optimizer.step()
        self.reducer.sync_buffers(hi - lo)
        return global_n, mean_loss

    def sync_model(self) -> None:
        """The whole model is already here."""

    def optimizer_state(self) -> dict:
        return self.optimizer.state_dict()

    def stage_states(self) -> list[dict]:
        return [self.model.state_dict()]

    def load(self, model_state: dict, optimizer_state: dict) -> None:
        self.model.load_state_dict(model_state)
        if "stages" in optimizer_state:
            raise ValueError("this checkpoint was written by a pipeline-parallel run: resume it with the same --stages")
        self.optimizer.load_state_dict(optimizer_state)

    def close(self) -> None:
        self.reducer.close()


class PipelineEngine:
    """Each rank holds one stage of the model (``--stages``), replicas of a stage reduce together."""

    def __init__(self, model: nn.Sequential, ctx: DistContext, config: TrainConfig, loss_fn: nn.Module,
                 sample: torch.Tensor):
        import torch.distributed as dist

        from flowtrain.parallel.pipeline import StageWorker, grid_position
        from flowtrain.parallel.schedules import SCHEDULES
        from flowtrain.parallel.stages import plan_stages, plan_with_bounds, stage_module

        self.ctx, self.model, self.stages = ctx, model, config.stages
        self.pos, group = grid_position(ctx, config.stages)
        # Rank 0 measures the layers and decides the cut; every rank uses the same cut.
        plan = plan_stages(model, config.stages, sample) if ctx.is_main else None
        shared = [plan.bounds if plan else None]
        dist.broadcast_object_list(shared, src=0)
        if plan is None:
            plan = plan_with_bounds(model, shared[0], sample)
        self.plan = plan
        if ctx.is_main:
            print(f"pipeline: {config.stages} stages x {self.pos.replicas} replicas, {config.microbatches} "
                  f"micro-batches, {config.schedule}\n{plan.table(model)}", flush=True)
        self.module = stage_module(model, plan, self.pos.stage)
        in_shape = plan.out_shapes[self.pos.stage - 1] if self.pos.stage else tuple(sample.shape[1:])
        self.worker = StageWorker(self.module, self.pos, group, SCHEDULES[config.schedule](config.stages,
                                  config.microbatches), config.microbatches, in_shape, loss_fn,
                                  bucket_mb=config.bucket_mb)
        self.optimizer = torch.optim.Adam(self.module.parameters(), lr=config.lr, weight_decay=config.weight_decay)

    def train_step(self, batch: Batch, target: torch.Tensor) -> tuple[int, float]:
        import torch.distributed as dist

        from flowtrain.parallel.pipeline import replica_rows

        pos = self.pos
        lo, hi = replica_rows(len(batch), pos)
        x = pack(batch.x_num[lo:hi], batch.x_cat[lo:hi]) if pos.is_first else None
        self.optimizer.zero_grad(set_to_none=True)
        stats = self.worker.step(x, target[lo:hi] if pos.is_last else None, hi - lo)
        self.optimizer.step()
        totals = torch.tensor([stats.loss_sum, float(hi - lo)] if pos.is_last else [0.0, 0.0], dtype=torch.float64)
        dist.all_reduce(totals)  # the loss reaches rank 0 (and everyone)
        n = int(totals[1])
        return n, float(totals[0]) / n if n else 0.0

    def _gather(self, obj) -> list:
        import torch.distributed as dist

        out = [None] * self.ctx.world_size
        dist.all_gather_object(out, obj)
        return out[: self.stages]  # replica 0's stages: ranks 0..S-1

    def sync_model(self) -> None:
        """Bring every stage's current weights into this rank's full model (for evaluation)."""
        from flowtrain.parallel.stages import merge_stage_states

        self._states = self._gather(self.module.state_dict())
        self.model.load_state_dict(merge_stage_states(self._states))

    def stage_states(self) -> list[dict]:
        return self._states

    def optimizer_state(self) -> dict:
        return {"stages": self._gather(self.optimizer.state_dict())}

    def load(self, model_state: dict, optimizer_state: dict) -> None:
        self.model.load_state_dict(model_state)
        stages = optimizer_state.get("stages")
        if stages is None or len(stages) != self.stages:
            raise ValueError(f"this checkpoint was written with {len(stages) if stages else 1} stage(s): "
                             f"resume it with --stages {len(stages) if stages else 1}")
        self.optimizer.load_state_dict(stages[self.pos.stage])

    def close(self) -> None:
        self.worker.close()


def baseline_metrics(data: TabularDataset, split: TabularSplit) -> dict[str, float]:
    """Predict the training mean (regression) or the majority class (classification)."""
    mean = float(data.stats["label_mean"])
    if data.spec.task == "classification":
        p = min(max(mean, 1e-6), 1 - 1e-6)
        logits = torch.full((len(split),), math.log(p / (1 - p)))
        out = classification_metrics(logits, split.y)
        out["accuracy"] = float((split.y == (1.0 if mean > 0.5 else 0.0)).double().mean())
        return out
    return regression_metrics(torch.full((len(split),), mean), split.y)


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="step", leave=False, dynamic_ncols=True, mininterval=0.5)


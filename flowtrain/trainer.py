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
from typing import Callable

import torch
from torch import nn

from flowtrain import checkpoint
from flowtrain.data import Batch, TabularDataset, TabularSplit, iter_batches
from flowtrain.metrics import MetricsLog, classification_metrics, regression_metrics
from flowtrain.launch import heartbeat
from flowtrain.model import LinearModel, TabularMLP
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
    reducer = make_reducer(model, ctx, bucket_mb=config.bucket_mb)
    loss_fn = loss_function(data.spec.task)
    shift, scale = target_scale(data)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
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
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
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
            lo, hi = local_rows(len(batch), ctx)
            loss_sum = None
            if hi > lo:
                out = model(batch.x_num[lo:hi], batch.x_cat[lo:hi])
                loss_sum = sum_loss(loss_fn, out, (batch.y[lo:hi] - shift) / scale)
            optimizer.zero_grad(set_to_none=True)
            global_n, mean_loss = reducer.backward(loss_sum, hi - lo)
            optimizer.step()
            reducer.sync_buffers(hi - lo)
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
        if ckpt_dir and writer:
            checkpoint.save(ckpt_dir, step, {
                "model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state(),
                "epoch": epoch, "step": step, "best_loss": best_loss, "best_epoch": best_epoch,
                "bad_epochs": bad_epochs, "best_model": best_state, "best_valid": best_valid,
                "data_position": {"split": "train", "epoch": epoch, "batch": 0, "world_size": ctx.world_size},
                "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(config).items()},
            })
    stopped_early = bad_epochs >= config.patience and epoch < config.epochs
    reducer.close()
    model.load_state_dict(best_state)
    return FitResult(model, step, epoch, best_epoch + 1, best_valid, stopped_early,
                     time.perf_counter() - t_start, data_wait, step_time,
                     history=log.read() if log else [])


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


ModelFactory = Callable[[TabularDataset, TrainConfig], nn.Module]

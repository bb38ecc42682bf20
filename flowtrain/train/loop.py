"""The training loop: reads top to bottom, config is a plain dataclass.

Training is a step budget over seeded batches (order from seed and epoch only). Whatever is not
given is chosen from the training split (``plan_training``, printed; ``flowtrain.train.plan``): the
batch size (capped relative to the split), the budget, a learning-rate schedule (linear warm-up, then
cosine decay to 5% of ``lr``), how often to evaluate. Every ``eval_every`` steps (and at step 0, the initial
model) the model is evaluated on the validation split; the best weights by ``select_by`` (a
validation metric, never test data) are kept; training stops early after ``patience``
evaluations without a better one; each evaluation writes a checkpoint with everything a resume
needs (model, optimizer, RNG, step, early-stopping state). The learning-rate schedule spans the
budget given (``--steps`` / ``--epochs``), else the table's; the evaluation points depend on the
table only. With the same ``decay_steps`` a run continued with a larger ``--epochs`` equals one
that had it from the start.

``fit`` is the batch composition of the one training core (``flowtrain.train.trainer``): its source is
the dataset's shards (seeded batches), its ``Trainer`` runs each step through the engine
(``DataParallelEngine``, ``ZeroEngine`` or ``GridEngine``), its sinks are the checkpoints, metrics.jsonl,
TensorBoard and training.json.
"""
from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from connectors.atomic import atomic_write
from connectors.dataset_spec import MAX_CLASSES, positive_class_of  # MAX_CLASSES: the ETL stops at it too
from flowtrain.observe.board import Board
from flowtrain.parallel import DistContext
from flowtrain.parallel.deferred import is_deferred, set_target
from flowtrain.parallel.device import local_world_size, move_batch, resolve_device, to_device
from flowtrain.parallel.launch import cap_worker, heartbeat
from flowtrain.parallel.memcap import CAP_ENV
from flowtrain.train import checkpoint
from flowtrain.train.baselines import majority_outputs
from flowtrain.train.checkpoint_manager import CheckpointManager, saved_stage_bounds
from flowtrain.train.class_weights import class_weights_of, weighted_metrics
from flowtrain.train.loader import Batch, TabularDataset, TabularSplit, iter_batches, target_scale
from flowtrain.train.metrics import (
    MetricsLog,
    better,
    clears,
    metrics_of,
    scalars,
)
from flowtrain.train.plan import SMALL_STEP, TrainConfig, TrainPlan, plan_training
from flowtrain.train.preload import import_training
from flowtrain.train.rundir.files import RunFiles
from flowtrain.train.rundir.marker import run_id_of
from flowtrain.train.trainer import Trainer, loss_function, measured_memory, memory_plan_of


# ---------------------------------------------------------------------------------------------
# Models, losses, evaluation
# ---------------------------------------------------------------------------------------------
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
    best_step: int = 0
    plan: TrainPlan | None = None
    memory: dict | None = None  # training.json's "memory": the plan and each rank's measured peak
    # ZeRO-3 (no rank holds the whole model): write_model(path, writer) writes it, a collective (``model`` is empty)
    write_model: Callable[[Path, bool], None] | None = None

    @property
    def data_wait_fraction(self) -> float:
        return self.data_wait_seconds / self.step_seconds if self.step_seconds else 0.0


@torch.no_grad()
def predict(model: nn.Module, split: TabularSplit, batch_size: int = 65_536,
            scale: tuple[float, float] = (0.0, 1.0)) -> torch.Tensor:
    """Logits (classification: ``[N]`` binary, ``[N, K]`` K-class) or predictions in the label's units."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    outs = [model(to_device(b.x_num, device), to_device(b.x_cat, device)).cpu()
            for b in iter_batches(split, batch_size=batch_size, seed=0, epoch=0, shuffle=False)]
    model.train(was_training)
    out = torch.cat(outs) if outs else torch.zeros(0)
    return out * scale[1] + scale[0]


def evaluate(model: nn.Module, split: TabularSplit, task: str, scale: tuple[float, float] = (0.0, 1.0),
             classes=None, class_weights: torch.Tensor | None = None, batch_size: int = 65_536) -> dict:
    """The task's metrics of ``model`` on ``split`` (with ``class_weights`` or the split's sample weights,
    ``--weight-column``: the weighted ones too, ``flowtrain.train.class_weights.weighted_metrics``)."""
    out = predict(model, split, batch_size=batch_size, scale=scale)
    return {**metrics_of(out, split.y, task, classes),
            **weighted_metrics(out, split.y, class_weights, getattr(split, "w", None), regression=task == "regression")}


def check_label(data: TabularDataset) -> None:
    """A label the training split gives one value (or too many classes) is an error saying what to check."""
    label = data.spec.label
    if data.spec.task == "classification" and data.stats.get("classes") is not None:
        classes = data.stats["classes"]
        if len(classes) > MAX_CLASSES:
            raise ValueError(f"label column {label!r} has {len(classes):,} classes in the training split (more than "
                             f"{MAX_CLASSES:,}): it looks like a numeric target; pass --task regression, or "
                             f"--positive-above T for a binary target")
        values = classes
    else:
        values = data.stats.get("label_values", [])
    if len(values) < 2:
        raise ValueError(f"label column {label!r} has a single value ({values[0] if values else 'none'}) "
                         f"in the training split: there is nothing to learn. Check --label, or for "
                         f"classification --positive-above.")


def positive_class_line(data: TabularDataset) -> str | None:
    """The binary label's positive class, said once per run: which class, and by which rule."""
    positive = positive_class_of(data.spec, data.stats)
    if positive is None:
        return None
    spec = data.spec
    if spec.positive_above is not None:
        return (f"classes: label {spec.label!r} > {spec.positive_above:g} is the positive class {positive!r} "
                f"(--positive-above)")
    negative = next((c for c in data.classes or [] if c != positive), "?")
    rule = "--positive-class" if spec.positive_class is not None else \
        "the later of the two in sorted order; --positive-class chooses"
    return f"classes: {positive!r} is the positive class, {negative!r} the negative ({rule})"


def baseline_metrics(data: TabularDataset, split: TabularSplit) -> dict:
    """Predict the training mean (regression) or the class frequencies (classification)."""
    return metrics_of(majority_outputs(data, len(split)), split.y, data.spec.task, data.classes)


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------
def fit(model: nn.Module, data: TabularDataset, config: TrainConfig, *, run_dir: Path | None = None,
        resume: bool = False, name: str = "model", ctx: DistContext | None = None) -> FitResult:
    """Train ``model``; with a distributed ``ctx`` every replica trains its shard of each global
    batch and gradients are reduced as sums and counts (``flowtrain.parallel``). Only rank 0
    writes metrics and checkpoints."""
    ctx = ctx or DistContext()
    threads_before = torch.get_num_threads()
    if config.threads:
        torch.set_num_threads(config.threads)
    device = resolve_device(config.device, local_rank=ctx.local_rank, local_world=local_world_size())
    if is_deferred(model):  # built on the meta device: its values are made there, by the engine (ZeRO-3: its shards)
        set_target(model, device=device)
    else:
        model.to(device)
    from flowtrain.train.shards import open_split

    train = open_split(data, "train", memory_budget=config.memory_budget)
    valid = open_split(data, "valid", memory_budget=config.memory_budget)
    if os.environ.get(CAP_ENV):  # capped: training's lazy imports mapped before the cap is calibrated
        import_training()
    cap_worker(ctx.rank, ctx.is_main)  # --worker-memory: from here on, its data open (a no-op without the option)
    plan = plan_training(config, len(train), data.kind)
    if not config.threads and plan.batch_size * max(config.hidden or (1,)) <= SMALL_STEP:
        torch.set_num_threads(1)  # a small step: more threads only wait for each other
    if ctx.is_main:
        for split in (train, valid):
            if hasattr(split, "describe"):
                print(f"{name}: {split.describe()}", flush=True)
        print(f"{name}: {plan.describe(len(train))}", flush=True)
    weights = class_weights_of(config, data)  # --class-weight: the loss and the weighted metrics
    loss_fn = loss_function(data.spec.task, data.outputs, weights, sample_weights=bool(data.spec.weight_column))
    shift, scale = target_scale(data)
    classes = data.classes
    files = RunFiles(run_dir) if run_dir else None
    ckpt_dir = files.checkpoints if files else None
    run_id = run_id_of(run_dir)  # the run's checkpoints only: never another run's (flowtrain.train.rundir)
    # a resume reads its checkpoint before the engine is made: the newest that verifies and loads (a corrupt
    # newer one is skipped, logged); none is a CheckpointError naming each file, never a silent fresh start
    found = checkpoint.require_latest(ckpt_dir, run_id=run_id) if resume and ckpt_dir else None
    if found is not None and config.stages > 1:  # a resumed grid keeps the checkpoint's stage cut
        bounds = saved_stage_bounds(found[1], config.stages)
        if bounds is not None:
            config = replace(config, stage_bounds=bounds)
    grid = config.stages > 1 or config.tensor_parallel > 1  # the grid measures its layers on a few rows
    sample = next(iter_batches(train, batch_size=256, seed=0, epoch=0, shuffle=False)) if grid else None
    mem_plan = memory_plan_of(model, ctx, config, plan.batch_size, id_rows=len(train),  # shapes (a meta model's too)
                              keeps_best=True)
    trainer = Trainer(model, ctx, config, loss_fn, sample, seed=config.seed, target_scale=(shift, scale))
    engine = trainer.engine
    # ZeRO-3: the model lives in the engine's shards (no rank holds it whole): evaluated layer by layer, its best
    # weights kept as this rank's pieces, the fitted model written streamed (``FitResult.write_model``)
    holds_shards = bool(getattr(engine, "holds_shards", False))
    # and its best weights stay in their own checkpoint (None: "on disk, at best_step"), not in memory beside it
    best_on_disk = holds_shards and ckpt_dir is not None
    if ctx.is_main:
        print(f"{name}: {mem_plan.describe()}", flush=True)
    writer = run_dir is not None and ctx.is_main
    board = Board(run_dir) if writer else None  # TensorBoard: rank 0 mirrors metrics.jsonl, adds the rest
    log = MetricsLog(files.metrics, board=board) if writer else None
    # what differs per worker (time waiting on data, step time): one TensorBoard directory per rank
    worker_board = Board(run_dir, worker=ctx.rank) if run_dir is not None and ctx.world_size > 1 else None
    if ckpt_dir and writer:
        checkpoint.remove_temporaries(ckpt_dir, run_id)  # what a crash of this run left
    # what a checkpoint holds of the model and its engine (flowtrain.train.checkpoint_manager); the rest is below
    checkpoints = CheckpointManager(ckpt_dir, model, engine, writer=writer, world_size=ctx.world_size,
                                    shard_states=config.shard_states, run_id=run_id)

    # --- state, fresh or from the last checkpoint ---------------------------------------------
    step, best_step, bad_evals = 0, 0, 0
    best_valid: dict | None = None
    start_valid: dict | None = None  # the initial model's (its linear part's) validation metrics
    best_state = None if best_on_disk else checkpoints.weights()
    resumed = False
    if found is not None:
        path, state = found
        best_state = checkpoints.restore(path, state, option="--resume", fix="restore the run's own checkpoint, or "
                                         "start the run over with --overwrite")
        step, bad_evals = int(state["step"]), int(state.get("bad_evals", state.get("bad_epochs", 0)))
        best_step = int(state.get("best_step", 0))
        if best_state is None and not best_on_disk:  # a ZeRO-3 run's best weights, in their own checkpoint
            best_state = checkpoint.read_whole(checkpoint.shards_of(ckpt_dir, best_step), model, ("model",))["model"]
        best_valid = dict(state["best_valid"]) or None
        start_valid = dict(state.get("start_valid") or {}) or best_valid
        resumed = True
        if log:
            log.truncate_after(step)
        if ctx.is_main:
            print(f"{name}: resumed from {path.name} (step {step})", flush=True)
            if state.get("decay_steps") not in (None, plan.horizon):  # a new budget: the schedule follows it
                print(f"{name}: the learning-rate schedule now spans {plan.horizon} steps (it spanned "
                      f"{state['decay_steps']}: the budget changed); --decay-steps {state['decay_steps']} keeps it",
                      flush=True)
    elif log and not resume:
        log.path.unlink(missing_ok=True)
    # Progress for the launcher's watch (--failure-timeout) between the slow steps before the first training step: a
    # worker building its engine and restoring a checkpoint on a loaded machine is not a hang
    heartbeat(every_s=0.0)

    def validate(step_: int) -> tuple[dict, bool]:
        if not holds_shards:  # ZeRO-3 evaluates layer by layer: every rank runs every batch, gathering each layer
            engine.sync_model()  # pipeline stages: every rank gets the whole current model
        # ZeRO-3: in training batches (a capped worker's activations are planned for them, not for 65,536 rows)
        metrics = evaluate(model, valid, data.spec.task, (shift, scale), classes, weights,
                           batch_size=plan.batch_size if holds_shards else 65_536)
        if log:
            log.write({"kind": "valid", "model": name, "step": step_, "epoch": step_ // plan.steps_per_epoch,
                       **scalars(metrics)})
        if ctx.is_main:
            print(f"{name}: step {step_} valid " + " ".join(f"{k}={v:.4f}" for k, v in scalars(metrics).items()),
                  flush=True)
        # A checkpoint replaces the initial model (whose linear part is the fitted baseline) only
        # when it is better by more than one standard error on the validation split; after that,
        # any better one replaces the best.
        improved = better(metrics, best_valid, plan.select_by) and (
            start_valid is None or best_step > 0 or clears(metrics, start_valid, plan.select_by, len(valid)))
        return metrics, improved

    def save_checkpoint(step_: int) -> None:
        if ckpt_dir is None:  # every rank: the same run directory
            return
        collected = checkpoints.collect(step_, best=best_state)  # a collective
        epoch = step_ // plan.steps_per_epoch
        checkpoints.write(step_, collected, {
            "epoch": epoch, "step": step_, "best_step": best_step,
            "best_loss": float(best_valid["loss"]) if best_valid else math.inf,
            "bad_evals": bad_evals, "best_valid": best_valid or {},
            "start_valid": start_valid or {}, "decay_steps": plan.horizon,
            "data_position": {"split": "train", "epoch": epoch, "batch": step_ % plan.steps_per_epoch,
                              "world_size": ctx.world_size, "stages": config.stages},
            "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(config).items()},
        }, keep_steps=(best_step,) if best_state is None else ())

    trainer.schedule(plan.scheduler(engine.optimizer, start=step))  # the learning rate: torch's LambdaLR
    t_start = time.perf_counter()
    data_wait = step_time = 0.0
    if not resumed:  # the initial model is a candidate too (its linear part may be a fitted model)
        best_valid, _ = validate(0)
        start_valid = best_valid
        best_state = None if best_on_disk else checkpoints.weights()
        if best_on_disk:
            save_checkpoint(0)  # the initial model is the best so far: on disk, as every later best is

    heartbeat(every_s=0.0)  # the initial model is evaluated (and checkpointed)
    bar = _progress(plan.steps, name, not config.no_progress and ctx.is_main, initial=step)
    running, seen, t_log = 0.0, 0, time.perf_counter()
    while step < plan.steps and bad_evals < plan.patience:
        # --- one epoch (or the rest of one): each replica maps its shard, the reducer reduces ----
        epoch, first = divmod(step, plan.steps_per_epoch)
        model.train()
        batches = iter_batches(train, batch_size=plan.batch_size, seed=config.seed, epoch=epoch, start_batch=first)
        while step < plan.steps and bad_evals < plan.patience:
            t0 = time.perf_counter()
            batch: Batch | None = next(batches, None)
            t1 = time.perf_counter()
            if batch is None:
                break
            batch = move_batch(batch, device)  # pinned memory, non-blocking copy on a GPU
            done = trainer.step(batch, step)
            global_n, mean_loss = done.rows, done.loss
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
            if worker_board is not None and step % config.log_every == 0:
                worker_board.scalars("worker", {"data_wait_fraction": data_wait / max(step_time, 1e-12),
                                                "seconds_per_step": step_time / max(step, 1)}, step)
            if log and step % config.log_every == 0:
                _log_train(log, name, step, plan, running, seen, t_log)
                running, seen, t_log = 0.0, 0, time.perf_counter()
            if step % plan.eval_every == 0 or step == plan.steps:
                # --- validation, best weights, early stopping, checkpoint -------------------------
                if log and seen:
                    _log_train(log, name, step, plan, running, seen, t_log)
                    running, seen, t_log = 0.0, 0, time.perf_counter()
                metrics, improved = validate(step)
                if improved:
                    best_valid, best_step, bad_evals = metrics, step, 0
                    best_state = None if best_on_disk else checkpoints.weights()
                else:
                    bad_evals += 1
                save_checkpoint(step)
                model.train()
    if bar is not None:
        bar.close()
    stopped_early = bad_evals >= plan.patience and step < plan.steps
    from flowtrain.parallel.context import gather_json

    memory = {"plan": mem_plan.as_dict(), "measured": gather_json(measured_memory(engine))}  # a collective
    if board is not None:  # TensorBoard: memory/plan_* and memory/rank<r>_* in bytes
        board.scalars("memory", {f"plan_{k}": v for k, v in memory["plan"].items()}, step)
        for r, held in enumerate(memory["measured"]):
            board.scalars("memory", {f"rank{r}_{k}": v for k, v in held.items()}, step)
    trainer.close()
    for b in (board, worker_board):
        if b is not None:
            b.close()
    model.to("cpu")  # the fitted model comes back on the CPU
    if holds_shards and best_state is None:  # the best weights from their checkpoint, into the shards in place
        best = checkpoint.shards_of(ckpt_dir, best_step)
        engine.load_model_pieces(lambda tensors, chunks: checkpoint.load_shards(best, tensors, chunks))
    elif holds_shards:  # the best weights as this rank's pieces: the model is written streamed (write_model)
        engine.load_pieces(best_state)
    else:
        model.load_state_dict(best_state)
    if getattr(model, "sharded", False):  # every rank gets the ID tables whole: the fitted model
        model.unshard_ids()
    torch.set_num_threads(threads_before)
    if writer:
        atomic_write(files.training, json.dumps({
            "plan": asdict(plan), "best_step": best_step, "steps": step, "stopped_early": stopped_early,
            "select_by": plan.select_by, "best_valid": best_valid, "memory": memory}, default=float))
    spe = plan.steps_per_epoch
    return FitResult(model, step, math.ceil(step / spe), best_step // spe + (1 if best_step % spe else 0),
                     best_valid or {}, stopped_early, time.perf_counter() - t_start, data_wait, step_time,
                     history=log.read() if log else [], best_step=best_step, plan=plan,
                     memory=memory, write_model=engine.write_model if holds_shards else None)


def _log_train(log: MetricsLog, name: str, step: int, plan: TrainPlan, loss_sum: float, rows: int,
               since: float) -> None:
    log.write({"kind": "train", "model": name, "step": step, "epoch": (step - 1) // plan.steps_per_epoch,
               "loss": loss_sum / rows, "lr": plan.lr_at(step - 1),
               "rows_per_s": rows / max(time.perf_counter() - since, 1e-9)})


def _progress(total: int, desc: str, enabled: bool, initial: int = 0):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="step", leave=False, dynamic_ncols=True,
                mininterval=0.5)

"""What to train for: a batch run's engine config (``TrainConfig``: its options, ``flowtrain.train.options``)
and the plan chosen from them and the training split (``plan_training``, printed): whatever is not given is
chosen from the table (the batch size, capped relative to the split; the budget; a learning-rate schedule of
linear warm-up then cosine decay to 5% of ``lr``; how often to evaluate), explicit options win. ``fit`` (``flowtrain.train.loop``) trains to the plan.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from connectors.fields import options_of
from flowtrain.train.metrics import check_select_by
from flowtrain.train.options import EngineSettings, ParallelOptions, TrainOptions

__all__ = ["AUTO_BATCH", "AUTO_BATCH_FRACTION", "AUTO_EPOCHS", "AUTO_EVALS", "AUTO_STEPS", "MIN_LR_FRACTION",
           "SMALL_STEP", "TrainConfig", "TrainPlan", "plan_training"]


#: The automatic choices, in one place.
AUTO_BATCH = (32, 2048)  # smallest and largest automatic batch size
AUTO_BATCH_FRACTION = 16  # the automatic batch holds at most 1/16 of the training split
AUTO_EPOCHS = 30  # the automatic budget in passes over the training split ...
AUTO_STEPS = (800, 2000)  # ... within these bounds
AUTO_EVALS = 50  # at most this many evaluations over the automatic budget (at least one per epoch)
MIN_LR_FRACTION = 0.05  # the cosine decay ends at this fraction of lr
SMALL_STEP = 1 << 15  # batch x widest layer up to this: one torch thread (unless --threads)


@dataclass
class TrainConfig(TrainOptions, ParallelOptions, EngineSettings):
    """A batch run's engine config: its options (``TrainOptions``, ``ParallelOptions``: declared once in
    ``flowtrain.train.options``, where ``flowtrain batch`` takes them from) and what the run sets, not the user
    (``EngineSettings`` and the two below). Its ``weight_decay`` is ``--weight-decay`` (an option here): left unset,
    the batch run sets the table's (``flowtrain.commands.batch.job``: the linear start's penalty), else 0."""
    log_every: int = 50  # steps between training-loss lines in metrics.jsonl
    init_wide: str | None = None  # a fitted LinearModel's state_dict file: the wide part starts there (the batch job's)

    def __post_init__(self) -> None:
        if self.weight_decay is None:  # the engine reads a number
            self.weight_decay = 0.0


def train_config(options) -> TrainConfig:
    """The engine's ``TrainConfig`` of a command's options (``BatchJob``): its training and parallelism options, as
    they are (the fields of ``TrainOptions`` and ``ParallelOptions``, declared once in ``flowtrain.train.options``)."""
    return TrainConfig(**{opt.name: getattr(options, opt.name) for opt in options_of(TrainConfig)})


@dataclass
class TrainPlan:
    batch_size: int
    steps: int  # the budget
    steps_per_epoch: int
    horizon: int  # the schedule's length (the decay ends here): --decay-steps, the budget given, or the table's
    warmup_steps: int
    eval_every: int
    patience: int
    select_by: str
    lr: float
    chosen: list[str] = field(default_factory=list)  # what was chosen from the table

    def lr_factor(self, step: int) -> float:
        """The schedule as a multiple of ``lr``: linear warm-up, then cosine decay to ``MIN_LR_FRACTION``."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.horizon - self.warmup_steps))
        return MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress))

    def lr_at(self, step: int) -> float:
        return self.lr * self.lr_factor(step)

    def scheduler(self, optimizer: torch.optim.Optimizer, start: int = 0) -> torch.optim.lr_scheduler.LambdaLR:
        """The schedule as torch's ``LambdaLR`` on ``optimizer``, at step ``start`` (its rate set; a resumed
        run starts where it stopped); ``scheduler.step()`` after each optimizer step moves it on."""
        for group in optimizer.param_groups:
            group["initial_lr"] = self.lr  # the peak: the base every factor multiplies
        return torch.optim.lr_scheduler.LambdaLR(optimizer, self.lr_factor, last_epoch=start - 1)

    def describe(self, rows: int) -> str:
        auto = set(self.chosen)

        def mark(name: str) -> str:
            return " (chosen)" if name in auto else ""

        return (f"batch size {self.batch_size}{mark('batch_size')} ({self.steps_per_epoch} steps per epoch of "
                f"{rows:,} rows), {self.steps} steps{mark('steps')} ({self.steps / self.steps_per_epoch:.1f} epochs), "
                f"lr {self.lr:g} with {self.warmup_steps} warm-up steps{mark('warmup_steps')} then cosine decay "
                f"over {self.horizon} steps{mark('decay_steps')}, validation every {self.eval_every} steps"
                f"{mark('eval_every')}, "
                f"patience {self.patience} validations, best by validation {self.select_by}{mark('select_by')}")


def plan_training(config: TrainConfig, train_rows: int, kind: str) -> TrainPlan:
    """Batch size, budget, schedule and evaluation points for a training split of ``train_rows``."""
    if train_rows < 1:
        raise ValueError("the training split is empty: there is nothing to train on")
    chosen = []
    batch = config.batch_size
    if batch is None:
        chosen.append("batch_size")
        auto = 2 ** int(math.log2(max(train_rows // AUTO_BATCH_FRACTION, 1)))
        batch = min(max(auto, AUTO_BATCH[0]), AUTO_BATCH[1])
    batch = max(1, min(int(batch), train_rows))
    spe = math.ceil(train_rows / batch)
    table = min(max(AUTO_EPOCHS * spe, AUTO_STEPS[0]), AUTO_STEPS[1])  # the budget the table suggests
    if config.steps is not None:
        steps = int(config.steps)
    elif config.epochs is not None:
        steps = int(config.epochs) * spe
    else:
        chosen.append("steps")
        steps = table
    # The schedule spans the budget the user gave (as Lightning's and Hugging Face's schedulers span
    # max_steps), else the table's budget; --decay-steps fixes it, e.g. for runs that must share their
    # first steps (a run continued with --resume and a larger budget equals one that had it from the start).
    if config.decay_steps is not None:
        horizon = int(config.decay_steps)
    else:
        horizon = steps
        if config.steps is None and config.epochs is None:
            chosen.append("decay_steps")
    warmup = config.warmup_steps
    if warmup is None:
        chosen.append("warmup_steps")
        warmup = max(1, min(horizon // 20, 200))
    eval_every = config.eval_every
    if eval_every is None:
        chosen.append("eval_every")
        eval_every = spe if config.epochs is not None else max(spe, table // AUTO_EVALS)
    select_by = check_select_by(config.select_by, kind)
    if config.select_by is None:
        chosen.append("select_by")
    return TrainPlan(batch, steps, spe, horizon, int(warmup), max(1, int(eval_every)), int(config.patience),
                     select_by, float(config.lr), chosen)

"""The warm-up + cosine schedule runs through torch.optim.lr_scheduler (issue 30 item 7): the rates an
optimizer gets from ``TrainPlan.scheduler`` are the old hand-written formula's at every step, from the
start and after a resume."""
from __future__ import annotations

import math

import pytest
import torch

from flowtrain.train.plan import MIN_LR_FRACTION, TrainConfig, plan_training


def _old_lr_at(plan, step: int) -> float:
    """``TrainPlan.lr_at`` as it was written by hand before the scheduler (loop.py, issue 29)."""
    if step < plan.warmup_steps:
        return plan.lr * (step + 1) / plan.warmup_steps
    progress = min(1.0, (step - plan.warmup_steps) / max(1, plan.horizon - plan.warmup_steps))
    return plan.lr * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress)))


def _optimizer() -> torch.optim.Optimizer:
    return torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=123.0)


@pytest.mark.parametrize("config", [TrainConfig(steps=300, lr=3e-3), TrainConfig(warmup_steps=1, steps=50),
                                    TrainConfig(steps=400, decay_steps=120, warmup_steps=7, lr=0.05)],
                         ids=["default-warmup", "one-warmup-step", "budget-past-the-decay"])
def test_torch_lambda_lr_gives_the_old_formulas_rate_at_every_step(config):
    plan = plan_training(config, 800, "binary")
    optimizer = _optimizer()
    scheduler = plan.scheduler(optimizer)
    assert isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler)
    for step in range(plan.steps):
        assert optimizer.param_groups[0]["lr"] == pytest.approx(_old_lr_at(plan, step), rel=1e-12, abs=0), step
        assert plan.lr_at(step) == pytest.approx(_old_lr_at(plan, step), rel=1e-12, abs=0)
        optimizer.step()
        scheduler.step()


def test_a_resumed_scheduler_continues_at_its_step():
    plan = plan_training(TrainConfig(steps=200, lr=1e-2), 800, "binary")
    optimizer = _optimizer()
    scheduler = plan.scheduler(optimizer, start=57)
    for step in range(57, 200):
        assert optimizer.param_groups[0]["lr"] == pytest.approx(_old_lr_at(plan, step), rel=1e-12, abs=0), step
        optimizer.step()
        scheduler.step()

"""The learning-rate schedule spans the budget the user gives (issue 29 item 5), as Lightning's and Hugging
Face's schedulers span max_steps; the table's budget stays the default; --decay-steps fixes it."""
from __future__ import annotations

import pytest

from flowtrain.train.plan import MIN_LR_FRACTION, TrainConfig, plan_training

ROWS = 800  # batch 32 (the power of two below 1/16 of the rows): 25 steps per epoch; the table's budget 800 steps


def test_steps_shorten_the_learning_rate_schedule():
    plan = plan_training(TrainConfig(steps=200), ROWS, "binary")
    assert plan.steps == 200 and plan.horizon == 200  # was 800: training stopped near the peak rate
    assert plan.lr_at(199) == pytest.approx(TrainConfig().lr * MIN_LR_FRACTION, rel=1e-2)  # decayed by the end
    assert plan.warmup_steps == 10  # 5% of the schedule
    assert "cosine decay over 200 steps," in plan.describe(ROWS)


def test_epochs_set_the_schedule_and_the_table_decides_when_neither_is_given():
    by_epochs = plan_training(TrainConfig(epochs=3), ROWS, "binary")
    assert by_epochs.steps == by_epochs.horizon == 3 * by_epochs.steps_per_epoch
    auto = plan_training(TrainConfig(), ROWS, "binary")
    assert auto.steps == auto.horizon == 800 and "decay_steps" in auto.chosen
    assert "cosine decay over 800 steps (chosen)" in auto.describe(ROWS)
    # validation points stay the table's: a shorter budget does not validate more often
    assert plan_training(TrainConfig(steps=200), ROWS, "binary").eval_every == auto.eval_every


def test_decay_steps_fixes_the_schedule_so_budgets_share_their_first_steps():
    short, long_ = (plan_training(TrainConfig(steps=n, decay_steps=500), ROWS, "binary") for n in (100, 300))
    assert short.horizon == long_.horizon == 500
    assert [short.lr_at(s) for s in range(100)] == [long_.lr_at(s) for s in range(100)]
    free = [plan_training(TrainConfig(steps=n), ROWS, "binary") for n in (100, 300)]
    assert free[0].lr_at(50) != free[1].lr_at(50)  # without it, each budget has its own schedule

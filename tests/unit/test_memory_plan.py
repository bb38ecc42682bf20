"""The memory plan per rank (#31 item 3): plain data, printable, exact for the data-parallel layouts."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from flowtrain.parallel import DistContext
from flowtrain.parallel.zero.sharder import ZeroSharder, check_stage
from flowtrain.train.memory_plan import MemoryPlan, fits_line, plan_memory, smallest_fit


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 33), nn.ReLU(), nn.Linear(33, 5))  # 264 + 170 = 434 parameters


def test_memory_plan_per_stage_is_plain_printable_data():
    model = _net()
    p = 434 * 4
    none = plan_memory(model, workers=3, batch_size=64)
    assert isinstance(none, MemoryPlan)
    assert (none.parameters, none.gradients) == (p, p)
    assert none.optimizer == 2 * p + 4 * 4  # two moments and a step per parameter tensor
    zero3 = plan_memory(model, workers=3, shard_states="parameters", batch_size=64)
    # 3 does not divide 264 nor 170: each unit is padded (264 -> 264, 170 -> 171), a rank holds 88 + 57
    assert zero3.parameters == (88 + 57) * 4 and zero3.gradients == (88 + 57) * 4
    assert zero3.state <= none.state / 3 * 1.1
    zero1 = plan_memory(model, workers=3, shard_states="optimizer", batch_size=64)
    zero2 = plan_memory(model, workers=3, shard_states="gradients", batch_size=64)
    assert zero3.state < zero2.state < zero1.state < none.state + none.parameters
    text = zero3.describe()
    assert "--workers 3 --shard-states parameters" in text and "optimizer state" in text
    assert zero3.as_dict()["total"] == zero3.total
    pp = plan_memory(model, workers=1, stages=2, batch_size=64)
    assert not pp.exact and pp.parameters == 217 * 4


def test_memory_plan_equals_what_one_rank_holds():
    """One process (N = 1, no process group): the sharder's storages are exactly the plan's bytes."""
    for stage in ("optimizer", "gradients", "parameters"):
        model = _net()
        planned = plan_memory(model, workers=1, shard_states=stage).state
        zero = ZeroSharder(model, DistContext(), stage=stage, make_optimizer=lambda ps: torch.optim.Adam(ps))
        x = torch.randn(8, 7)
        zero.zero_grad()
        zero.backward(model(x).pow(2).sum(), 8)
        zero.step()
        assert zero.state_bytes()["total"] == planned, stage
        zero.close()


def test_memory_plan_does_not_fit_names_the_smallest_layout():
    # ~525k parameters, ~8 MiB, in layers small enough that ZeRO-3's gathered layer (its gradients and buffers
    # too) fits half of it
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])
    whole = plan_memory(model, workers=1, batch_size=8)
    cap = whole.total // 2
    line = fits_line(whole, model, cap, batch_size=8)
    assert line is not None and "\n" not in line
    assert line.startswith("does not fit --worker-memory") and "needs" in line
    fit = smallest_fit(model, cap, batch_size=8)
    assert fit is not None and fit.total <= cap and fit.workers > 1
    assert f"`{fit.layout}`" in line
    assert fits_line(whole, model, whole.total) is None
    # a worker's fixed overhead counts; a cap below it is its own one line
    assert "needs" in fits_line(whole, model, whole.total, overhead=1 << 20)
    below = fits_line(whole, model, 1 << 20, overhead=2 << 20)
    assert below.startswith("--worker-memory 1.0 MiB is below a worker's fixed overhead (2.0 MiB")


def test_shard_states_bad_stage_is_one_line():
    with pytest.raises(ValueError, match="--shard-states 'zero4' is not a stage: use one of none, optimizer"):
        check_stage("zero4")

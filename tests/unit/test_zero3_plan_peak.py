"""The memory plan counts what ZeRO-2/3 hold during a step (issue 31): the layer gathered for its backward, its
whole gradients and reduce-scatter buffer, the previous layer's buffer in flight, so the plan's total matches
the measured peak, not only the state held between steps."""
from __future__ import annotations

import torch
from torch import nn

from flowtrain.parallel import DistContext, sum_loss
from flowtrain.parallel.zero.sharder import ZeroSharder
from flowtrain.train.memory_plan import FLOAT, plan_memory

WIDTHS = (7, 33, 65, 5)  # layers 7x33, 33x65, 65x5 (+ biases): 264, 2210, 330 elements


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 33), nn.ReLU(), nn.Linear(33, 65), nn.ReLU(), nn.Linear(65, 5))


def test_zero3_plan_counts_the_gathered_layer_and_the_buffers_in_flight():
    units = [7 * 33 + 33, 33 * 65 + 65, 65 * 5 + 5]
    plan = plan_memory(_model(), workers=2, shard_states="parameters", batch_size=64)
    padded = [-(-n // 2) * 2 for n in units]
    # the peak unit: its parameters gathered + its gradients + its buffer + the later unit's buffer in flight with
    # (gloo, #49 item 6) its all-to-all receive buffer
    want = max(padded[k] + units[k] + padded[k] + (2 * padded[k + 1] if k + 1 < len(units) else 0) for k in range(3))
    assert plan.transient == want * FLOAT
    nccl = plan_memory(_model(), workers=2, shard_states="parameters", batch_size=64, backend="nccl")
    assert nccl.transient == max(padded[k] + units[k] + padded[k] + (padded[k + 1] if k + 1 < len(units) else 0)
                                 for k in range(3)) * FLOAT  # reduce_scatter_single: no receive buffer
    assert plan.total == plan.state + plan.transient + plan.activations
    assert "during a step" in plan.describe()
    two = plan_memory(_model(), workers=2, shard_states="gradients", batch_size=64)
    bucket = sum(units)  # ZeRO-2 reduces in buckets (1 MB: the three layers in one), no layer gathered
    assert two.transient == (bucket + -(-bucket // 2) * 2) * FLOAT
    one = plan_memory(_model(), workers=2, shard_states="optimizer", batch_size=64)
    # ZeRO-1's gradients are its buckets' buffers, already in its state; the bucket's all-to-all receive buffer is not
    assert one.transient == -(-bucket // 2) * 2 * FLOAT
    assert plan_memory(_model(), workers=2, shard_states="optimizer", batch_size=64, backend="nccl").transient == 0


def test_zero3_plan_total_matches_the_measured_peak():
    """One rank (no collectives in flight): the measured peak of state during a step equals the plan's
    state + transient exactly; before this, the plan said only the state held between steps."""
    model = _model()
    plan = plan_memory(model, workers=1, shard_states="parameters", batch_size=64)
    zero = ZeroSharder(model, DistContext(), stage="parameters", make_optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-3))
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):  # Adam's state exists from the first step on: the later steps hold it at their peak
        x, y = torch.randn(64, 7, generator=gen), torch.randn(64, 5, generator=gen)
        zero.zero_grad()
        zero.backward(sum_loss(nn.MSELoss(), model(x), y), 64)
        zero.step()
    between = zero.state_bytes()["total"]
    zero.close()
    assert between == plan.state  # held between steps: the shards (exact before too)
    assert zero.peak_state_bytes == plan.state + plan.transient  # during a step: the plan counts it
    assert plan.transient > 0

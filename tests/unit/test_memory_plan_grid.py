"""The memory plan of ZeRO on the grid's data dimension (#31: `--shard-states` with `--stages` / `--tensor-parallel`):
each (stage, shard)'s even share of the parameters, sharded over its replicas."""
from __future__ import annotations

import pytest
from torch import nn

from flowtrain.train.memory_plan import plan_memory


def _net() -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])  # 8 x 4160 = 33,280 parameters


@pytest.mark.parametrize("grid", [{"stages": 2}, {"tensor_parallel": 2}, {"stages": 2, "tensor_parallel": 2}])
def test_zero_on_the_grid_shards_each_stage_and_shard_over_its_replicas(grid):
    model, split = _net(), grid.get("stages", 1) * grid.get("tensor_parallel", 1)
    share = 33_280 // split  # one rank's even share of the parameters without replicas sharding it
    plain = plan_memory(model, workers=2, batch_size=32, **grid)
    assert plain.parameters == share * 4 and plain.optimizer >= 2 * share * 4
    plans = {stage: plan_memory(model, workers=2, shard_states=stage, batch_size=32, **grid)
             for stage in ("optimizer", "gradients", "parameters")}
    zero3 = plans["parameters"]
    # ZeRO-3: parameters, gradients and Adam's moments each half of the (stage, shard)'s share (4160 / split is even)
    assert zero3.parameters == zero3.gradients == share // 2 * 4
    assert share * 4 <= zero3.optimizer <= share * 4 + 16 * 4  # and a step per piece (<= 2 a layer)
    assert zero3.state < plans["gradients"].state < plans["optimizer"].state < plain.state
    assert zero3.transient > 0  # a gathered layer, its gradients, buffers
    # ZeRO-1's gradients are its buckets' buffers (in its state); on gloo its all-to-all reduce-scatter's receive
    # buffers are a step's transient (#49 item 6), on NCCL (reduce_scatter_single) there is none
    assert plans["optimizer"].transient > 0
    assert plan_memory(model, workers=2, shard_states="optimizer", batch_size=32, backend="nccl", **grid).transient == 0
    assert not zero3.exact and (zero3.stages, zero3.tensor_parallel) == (grid.get("stages", 1),
                                                                          grid.get("tensor_parallel", 1))
    text = zero3.describe()
    assert "--workers 2 --shard-states parameters" in text and "(estimate: an even split" in text
    assert zero3.layout.endswith(" ".join(f"--{k.replace('_', '-')} {v}" for k, v in grid.items()))

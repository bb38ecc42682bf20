"""ZeRO-1/2 reduce per bucket, not per layer (#31 item 1: ZeRO-1 step time against plain DP).

Plain map/reduce DP issues one all-reduce per ``bucket_mb`` bucket; ZeRO-1/2 issued a reduce-scatter and an
all-gather per layer and copied every gradient into a buffer allocated each step. Now consecutive layers
share a bucket (one reduce-scatter, one all-gather) and ZeRO-1's gradients are views of the bucket's flat
buffer, which the reduce-scatter reads directly. ZeRO-3 still gathers per layer.
"""
from __future__ import annotations

import torch
from torch import nn

from flowtrain.parallel import DistContext
from flowtrain.parallel.zero.sharder import ZeroSharder
from flowtrain.parallel.zero.units import shard_units
from flowtrain.train.memory_plan import plan_memory


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def _step(zero, model, x):
    zero.zero_grad()
    zero.backward(model(x).pow(2).sum(), len(x))
    zero.step()


def test_zero_shard_units_bucket_layers_like_the_reducer():
    model = _net()
    assert [len(ps) for _, ps in shard_units(model, "optimizer", bucket_mb=25)] == [6]  # one bucket
    assert [len(ps) for _, ps in shard_units(model, "gradients", bucket_mb=25)] == [6]
    assert len(shard_units(model, "parameters", bucket_mb=25)) == 3  # ZeRO-3: gathered per layer
    # a bucket smaller than a layer: one layer each, filled from the last layer
    assert [len(ps) for _, ps in shard_units(model, "optimizer", bucket_mb=1e-6)] == [2, 2, 2]
    # 64*64+64 + 64*4+4 floats = 17.4 KB fit a 20 KB bucket; the first layer starts the next
    assert [len(ps) for _, ps in shard_units(model, "optimizer", bucket_mb=20_000 / 2**20)] == [2, 4]


def test_zero1_gradients_are_views_of_one_flat_buffer_kept_across_steps():
    model = _net()
    zero = ZeroSharder(model, DistContext(), stage="optimizer", make_optimizer=lambda ps: torch.optim.Adam(ps),
                       bucket_mb=25)
    assert len(zero.units) == 1
    unit = zero.units[0]
    x = torch.randn(8, 16)
    for _ in range(3):
        _step(zero, model, x)
        for p in model.parameters():
            assert p.grad.untyped_storage().data_ptr() == unit.flat_grad.untyped_storage().data_ptr()
        assert unit.grad_buffer is None  # no copy of the gradients per step
    assert zero.state_bytes()["total"] == plan_memory(model, workers=1, shard_states="optimizer", bucket_mb=25).state
    zero.close()


def test_zero_buckets_equal_the_plain_optimizer_for_every_bucket_size():
    x = torch.randn(8, 16)
    ref = _net()
    opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    for _ in range(4):
        opt.zero_grad()
        ref(x).pow(2).sum().div(8).backward()
        opt.step()
    for stage in ("optimizer", "gradients"):
        for bucket_mb in (1e-6, 20_000 / 2**20, 25):
            model = _net()
            zero = ZeroSharder(model, DistContext(), stage=stage, bucket_mb=bucket_mb,
                               make_optimizer=lambda ps: torch.optim.Adam(ps, lr=0.01))
            for _ in range(4):
                _step(zero, model, x)
            zero.close()
            diff = max(float((a - b).abs().max()) for a, b in zip(model.state_dict().values(),
                                                                  ref.state_dict().values()))
            assert diff <= 1e-6, (stage, bucket_mb)

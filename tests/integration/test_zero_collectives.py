"""ZeRO's collectives every way (``flowtrain.parallel.zero.units``: ``REDUCE_WAYS``, ``GATHER_WAYS``) on 3 gloo
ranks (uneven: the units' flat buffers are padded): each reduce-scatter leaves on every rank exactly its slice of
the sum over the ranks, with two in flight at once as the sharder launches them, and each all-gather the whole from
the shards. The equality tests (test_zero_sharding.py) train with the ways ``choose_collectives`` picks for N = 2
and 3; this covers every way whatever the choice."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from flowtrain.parallel import DistContext
from flowtrain.parallel.launch import spawn
from flowtrain.parallel.zero.units import (
    GATHER_WAYS,
    GLOO_COLLECTIVES,
    REDUCE_WAYS,
    ShardUnit,
    ZeroCollectives,
    choose_collectives,
)

ROOT = Path(__file__).resolve().parents[2]
SIZES = ((7, 5), (11,), (3, 3))  # 35 + 11 + 9 = 55 elements: 19 per rank on 3, the last shard 2 of padding


def _unit(rank: int, world: int, **ways) -> ShardUnit:
    return ShardUnit(0, [nn.Parameter(torch.zeros(s)) for s in SIZES], rank, world, torch.device("cpu"), **ways)


def _grads(rank: int) -> torch.Tensor:
    """Rank ``rank``'s gradients of the unit, flat (integers: every way's sum is exact)."""
    return torch.arange(55, dtype=torch.float32) * (rank + 1) + 100 * rank


def ways_job(ctx: DistContext, job: dict) -> None:
    rank, world = ctx.rank, ctx.world_size
    found = {"choice": asdict(choose_collectives(None))}
    for way in REDUCE_WAYS:
        units = [_unit(rank, world, reduce_way=way) for _ in range(2)]
        handles = []
        for k, u in enumerate(units):  # two in flight, then waited on: the sharder's overlap
            buf = torch.zeros(u.padded)
            buf[:u.numel] = _grads(rank) * (k + 1)
            handles.append(u.reduce_scatter(buf, None))
        for h in handles:
            h.wait()
        want = torch.cat([sum(_grads(r) for r in range(world)), torch.zeros(units[0].padded - 55)])
        found[f"reduce {way}"] = [torch.equal(u.grad_shard, want[u.lo:u.lo + u.shard_numel] * (k + 1))
                                  for k, u in enumerate(units)]
    for way in GATHER_WAYS:
        u = _unit(rank, world, gather_way=way)
        with torch.no_grad():
            u.shard.copy_(torch.arange(u.shard_numel, dtype=torch.float32) + 1000 * rank)
        u.free_params()
        u.gather_params(None)
        whole = torch.cat([torch.arange(u.shard_numel, dtype=torch.float32) + 1000 * r for r in range(world)])
        found[f"gather {way}"] = [torch.equal(u.full, whole), [list(p.shape) for p in u.params]]
    dist.barrier()
    Path(job["out"], f"rank-{rank}.json").write_text(json.dumps(found))


def test_every_way_reduce_scatters_and_gathers_uneven_shards(tmp_path):
    spawn(3, "tests.integration.test_zero_collectives:ways_job", {"out": str(tmp_path)}, failure_timeout_s=60,
          workdir=tmp_path / "w", extra_env={"PYTHONPATH": str(ROOT)}, threads_per_worker=1)
    for r in range(3):
        found = json.loads((tmp_path / f"rank-{r}.json").read_text())
        assert found.pop("choice") == asdict(GLOO_COLLECTIVES[3])
        assert found == {**{f"reduce {w}": [True, True] for w in REDUCE_WAYS},
                         **{f"gather {w}": [True, [list(s) for s in SIZES]] for w in GATHER_WAYS}}


def test_collectives_without_a_process_group_are_the_backends_own():
    assert not dist.is_initialized()
    assert choose_collectives(None) == ZeroCollectives()
    with pytest.raises(ValueError, match="'ring': use one of native, all_to_all"):
        ShardUnit(0, [nn.Parameter(torch.zeros(3))], 0, 1, torch.device("cpu"), reduce_way="ring")
    with pytest.raises(ValueError, match="'ring': use one of native, per_rank, all_to_all"):
        ShardUnit(0, [nn.Parameter(torch.zeros(3))], 0, 1, torch.device("cpu"), gather_way="ring")

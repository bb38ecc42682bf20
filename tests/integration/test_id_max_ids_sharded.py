"""Issue 32 item 2: `--max-ids` means the same on N workers as on one: the bound is on the whole sharded table, and
once it is reached the N ranks evict the IDs one process evicts (the globally least recently seen) and admit the
ones it admits, in the same order (real torch.distributed gloo workers through the launcher)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from flowtrain.parallel import DistContext, local_rows, make_reducer, sum_loss
from flowtrain.parallel.launch import spawn
from flowtrain.train.ids import IdEmbedding, IdTable, ShardedIdEmbedding, gather_full_table
from tests.ids_jobs import global_batches

ROOT = Path(__file__).resolve().parents[2]
ENV = {"PYTHONPATH": str(ROOT)}
pytestmark = pytest.mark.timeout(300)
STEPS = 40
DIM = 3
LR = 0.02
TABLE = {"min_count": 2, "max_ids": 12, "init_std": 0.05}  # far fewer rows than users: the bound evicts all along


class BoundNet(nn.Module):
    def __init__(self, ctx: DistContext):
        super().__init__()
        self.user = (ShardedIdEmbedding(DIM, ctx.rank, ctx.world_size, **TABLE) if ctx.world_size > 1
                     else IdEmbedding(DIM, **TABLE))
        self.body = nn.Linear(3 + DIM, 1)

    def forward(self, x, users):
        return self.body(torch.cat([x, self.user(users)], dim=1)).squeeze(1)


def _train(ctx: DistContext, world: int, one_reader: bool) -> BoundNet:
    """The global batches of ``world`` workers; ``one_reader``: rank 0 gets every row of each (the others own
    their keys' rows only), so the dense gradient is one process's exactly (a sum plus zeros)."""
    torch.manual_seed(0)
    model = BoundNet(ctx)
    reducer = make_reducer(model, ctx)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    loss_fn = nn.BCEWithLogitsLoss()
    for x, users, _items, y, sizes in global_batches(STEPS, world, seed=3):
        if one_reader:
            sizes = [len(y)] + [0] * (world - 1)
        lo, hi = local_rows(len(y), ctx, sizes if ctx.distributed else None)
        out = model(x[lo:hi], users[lo:hi])  # a collective when sharded
        loss_sum = sum_loss(loss_fn, out, y[lo:hi]) if hi > lo else None
        opt.zero_grad(set_to_none=True)
        global_n, _ = reducer.backward(loss_sum, hi - lo)
        opt.step()
        model.user.step(global_n, LR)
    reducer.close()
    return model


def bound_job(ctx: DistContext, job: dict) -> None:
    torch.set_num_threads(1)
    model = _train(ctx, ctx.world_size, job["one_reader"])
    whole = gather_full_table(model.user)
    if ctx.is_main:
        torch.save({"dense": {k: v for k, v in model.body.state_dict().items()}, "table": whole.state_dict(),
                    "shard_rows": len(model.user.table), "stats": model.user.table.stats.as_dict()}, job["out"])


def _run(tmp_path: Path, world: int, one_reader: bool) -> tuple[dict, BoundNet]:
    out = tmp_path / f"bound-{world}.pt"
    spawn(world, "tests.integration.test_id_max_ids_sharded:bound_job", {"out": str(out), "one_reader": one_reader}, failure_timeout_s=60,
          workdir=tmp_path / f"w{world}", extra_env=ENV, threads_per_worker=1)
    return torch.load(out, weights_only=True), _train(DistContext(), world, one_reader)


def _same_ids(sharded: IdTable, one: IdTable) -> None:
    assert set(sharded.key_to_row) == set(one.key_to_row) and len(one) == TABLE["max_ids"]
    for k in one.key_to_row:  # the same last sight of every ID held (the LRU order)
        assert int(sharded.last_seen[sharded.key_to_row[k]]) == int(one.last_seen[one.key_to_row[k]])
    assert sorted(sharded.pending) == sorted(one.pending)
    assert sharded.clock == one.clock


def test_id_max_ids_bounds_the_whole_sharded_table_as_one_process(tmp_path):
    """Three workers, rows spread unevenly over them: the same IDs evicted, admitted and waiting as one process."""
    got, ref = _run(tmp_path, 3, one_reader=False)
    one = ref.user.table
    assert one.stats.evicted_lru > 20  # the bound was reached again and again
    _same_ids(IdTable.from_state(got["table"]), one)
    assert got["shard_rows"] < TABLE["max_ids"]  # rank 0 held its share, not a bound of its own
    # what each rank counted, summed, is one process's count
    for counter in ("admitted", "evicted_lru", "waiting", "fallback_lookups"):
        assert got["table"]["stats"][counter] == getattr(one.stats, counter), counter


def test_id_max_ids_sharded_rows_equal_one_process(tmp_path):
    """Two workers, every row read by rank 0 (rank 1 owns the rows of its keys): rows and dense weights equal one
    process's (the dense gradient is the same sum: equal by construction), through the bound's evictions."""
    got, ref = _run(tmp_path, 2, one_reader=True)
    one = ref.user.table
    sharded = IdTable.from_state(got["table"])
    _same_ids(sharded, one)
    for k, r in one.key_to_row.items():
        assert float((sharded.weight[sharded.key_to_row[k]] - one.weight[r]).abs().max()) <= 1e-5
        assert int(sharded.row_step[sharded.key_to_row[k]]) == int(one.row_step[r])
    for k, v in ref.body.state_dict().items():
        assert float((got["dense"][k] - v).abs().max()) <= 1e-5, k
    assert np.isfinite(sharded.weight.numpy()).all()

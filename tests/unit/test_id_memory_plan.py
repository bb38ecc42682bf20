"""Issue 32 item 5 / issue 31 item 4: the memory plan counts ID tables (rows x dim x (row + Adam moments),
steps, bookkeeping and the key index), per rank when sharded, and equals a measured table."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from flowtrain.train.ids import IdEmbedding, IdTable, owner_of
from flowtrain.train.memory_plan import grown_capacity, id_table_bytes, id_tables_held, plan_memory
from flowtrain.train.models.ids import IdWideDeep


def _keys(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).choice(2**62, size=n, replace=False).astype(np.int64)


def test_memory_plan_counts_id_tables_equal_to_a_measured_table():
    for rows, dim, seed in ((3_000, 16, 0), (7_777, 8, 1)):
        model = nn.Module()
        model.user = IdEmbedding(dim, max_ids=rows, seed=seed)
        model.user.table.observe(_keys(rows, seed))  # the table full: as many rows as --max-ids
        assert len(model.user.table) == rows
        held = id_tables_held(model)
        plan = plan_memory(model, workers=1, batch_size=256)
        assert plan.id_tables == held == model.user.table.state_bytes()
        assert plan.id_rows == rows and plan.id_bound == "--max-ids"
        assert held > (2 * dim + 1) * rows * 4  # the row, exp_avg and a row-wise exp_avg_sq, and more
        dense = plan_memory(nn.Linear(3, 1), workers=1, batch_size=256)
        assert plan.state == plan.parameters + plan.gradients + plan.optimizer + plan.buffers + held
        assert dense.id_tables == 0 and "ID tables" not in dense.describe()
        assert "ID tables" in plan.describe() and f"{rows:,} rows" in plan.describe()


def test_memory_plan_shards_id_tables_over_workers_as_a_rank_holds_them():
    """Row-wise sharding: a rank holds the keys that hash to it (about an even split), in a table that grew from
    its start straight to its share of --max-ids (max_ids / workers and a margin); the plan equals what each rank's
    table holds."""
    rows, workers, dim = 40_000, 4, 16
    keys = _keys(rows, 3)
    model = IdWideDeep(2, [3], ["user"], id_dim=dim, hidden=(8,), table={"max_ids": rows})
    plan = plan_memory(model, workers=workers, batch_size=512)
    assert plan.id_rows == rows // workers
    for rank in range(workers):
        mine = keys[owner_of(keys, workers) == rank]
        shard = IdTable(dim, max_ids=rows, shards=workers)  # a shard keeps the whole table's bound (ShardedIdEmbedding)
        for i in range(0, len(mine), 500):  # training batches
            shard.observe(mine[i: i + 500])
        assert shard.capacity == grown_capacity(rows // workers, 1024, rows, workers) == 10_000 + 6 * 100 + 64
        assert plan.id_tables == shard.state_bytes()
    sized = IdTable(dim, capacity=rows // workers)  # sized to its rows (a table reloaded from a checkpoint)
    sized.observe(keys[: rows // workers])
    assert sized.state_bytes() == id_table_bytes(rows // workers, dim)
    whole = plan_memory(model, workers=1, batch_size=512)
    assert whole.id_tables == id_table_bytes(rows, dim) and whole.id_tables > 2 * plan.id_tables
    # without --max-ids the plan takes the rows it is given (the training rows: an upper bound)
    free = IdWideDeep(2, [3], ["user", "item"], id_dim=dim, hidden=(8,))
    given = plan_memory(free, workers=2, batch_size=512, id_rows=10_000)
    assert given.id_rows == 2 * 5_000 and "training rows" in given.id_bound
    assert given.id_tables == 2 * id_table_bytes(8_192, dim)  # grown by doubling from 1,024
    assert torch.is_tensor(free.ids["0"].fallback)

"""Issue 32 item 5: an ID row's second moment stored once per row, old per-element states still load, and a
table grown from empty grows by a quarter past a million rows (flowtrain.train.ids.table)."""
from __future__ import annotations

import io

import numpy as np
import torch

from flowtrain.train.ids import IdTable, owner_of
from flowtrain.train.ids.table import GROW_FINE_FROM, next_capacity, share_capacity, table_from_tensors, table_tensors
from flowtrain.train.memory_plan import grown_capacity, id_table_bytes


def _trained(dim: int, n: int, seed: int) -> IdTable:
    t = IdTable(dim, capacity=8, seed=seed)
    keys = np.arange(1, n + 1, dtype=np.int64) * 7919
    rows = t.observe(keys)
    g = torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))
    for step in range(3):
        t.apply_gradients(rows[: n - step], g[: n - step] * (step + 1), lr=0.01)
    return t


def test_id_second_moment_is_stored_once_per_row():
    for dim, n, seed in ((16, 40, 0), (5, 300, 1)):
        t = _trained(dim, n, seed)
        assert t.capacity >= n and t.exp_avg_sq.shape == (t.capacity, 1)  # grown from 8: still one per row
        s = t.state_dict()
        assert s["exp_avg_sq"].shape == (n, 1)
        assert table_tensors(t)["exp_avg_sq"].shape == (n, 1)
        # the same numbers as before: the mean of g**2 per row, Adam's recursion over the steps a row got
        g = torch.randn(n, dim, generator=torch.Generator().manual_seed(seed)).double()
        rows = t.key_to_row.lookup(np.arange(1, n + 1, dtype=np.int64) * 7919)
        v = torch.zeros(n, dtype=torch.float64)
        for step in range(3):
            got = torch.arange(n) < n - step
            v = torch.where(got, 0.999 * v + 0.001 * ((g * (step + 1)) ** 2).mean(dim=1), v)
        assert torch.allclose(t.exp_avg_sq[torch.as_tensor(rows), 0].double(), v, rtol=1e-5)
        # the bytes of a row: the row and exp_avg at dim floats each, the second moment one float
        one = IdTable(dim, capacity=1)
        assert one.exp_avg_sq.numel() == 1
        # Adam adds exp_avg (dim floats) and exp_avg_sq (one float) per row
        assert id_table_bytes(1000, dim) - id_table_bytes(1000, dim, optimizer="sgd") == 1000 * (dim + 1) * 4


def test_id_old_state_with_per_element_second_moment_loads_as_its_row_mean():
    for dim, n, seed in ((16, 50, 2), (3, 17, 3)):
        t = _trained(dim, n, seed)
        new = t.state_dict()
        old = dict(new)
        # an older checkpoint: exp_avg_sq [n, dim], dim equal copies of the row's value
        old["exp_avg_sq"] = new["exp_avg_sq"].expand(-1, dim).clone()
        back = IdTable.from_state(old)
        assert back.exp_avg_sq.shape == (back.capacity, 1)
        assert torch.equal(back.exp_avg_sq, t.exp_avg_sq)  # exactly the value: the mean is taken in float64
        # a bundle / state_dict's flat tensors of the old layout (table_from_tensors), through torch.save
        flat = table_tensors(t)
        flat["exp_avg_sq"] = flat["exp_avg_sq"].expand(-1, dim).clone()
        buf = io.BytesIO()
        torch.save(flat, buf)
        buf.seek(0)
        loaded = table_from_tensors(torch.load(buf, weights_only=True))
        assert torch.equal(loaded.exp_avg_sq, t.exp_avg_sq) and torch.equal(loaded.weight, t.weight)
        # the older per-element Adam (components differ): the row mean
        spread = new["exp_avg_sq"].expand(-1, dim) * torch.linspace(0.5, 1.5, dim)[None, :]
        old["exp_avg_sq"] = spread.clone()
        mean = IdTable.from_state(old)
        occ = torch.as_tensor(new["rows"])
        assert torch.allclose(mean.exp_avg_sq[occ, 0], spread.double().mean(dim=1).float(), rtol=1e-6)
        # and both keep training the same: the loaded table steps like the one that saved
        rows = t.key_to_row.lookup(new["keys"].numpy())
        g = torch.randn(n, dim, generator=torch.Generator().manual_seed(seed + 10))
        t.apply_gradients(rows, g, lr=0.01)
        back.apply_gradients(rows, g, lr=0.01)
        assert torch.equal(back.weight, t.weight) and torch.equal(back.exp_avg_sq, t.exp_avg_sq)


def test_id_table_grows_by_a_quarter_past_a_million_rows():
    assert next_capacity(1024) == 2048 and next_capacity(GROW_FINE_FROM // 2 + 1) == GROW_FINE_FROM
    assert next_capacity(GROW_FINE_FROM) == GROW_FINE_FROM * 5 // 4
    # the plan's capacity follows the table's steps: within a quarter of the rows past a million
    for rows in (1_200_000, 2_498_863, 10_000_000):
        cap = grown_capacity(rows, 1024)
        assert rows <= cap <= 1.25 * rows, (rows, cap)
    # a real table grown from empty (dim 1: a small one), past 1,048,576 rows
    n = 1_400_000
    t = IdTable(1, capacity=1024, optimizer="sgd")
    for lo in range(0, n, 1 << 17):
        t.observe(np.arange(lo + 1, min(n, lo + (1 << 17)) + 1, dtype=np.int64))
    assert len(t) == n
    assert t.capacity == grown_capacity(n, 1024) <= 1.25 * n  # doubling would reach 2,097,152
    assert t.capacity == 1_638_400 and t.weight.shape == (t.capacity, 1)


def test_id_shard_grows_straight_to_its_share_of_max_ids():
    """Under --max-ids a shard's table grows once, from its start to max_ids / shards and a margin for the hash's
    imbalance (what the plan counts), instead of doubling past its rows; every rank's keys fit that share."""
    max_ids, workers = 200_000, 4
    share = share_capacity(max_ids, workers)
    assert max_ids // workers < share < 1.05 * max_ids // workers and share_capacity(max_ids, 1) == max_ids
    keys = np.arange(1, max_ids + 1, dtype=np.int64) * 1_000_003
    for rank in range(workers):
        mine = keys[owner_of(keys, workers) == rank]
        shard = IdTable(2, max_ids=max_ids, shards=workers, optimizer="sgd")
        caps = set()
        for i in range(0, len(mine), 4096):
            shard.observe(mine[i: i + 4096])
            caps.add(shard.capacity)
        assert len(shard) == len(mine) and caps == {share}, (rank, sorted(caps))  # doubling: 65,536
        assert shard.capacity == grown_capacity(len(mine), 1024, max_ids, workers)
    # one process under --max-ids (#49 item 4): its first growth does not allocate the whole bound (a table that
    # may never see --max-ids IDs); it grows as an unbounded table does, and never past the bound
    one = IdTable(2, max_ids=5_000, optimizer="sgd")
    one.observe(np.arange(1, 1_500, dtype=np.int64))
    assert one.capacity == 2_048 == grown_capacity(1_499, 1024, 5_000, 1)
    one.observe(np.arange(1_500, 6_000, dtype=np.int64))
    assert one.capacity == 5_000 and len(one) == 5_000

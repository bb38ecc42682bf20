"""Worker functions of the ID-table tests (issue 32), run through the real entry point.

A small model over two ID columns (user, item) and three numerics, trained on global batches with
uneven per-rank sizes (some zero), new users arriving every step, ``min_count`` 2 and a TTL that
expires rows: one process (``IdEmbedding``) or N (``ShardedIdEmbedding``, rows by all-to-all).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from flowtrain.parallel import DistContext, local_rows, make_reducer, sum_loss
from flowtrain.train.ids import IdEmbedding, ShardedIdEmbedding, gather_full_table, key_of

DIM = 4
LR = 0.02
TABLE = {"min_count": 2, "ttl": 150, "init_std": 0.05}


class IdNet(nn.Module):
    def __init__(self, ctx: DistContext):
        super().__init__()
        if ctx.world_size > 1:
            self.user = ShardedIdEmbedding(DIM, ctx.rank, ctx.world_size, **TABLE)
            self.item = ShardedIdEmbedding(DIM, ctx.rank, ctx.world_size, **TABLE)
        else:
            self.user, self.item = IdEmbedding(DIM, **TABLE), IdEmbedding(DIM, **TABLE)
        self.body = nn.Sequential(nn.Linear(3 + 2 * DIM, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x, users, items):
        return self.body(torch.cat([x, self.user(users), self.item(items)], dim=1)).squeeze(1)

    def id_step(self, global_n: int, lr: float) -> None:
        self.user.step(global_n, lr)
        self.item.step(global_n, lr)


def global_batches(steps: int, world: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for step in range(steps):
        sizes = rng.integers(0, 12, size=world).tolist()
        if step % 4 == 1:
            sizes[step % world] = 0
        if sum(sizes) == 0:
            sizes[0] = 5
        n = sum(sizes)
        users = np.minimum(rng.zipf(1.4, size=n), 20 + 3 * step)  # new users keep arriving
        items = np.minimum(rng.zipf(1.6, size=n), 30)
        x = torch.as_tensor(rng.normal(size=(n, 3)), dtype=torch.float32)
        y = torch.as_tensor((rng.random(n) < 1 / (1 + np.exp(-(x[:, 0].numpy() + (users % 3 - 1))))),
                            dtype=torch.float32)
        out.append((x, torch.as_tensor([key_of(f"u{u}") for u in users]),
                    torch.as_tensor([key_of(f"i{i}") for i in items]), y, sizes))
    return out


def train(ctx: DistContext, steps: int, data_world: int | None = None) -> IdNet:
    """``data_world``: the global batches of that many workers (one process trains on all their rows)."""
    torch.manual_seed(0)
    model = IdNet(ctx)
    reducer = make_reducer(model, ctx)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    loss_fn = nn.BCEWithLogitsLoss()
    for x, users, items, y, sizes in global_batches(steps, data_world or ctx.world_size):
        lo, hi = local_rows(len(y), ctx, sizes if ctx.distributed else None)
        out = model(x[lo:hi], users[lo:hi], items[lo:hi])  # a collective when sharded: every rank calls it
        loss_sum = sum_loss(loss_fn, out, y[lo:hi]) if hi > lo else None
        opt.zero_grad(set_to_none=True)
        global_n, _ = reducer.backward(loss_sum, hi - lo)
        opt.step()
        model.id_step(global_n, LR)
    reducer.close()
    return model


def table_rows(table) -> dict[int, torch.Tensor]:
    return {int(k): table.weight[r].clone() for k, r in table.key_to_row.items()}


def equivalence_job(ctx: DistContext, job: dict) -> None:
    torch.set_num_threads(1)
    model = train(ctx, job["steps"])
    dense = {k: v for k, v in model.state_dict().items() if ".table." not in k and not k.startswith("table.")}
    tables = {name: gather_full_table(getattr(model, name)) for name in ("user", "item")}
    if ctx.is_main:
        torch.save({"dense": dense,
                    "tables": {name: t.state_dict() for name, t in tables.items()},
                    "shard_sizes": [len(model.user.table)]}, job["out"])

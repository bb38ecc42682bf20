"""Worker functions the data-parallel tests run through the real entry point (flowtrain.parallel.worker).

They train a small model on synthetic global batches with explicit, uneven per-rank shard
sizes (some zero) and save rank 0's final parameters.
"""
from __future__ import annotations

import torch
from torch import nn

from flowtrain.parallel import DistContext, local_rows, make_reducer, sum_loss


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh())
        self.head = nn.Linear(8, 1)
        self.unused = nn.Linear(3, 3)  # never receives a gradient

    def forward(self, x):
        return self.head(self.body(x)).squeeze(1)


def global_batches(steps: int, world: int, seed: int = 0):
    """(x, y, per-rank sizes) per step; sizes are uneven and some ranks get 0 rows."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for step in range(steps):
        sizes = torch.randint(0, 9, (world,), generator=gen).tolist()
        if step % 4 == 1:
            sizes[step % world] = 0  # a replica with no examples
        if sum(sizes) == 0:
            sizes[0] = 3
        n = sum(sizes)
        x = torch.randn(n, 6, generator=gen)
        y = (x[:, 0] - 2 * x[:, 1] + 0.1 * torch.randn(n, generator=gen))
        out.append((x, y, sizes))
    return out


def make_optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def train(ctx: DistContext, *, steps: int, optimizer: str, seed: int = 0, bucket_mb: float = 0.0005,
          fail: tuple[int, int] | None = None) -> Net:
    torch.manual_seed(seed)
    model = Net()
    reducer = make_reducer(model, ctx, bucket_mb=bucket_mb)  # tiny buckets: several per step
    opt = make_optimizer(optimizer, model.parameters())
    loss_fn = nn.MSELoss()
    for step, (x, y, sizes) in enumerate(global_batches(steps, ctx.world_size, seed)):
        if fail is not None and (ctx.rank, step) == tuple(fail):
            raise RuntimeError(f"injected failure at step {step}")
        lo, hi = local_rows(len(y), ctx, sizes if ctx.distributed else None)
        loss_sum = sum_loss(loss_fn, model(x[lo:hi]), y[lo:hi]) if hi > lo else None
        opt.zero_grad(set_to_none=True)
        reducer.backward(loss_sum, hi - lo)
        opt.step()
        reducer.sync_buffers(hi - lo)
    return model


def equivalence_job(ctx: DistContext, job: dict) -> None:
    model = train(ctx, steps=job["steps"], optimizer=job["optimizer"], fail=job.get("fail"))
    if ctx.is_main:
        torch.save(model.state_dict(), job["out"])


def reference(steps: int, world: int, optimizer: str, seed: int = 0) -> Net:
    """One process, the same global batches, the ordinary mean loss over each whole batch."""
    torch.manual_seed(seed)
    model = Net()
    opt = make_optimizer(optimizer, model.parameters())
    for x, y, _ in global_batches(steps, world, seed):
        opt.zero_grad(set_to_none=True)
        nn.MSELoss()(model(x), y).backward()
        opt.step()
    return model

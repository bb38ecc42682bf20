"""The memory-wall demonstration's model and worker functions (tests/integration/test_memory_wall.py).

A wide & deep model: four big ID embedding tables (the deep part's input, with the numeric columns), two
wide hidden layers, and a wide (linear) part over the IDs. Each top-level child is a ZeRO-3 unit, so no
unit is more than ~1/5 of the model: a rank's peak is its shard of everything plus one gathered unit.
"""
from __future__ import annotations

import torch
from torch import nn

TABLES, NUMERIC = 4, 16


class WideDeep(nn.Module):
    def __init__(self, vocab: int, dim: int, hidden: int):
        super().__init__()
        self.wide = nn.Embedding(vocab * TABLES, 1)
        for t in range(TABLES):
            setattr(self, f"emb{t}", nn.Embedding(vocab, dim))
        self.fc1 = nn.Linear(TABLES * dim + NUMERIC, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, 1)
        self.vocab = vocab

    def forward(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        deep = torch.cat([getattr(self, f"emb{t}")(ids[:, t]) for t in range(TABLES)] + [x], dim=1)
        deep = self.out(torch.relu(self.fc2(torch.relu(self.fc1(deep)))))
        offsets = torch.arange(TABLES) * self.vocab
        return deep.squeeze(1) + self.wide(ids + offsets).sum(dim=1).squeeze(1)


def build(shape: dict) -> WideDeep:
    torch.manual_seed(0)
    return WideDeep(shape["vocab"], shape["dim"], shape["hidden"])


def batches(shape: dict) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(shape["steps"]):
        n = shape["batch"]
        ids = torch.randint(0, shape["vocab"], (n, TABLES), generator=gen)
        x = torch.randn(n, NUMERIC, generator=gen)
        y = x[:, 0] - 2 * x[:, 1] + 0.1 * torch.randn(n, generator=gen)
        out.append((ids, x, y))
    return out


LR = 1e-4
# Adam's eps: a sum over the batch rounds differently when ranks add it up in another order (~1e-7 of its terms);
# Adam's g / (|g| + eps) turns the rounding of a nearly cancelled sum into up to 2 * lr with eps 1e-8 (a wide
# layer has many such elements). eps 1e-3 and lr 1e-4 bound that at about lr * rounding / eps, well under 1e-5.
EPS = 1e-3


def reference(shape: dict) -> dict:
    """The uncapped one-process run: plain Adam on the whole global batches."""
    model = build(shape)
    opt = torch.optim.Adam(model.parameters(), lr=LR, eps=EPS)
    for ids, x, y in batches(shape):
        opt.zero_grad(set_to_none=True)
        nn.MSELoss()(model(ids, x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_job(ctx, job: dict) -> None:
    """ZeRO (``job["stage"]``) on this group's ranks, or plain Adam on one; each rank saves its own shards
    (``<out>.rank-<r>.pt``: per unit, the flat shard and its bounds), so no rank ever holds the whole model."""
    from flowtrain.parallel import local_rows, sum_loss
    from flowtrain.parallel.launch import heartbeat
    from flowtrain.parallel.zero.sharder import ZeroSharder

    shape = job["shape"]
    model = build(shape)
    if job["stage"] == "none":  # one worker, plain Adam: what a single worker would run
        opt = torch.optim.Adam(model.parameters(), lr=LR, eps=EPS)
        for ids, x, y in batches(shape):
            opt.zero_grad(set_to_none=True)
            nn.MSELoss()(model(ids, x), y).backward()
            opt.step()
            heartbeat()
        torch.save(model.state_dict(), f"{job['out']}.rank-{ctx.rank}.pt")
        return
    zero = ZeroSharder(model, ctx, stage=job["stage"], make_optimizer=lambda ps: torch.optim.Adam(ps, lr=LR, eps=EPS))
    for ids, x, y in batches(shape):
        lo, hi = local_rows(len(y), ctx)
        zero.zero_grad()
        loss_sum = sum_loss(nn.MSELoss(), model(ids[lo:hi], x[lo:hi]), y[lo:hi])
        zero.backward(loss_sum, hi - lo)
        zero.step()
        heartbeat()
    names = {id(p): n for n, p in model.named_parameters()}
    units = [{"names": [names[id(p)] for p in u.params], "sizes": u.sizes, "lo": u.lo, "shard": u.shard.clone()}
             for u in zero.units]
    torch.save({"units": units, "peak_state": zero.peak_state_bytes}, f"{job['out']}.rank-{ctx.rank}.pt")


def assemble(out: str, world: int, shapes: dict[str, torch.Size]) -> dict:
    """The whole parameters from every rank's shards."""
    parts = [torch.load(f"{out}.rank-{r}.pt", weights_only=True)["units"] for r in range(world)]
    state = {}
    for k, unit in enumerate(parts[0]):
        flat = torch.cat([parts[r][k]["shard"] for r in range(world)])
        off = 0
        for name, n in zip(unit["names"], unit["sizes"]):
            state[name] = flat[off:off + n].view(shapes[name])
            off += n
    return state

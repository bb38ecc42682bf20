"""Worker functions for the pipeline-parallel tests, run through flowtrain.parallel.worker."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from flowtrain.parallel import DistContext
from flowtrain.parallel.grid import Grid, build_groups
from flowtrain.parallel.pipeline import StageWorker, grid_position, replica_rows
from flowtrain.parallel.schedules import SCHEDULES
from flowtrain.parallel.stages import plan_stages, stage_module

GLOBAL_BATCH = 24


def build_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(),
                         nn.Linear(16, 1), nn.Flatten(0))


def batches(steps: int):
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(steps):
        x = torch.randn(GLOBAL_BATCH, 8, generator=gen)
        out.append((x, x[:, 0] * x[:, 1] - x[:, 2] + 0.05 * torch.randn(GLOBAL_BATCH, generator=gen)))
    return out


def optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def pp_job(ctx: DistContext, job: dict) -> None:
    """``p2p_groups``: activations and gradients on the grid's per-direction pipeline groups
    (else the default group, through the older ``grid_position``)."""
    stages, micro = job["stages"], job["microbatches"]
    model = build_model()
    groups = None
    if job.get("p2p_groups"):
        groups = build_groups(Grid.from_world(ctx.world_size, stages=stages), ctx.rank)
        pos, group, p2p = groups.pos, groups.data, (groups.forward, groups.backward)
    else:
        (pos, group), p2p = grid_position(ctx, stages), (None, None)
    plan = plan_stages(model, stages, torch.zeros(2, 8), measure=False)
    module = stage_module(model, plan, pos.stage)
    in_shape = plan.out_shapes[pos.stage - 1] if pos.stage else (8,)
    worker = StageWorker(module, pos, group, SCHEDULES[job["schedule"]](stages, micro), micro, in_shape,
                         nn.MSELoss(), p2p_groups=p2p)
    opt = optimizer(module.parameters())
    for step, (x, y) in enumerate(batches(job["steps"])):
        if job.get("fail") == [pos.stage, step]:
            worker.module = None  # the next forward on this stage raises
        lo, hi = replica_rows(len(y), pos)
        opt.zero_grad(set_to_none=True)
        worker.step(x[lo:hi] if pos.is_first else None, y[lo:hi] if pos.is_last else None, hi - lo)
        opt.step()
    if pos.replica == 0:
        torch.save(module.state_dict(), Path(job["out"]) / f"stage-{pos.stage}.pt")
    worker.close()
    if groups is not None:
        dist.barrier()
        groups.close()


def reference(steps: int) -> nn.Sequential:
    model = build_model()
    opt = optimizer(model.parameters())
    for x, y in batches(steps):
        opt.zero_grad(set_to_none=True)
        nn.MSELoss()(model(x), y).backward()
        opt.step()
    return model

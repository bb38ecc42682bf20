"""Worker functions of the ZeRO tests (``--shard-states``), run through the real entry point.

The same small model, global batches and uneven per-rank sizes (some zero) as ``tests.dp_jobs``,
trained with ``flowtrain.parallel.zero.sharder.ZeroSharder``; rank 0 saves the final parameters.
"""
from __future__ import annotations

import json

import torch
from torch import nn

from flowtrain.parallel import DistContext, local_rows, sum_loss
from flowtrain.parallel.zero.sharder import ZeroSharder
from tests.dp_jobs import Net, global_batches


def train(ctx: DistContext, *, steps: int, stage: str, optimizer: str = "adam", seed: int = 0, prefetch: bool = False):
    torch.manual_seed(seed)
    model = Net()
    make = (lambda ps: torch.optim.Adam(ps, lr=0.01)) if optimizer == "adam" else \
        (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9))
    zero = ZeroSharder(model, ctx, stage=stage, make_optimizer=make, prefetch=prefetch)
    loss_fn = nn.MSELoss()
    memory = []
    for x, y, sizes in global_batches(steps, ctx.world_size, seed):
        lo, hi = local_rows(len(y), ctx, sizes if ctx.distributed else None)
        zero.zero_grad()
        if hi > lo:
            loss_sum = sum_loss(loss_fn, model(x[lo:hi]), y[lo:hi])
        elif stage == "parameters":
            loss_sum = model(x[lo:hi]).sum() * 0.0
        else:
            loss_sum = None
        zero.backward(loss_sum, hi - lo)
        zero.step()
        memory.append({**zero.state_bytes(), "peak_state": zero.peak_state_bytes})
    state = zero.optimizer_state()
    zero.close()
    return model, memory, state


def equivalence_job(ctx: DistContext, job: dict) -> None:
    model, memory, state = train(ctx, steps=job["steps"], stage=job["stage"], optimizer=job.get("optimizer", "adam"),
                                 prefetch=job.get("prefetch", False))
    if ctx.is_main:
        torch.save({"model": model.state_dict(), "optimizer": state}, job["out"])
    with open(f"{job['out']}.memory-{ctx.rank}.json", "w") as fh:
        json.dump(memory[-1], fh)


def reshard_job(ctx: DistContext, job: dict) -> None:
    """Steps [start, stop) of the world-3 batches (rows split evenly over this job's ranks), from the
    checkpoint ``job["load"]`` when given (written by any N and stage); rank 0 saves model and optimizer."""
    torch.manual_seed(0)
    model = Net()
    zero = ZeroSharder(model, ctx, stage=job["stage"], make_optimizer=lambda ps: torch.optim.Adam(ps, lr=0.01))
    if job.get("load"):
        state = torch.load(job["load"], weights_only=True)
        zero.gather()
        model.load_state_dict(state["model"])
        zero.load_parameters()
        zero.load_optimizer_state(state["optimizer"])
    batches = global_batches(job["stop"], 3, 0)[job["start"]:]
    for x, y, _ in batches:
        lo, hi = local_rows(len(y), ctx)
        zero.zero_grad()
        out = model(x[lo:hi])
        loss_sum = sum_loss(nn.MSELoss(), out, y[lo:hi]) if hi > lo else out.sum() * 0.0
        zero.backward(loss_sum, hi - lo)
        zero.step()
    state = zero.optimizer_state()
    zero.gather()
    if ctx.is_main:
        torch.save({"model": {k: v.clone() for k, v in model.state_dict().items()}, "optimizer": state}, job["out"])
    zero.close()


def grid_job(ctx: DistContext, job: dict) -> None:
    """``tests.tp_jobs.grid_job`` with ZeRO-1/2/3 on each stage's (and shard's) replicas (``shard_stage_worker``);
    ``last_rows``: the last global batch partial (a replica with an empty micro-batch, or no rows at all)."""
    import torch.distributed as dist

    from flowtrain.parallel.grid import Grid, build_groups
    from flowtrain.parallel.pipeline import StageWorker, replica_rows
    from flowtrain.parallel.schedules import SCHEDULES
    from flowtrain.parallel.stages import merge_stage_states, plan_stages, stage_module
    from flowtrain.parallel.tensor.plan import TensorGroup, plan_tensor_parallel, shard_module
    from flowtrain.parallel.zero.sharder import shard_stage_worker
    from tests.tp_jobs import CARDS, N_NUMERIC, batches, build_model, optimizer

    stages, tensor = job.get("stages", 1), job.get("tensor", 1)
    dtype = getattr(torch, job.get("dtype", "float32"))  # float64: the check mode (#49 item 5)
    grid = Grid.from_world(ctx.world_size, stages=stages, tensor=tensor)
    groups = build_groups(grid, ctx.rank)
    pos = groups.pos
    model = build_model(dtype=dtype)
    plan = plan_stages(model, stages, batches(1, dtype=dtype)[0][0][:2], measure=False)
    tplans = [plan_tensor_parallel(stage_module(model, plan, s), tensor) for s in range(stages)]
    module = shard_module(stage_module(model, plan, pos.stage), tplans[pos.stage],
                          TensorGroup(groups.tensor, pos.tensor, tensor))
    micro = 3 if stages > 1 else 1
    in_shape = plan.out_shapes[pos.stage - 1] if pos.stage else (N_NUMERIC + len(CARDS),)
    worker = StageWorker(module, pos, groups.data, SCHEDULES["1f1b"](stages, micro), micro, in_shape, nn.MSELoss(),
                         p2p_groups=(groups.forward, groups.backward))
    zero = shard_stage_worker(worker, ctx, stage=job["stage"], make_optimizer=optimizer)
    for step, (x, y) in enumerate(batches(job["steps"], last_rows=job.get("last_rows"), dtype=dtype)):
        torch.manual_seed(1000 + step * 31 + pos.replica * stages + pos.stage)
        lo, hi = replica_rows(len(y), pos)
        zero.zero_grad()
        worker.step(x[lo:hi] if pos.is_first else None, y[lo:hi] if pos.is_last else None, hi - lo)
        zero.step()
    held = zero.state_bytes()
    zero.gather()  # ZeRO-3: each rank holds only its shards until then
    state = {k: v.cpu().clone() for k, v in module.state_dict().items()}
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, (state, held))
    if ctx.is_main:
        shards = [[everyone[grid.rank_of(0, s, t)][0] for t in range(tensor)] for s in range(stages)]
        torch.save(merge_stage_states([tplans[s].merge(shards[s]) for s in range(stages)]), job["out"])
        with open(job["out"] + ".memory.json", "w") as fh:
            json.dump([h for _, h in everyone], fh)
    worker.close()
    dist.barrier()
    groups.close()

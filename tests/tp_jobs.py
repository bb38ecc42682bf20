"""Worker functions for the tensor-parallel and 3-D grid tests, run through flowtrain.parallel.worker.

A small tabular model (embeddings of 3 tables, one with fewer rows than shards, and two
column/row pairs whose widths do not all divide by 3) trained with Adam on a D x S x T grid; rank
0 saves the merged (unsharded) state and each shard's own.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from flowtrain.parallel import DistContext
from flowtrain.parallel.grid import Grid, build_groups
from flowtrain.parallel.pipeline import StageWorker, replica_rows
from flowtrain.parallel.schedules import SCHEDULES
from flowtrain.parallel.stages import merge_stage_states, plan_stages, stage_module
from flowtrain.parallel.tensor.plan import TensorGroup, plan_tensor_parallel, shard_module
from flowtrain.train.models import TabularMLP, pack

N_NUMERIC, CARDS, HIDDEN = 4, [5, 2, 7], (32, 16, 12, 8)
GLOBAL_BATCH = 24


def build_model(dropout: float = 0.0, dtype: torch.dtype = torch.float32) -> TabularMLP:
    torch.manual_seed(0)
    return TabularMLP(N_NUMERIC, CARDS, hidden=HIDDEN, dropout=dropout).to(dtype)


def batches(steps: int, seed: int = 5, last_rows: int | None = None, dtype: torch.dtype = torch.float32):
    """``steps`` global batches of ``GLOBAL_BATCH`` rows; ``last_rows``: the last one partial, cut to that many;
    ``dtype``: of the packed inputs and the targets (float64: the check mode, ``--dtype float64``)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x_num = torch.randn(GLOBAL_BATCH, N_NUMERIC, generator=gen)
        x_cat = torch.stack([torch.randint(0, c, (GLOBAL_BATCH,), generator=gen) for c in CARDS], 1)
        noise = 0.05 * torch.randn(GLOBAL_BATCH, generator=gen)
        y = x_num[:, 0] - 0.5 * x_num[:, 1] + 0.3 * x_cat[:, 0].float() + noise
        out.append((pack(x_num, x_cat).to(dtype), y.to(dtype)))
    if last_rows is not None:
        out[-1] = (out[-1][0][:last_rows], out[-1][1][:last_rows])
    return out


def optimizer(params):
    return torch.optim.Adam(params, lr=0.01)


def grid_job(ctx: DistContext, job: dict) -> None:
    stages, tensor = job.get("stages", 1), job.get("tensor", 1)
    device = torch.device(ctx.device)
    grid = Grid.from_world(ctx.world_size, stages=stages, tensor=tensor)
    groups = build_groups(grid, ctx.rank)
    pos = groups.pos
    model = build_model(job.get("dropout", 0.0))
    plan = plan_stages(model, stages, batches(1)[0][0][:2], measure=False)
    tplans = [plan_tensor_parallel(stage_module(model, plan, s), tensor) for s in range(stages)]
    tg = TensorGroup(groups.tensor, pos.tensor, tensor)
    module = shard_module(stage_module(model, plan, pos.stage), tplans[pos.stage], tg).to(device)
    micro = job.get("microbatches", 3) if stages > 1 else 1
    in_shape = plan.out_shapes[pos.stage - 1] if pos.stage else (N_NUMERIC + len(CARDS),)
    worker = StageWorker(module, pos, groups.data, SCHEDULES[job.get("schedule", "1f1b")](stages, micro), micro,
                         in_shape, nn.MSELoss(), p2p_groups=(groups.forward, groups.backward), device=device)
    opt = optimizer(module.parameters())
    for step, (x, y) in enumerate(batches(job["steps"])):
        torch.manual_seed(1000 + step * 31 + pos.replica * stages + pos.stage)  # alike across shards
        lo, hi = replica_rows(len(y), pos)
        opt.zero_grad(set_to_none=True)
        worker.step(x[lo:hi].to(device) if pos.is_first else None, y[lo:hi].to(device) if pos.is_last else None,
                    hi - lo)
        opt.step()
    state = {k: v.cpu() for k, v in module.state_dict().items()}
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, state)
    if ctx.is_main:
        out = Path(job["out"])
        shards = [[everyone[grid.rank_of(0, s, t)] for t in range(tensor)] for s in range(stages)]
        merged = merge_stage_states([tplans[s].merge(shards[s]) for s in range(stages)])
        torch.save(merged, out / "merged.pt")
        torch.save({"shards": shards, "bytes": tg.bytes, "all_reduces": tg.all_reduces,
                    "plans": [tp.table() for tp in tplans]}, out / "shards.pt")
    worker.close()
    dist.barrier()
    groups.close()


def reference(steps: int, dropout: float = 0.0, last_rows: int | None = None,
              dtype: torch.dtype = torch.float32) -> TabularMLP:
    model = build_model(dropout, dtype)
    opt = optimizer(model.parameters())
    for x, y in batches(steps, last_rows=last_rows, dtype=dtype):
        opt.zero_grad(set_to_none=True)
        nn.MSELoss()(model(x), y).backward()
        opt.step()
    return model

"""Worker functions of the sharded-checkpoint tests (``--shard-states``, DCP), run through the real entry point.

``tests.dp_jobs``' small model on its global batches, with every row of a step on rank 0 (the other ranks
hold no rows and add exact zeros): each step's gradient then comes from the same rows in the same order
whatever the number of ranks, so a run on 1, 2 or 3 ranks computes the same numbers (equal by construction),
while the parameters and the Adam state are still sharded over the ranks.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from flowtrain.parallel import DistContext, sum_loss
from flowtrain.parallel.zero.sharder import ZeroSharder
from flowtrain.train import checkpoint
from tests.dp_jobs import Net, global_batches

LR = 0.01


def run_job(ctx: DistContext, job: dict) -> None:
    """Steps [start, stop) of the batches: ZeRO (``job["stage"]``) on several ranks, a plain Adam on one; from the
    sharded checkpoint in ``job["load"]`` when given; a sharded checkpoint into ``job["save"]`` at the end when
    given; rank 0 writes the final parameters and the whole Adam state to ``job["out"]``."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Net()
    zero = ZeroSharder(model, ctx, stage=job["stage"], make_optimizer=lambda ps: torch.optim.Adam(ps, lr=LR)) \
        if ctx.distributed else None
    plain = torch.optim.Adam(model.parameters(), lr=LR) if zero is None else None
    if job.get("load"):
        path, state = checkpoint.require_latest(job["load"])
        shards = path.with_suffix(checkpoint.SHARDS_SUFFIX)
        if zero is not None:  # this rank's pieces, whichever ranks wrote them
            tensors, chunks = zero.shard_targets(checkpoint.shard_names(shards))
            checkpoint.load_shards(shards, tensors, chunks)
            zero.take_shards(tensors)
            if job.get("loaded"):  # the state just read, whole, before any step
                loaded = zero.optimizer_state()
                if ctx.is_main:
                    torch.save({"model": {k: v.clone() for k, v in model.state_dict().items()}, "optimizer": loaded},
                               job["loaded"])
        else:  # one process: everything whole
            whole = checkpoint.read_whole(shards, model, param_groups=state["optimizer_groups"])
            model.load_state_dict(whole["model"])
            plain.load_state_dict(whole["optimizer"])
    loss_fn = nn.MSELoss()
    for x, y, _ in global_batches(job["stop"], 3, job.get("seed", 0))[job["start"]:]:
        rows = len(y) if ctx.rank == 0 else 0
        if zero is not None:
            zero.zero_grad()
            out = model(x[:rows])
            loss_sum = sum_loss(loss_fn, out, y[:rows]) if rows else out.sum() * 0.0
            zero.backward(loss_sum, rows)
            zero.step()
        else:
            plain.zero_grad(set_to_none=True)
            sum_loss(loss_fn, model(x), y).backward()
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(1.0 / len(y))  # as the sharder divides the reduced sum by the global count
            plain.step()
    if job.get("save"):
        tensors, chunks = zero.shard_pieces({"best": {k: v.detach().clone() for k, v in _whole(zero, model).items()}})
        tmp = checkpoint.save_shards(job["save"], job["stop"], tensors, chunks, run_id="r")
        if ctx.is_main:
            groups = [{k: v for k, v in g.items() if k != "params"} for g in zero.optimizer.param_groups][:1]
            checkpoint.save(job["save"], job["stop"], {"step": job["stop"], "optimizer_groups": groups}, run_id="r",
                            shards=tmp)
    optimizer = zero.optimizer_state() if zero is not None else plain.state_dict()
    if zero is not None:
        zero.close()
    if ctx.is_main:
        torch.save({"model": {k: v.clone() for k, v in model.state_dict().items()}, "optimizer": optimizer}, job["out"])
    with open(Path(job["out"]).with_suffix(f".rank{ctx.rank}.json"), "w") as fh:
        json.dump({"rank": ctx.rank}, fh)


def _whole(zero: ZeroSharder, model: nn.Module) -> dict:
    zero.gather()
    return model.state_dict()

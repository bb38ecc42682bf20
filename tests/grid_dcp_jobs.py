"""Worker function of the grid's sharded-checkpoint tests (``--shard-states`` with tensor shards, DCP): the engine
``fit`` uses (``GridEngine``) on ``tests.tp_jobs``' small tabular model (three embedding tables split by
vocabulary, column/row pairs whose widths do not all divide by the shards), saving and resuming as ``fit`` does
(``shard_pieces`` / ``save_shards`` / ``checkpoint.load_sharded``).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from flowtrain.parallel import DistContext
from flowtrain.train import checkpoint
from flowtrain.train.hybrid import GridEngine
from tests.tp_jobs import N_NUMERIC, batches, build_model


@dataclass
class Rows:
    """A global batch as ``GridEngine.train_step`` takes it (numerics and category codes apart)."""

    x_num: torch.Tensor
    x_cat: torch.Tensor

    def __len__(self) -> int:
        return len(self.x_num)


def run_job(ctx: DistContext, job: dict) -> None:
    """Steps [start, stop) on a grid of ``job["tensor"]`` tensor shards (the rest of the world: replicas) with ZeRO
    ``job["stage"]``; from the newest checkpoint in ``job["load"]`` when given (rank 0 then writes the whole model
    and optimizer state it read to ``job["loaded"]``); a checkpoint into ``job["save"]`` at the end (sharded when
    the engine shards: replicas and a stage); rank 0 writes the final whole model (what a bundle holds) to
    ``job["out"]``."""
    torch.set_num_threads(1)
    dtype = getattr(torch, job.get("dtype", "float32"))  # float64: the check mode (#49 item 5)
    model = build_model(dtype=dtype)
    stages = job.get("stages", 1)
    bounds = [[0, len(model) // 2], [len(model) // 2, len(model)]] if stages == 2 else None  # a fixed cut
    config = SimpleNamespace(stages=stages, tensor_parallel=job.get("tensor", 1), microbatches=3 if stages > 1 else 1,
                             schedule="1f1b", bucket_mb=1.0, lr=0.01, weight_decay=0.0, shard_states=job["stage"],
                             stage_bounds=bounds)
    sample = batches(1, dtype=dtype)[0][0][:4]
    engine = GridEngine(model, ctx, config, nn.MSELoss(), sample)
    if job.get("load"):
        path, state = checkpoint.require_latest(job["load"])
        if state.get("sharded_state"):
            checkpoint.load_sharded(engine, model, path, state)
        else:
            engine.load(state["model"], state["optimizer"])
        loaded = engine.optimizer_state()
        if ctx.is_main and job.get("loaded"):
            torch.save({"model": {k: v.clone() for k, v in model.state_dict().items()}, "optimizer": loaded},
                       job["loaded"])
    for x, y in batches(job["stop"], dtype=dtype)[job["start"]:]:
        engine.train_step(Rows(x[:, :N_NUMERIC], x[:, N_NUMERIC:].long()), y)
    engine.sync_model()
    if job.get("save"):
        groups = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups][:1]
        small = {"step": job["stop"], "optimizer_groups": groups, "stage_bounds": [list(b) for b in engine.plan.bounds]}
        shards = None
        if hasattr(engine, "shard_pieces"):
            tensors, chunks = engine.shard_pieces({"best": {k: v.clone() for k, v in model.state_dict().items()}})
            shards = checkpoint.save_shards(job["save"], job["stop"], tensors, chunks, run_id="r")
        else:
            small.update(model=model.state_dict(), optimizer=engine.optimizer_state())
        if ctx.is_main:
            checkpoint.save(job["save"], job["stop"], small, run_id="r", shards=shards)
    if ctx.is_main:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, job["out"])
    Path(job["out"]).with_suffix(f".rank{ctx.rank}").write_text("done")
    engine.close()

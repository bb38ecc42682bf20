"""The online trainer's replicas, together: each one's share gathered (as JSON, never unpickled), summed or
merged, and a yes that holds only when every replica says yes. Without a process group, just this one's.

Every function here is a collective when the trainer is distributed: all replicas call it at the same step.
"""
from __future__ import annotations

import torch

from flowtrain.parallel import DistContext, gather_json


def gather(ctx: DistContext, mine) -> list:
    """Every replica's ``mine`` (just ours without a process group), sent as JSON: never unpickled."""
    if not ctx.distributed:
        return [mine]
    return gather_json(mine)


def gather_dict(ctx: DistContext, mine: dict) -> dict:
    """Positions / seen offsets of all replicas: each key's highest value."""
    merged: dict = {}
    for d in gather(ctx, dict(mine)):
        for k, v in d.items():
            merged[k] = max(v, merged.get(k, v))
    return merged


def gather_list(ctx: DistContext, mine: list) -> list:
    """Every replica's items, in rank order."""
    return [x for part in gather(ctx, list(mine)) for x in part]


def sum_counts(dicts: list[dict]) -> dict:
    """Counts by name, summed over ``dicts``."""
    out: dict = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + int(v)
    return out


def all_agree(ctx: DistContext, mine: bool, device: torch.device) -> bool:
    """True only when every replica's ``mine`` is (a MIN all-reduce; ours without a process group)."""
    if not ctx.distributed:
        return mine
    import torch.distributed as dist

    flag = torch.tensor([float(mine)], dtype=torch.float64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item() > 0)

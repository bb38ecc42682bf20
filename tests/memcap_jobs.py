"""Worker functions of the ``--worker-memory`` enforcement tests, run through the real entry point."""
from __future__ import annotations

import torch


def allocate_job(ctx, job: dict) -> None:
    """Allocate and touch ``job["mib"]`` MiB on rank ``job["rank"]`` (every rank when absent)."""
    import torch.distributed as dist

    if job.get("rank") in (None, ctx.rank):
        block = torch.ones(int(job["mib"]) * 2**20 // 4)
        assert float(block[-1]) == 1.0
        del block
    if ctx.distributed:
        dist.barrier()

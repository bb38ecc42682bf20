"""Worker functions the launcher tests run through the real entry point (flowtrain.parallel.worker)."""
from __future__ import annotations

import os
import time
from pathlib import Path


def collective_loop_job(ctx, job: dict) -> None:
    """All-reduce every 50 ms for ``seconds``; rank r heartbeats every ``beat_every[r]`` seconds
    (peers' heartbeats out of phase, as in a real job) and writes its pid to ``<pids>/rank-<r>.pid``."""
    import torch
    import torch.distributed as dist

    from flowtrain.parallel.launch import heartbeat

    Path(job["pids"], f"rank-{ctx.rank}.pid").write_text(str(os.getpid()))
    every = float(job["beat_every"][ctx.rank])
    deadline = time.monotonic() + float(job["seconds"])
    while time.monotonic() < deadline:
        t = torch.ones(1)
        dist.all_reduce(t)
        heartbeat(every_s=every)
        time.sleep(0.05)

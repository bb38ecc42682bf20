"""Worker functions of issue 44 item 11's tests, run through the real launcher and worker entry point."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path


def wait_for_kafka_job(ctx, job: dict) -> None:
    """What the stream trainer's checkpoint does first: the dead-letter topic's end, rank 0 asking brokers that do
    not answer (a closed port) and every replica waiting with it; the rank ``job["stop_rank"]`` is asked to stop
    after ``job["stop_after"]`` s. Each rank writes when it left and how (``<out>/rank-<r>.json``), then meets the
    others in a gather, as the checkpoint would next (a rank left behind would hang it)."""
    import torch

    from flowtrain.parallel.launch import heartbeat
    from flowtrain.train.replicas import all_agree, gather
    from flowtrain.train.stream.rejects import InputRejects, StoppedWaiting

    rejects = InputRejects(job["bootstrap"], {}, features_topic="f", dead_letter_topic="d")
    started = time.monotonic()
    stop_at = started + float(job["stop_after"]) if ctx.rank == int(job["stop_rank"]) else float("inf")
    try:
        rejects.end_offsets(lambda: time.monotonic() >= stop_at, heartbeat, ask=ctx.is_main,
                            all_agree=lambda flag: all_agree(ctx, flag, torch.device("cpu")))
        how = "answered"
    except StoppedWaiting as err:
        how = f"stopped: {err}"
    left = time.monotonic() - started
    gather(ctx, {"rank": ctx.rank})
    Path(job["out"], f"rank-{ctx.rank}.json").write_text(json.dumps({"how": how, "left_s": left}))


def outlive_job(ctx, job: dict) -> None:
    """A worker that, told to stop (SIGTERM), writes a "checkpoint" as the stream trainer's workers do, and
    otherwise waits, heartbeating; its pid in ``<out>/rank-<r>.pid``."""
    from flowtrain.parallel.launch import heartbeat

    out = Path(job["out"])

    def on_term(signum, frame):
        (out / f"checkpoint-rank-{ctx.rank}").write_text(str(time.time()))
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    (out / f"rank-{ctx.rank}.pid").write_text(str(os.getpid()))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        heartbeat()
        time.sleep(0.1)

"""The one worker entry point: ``python -m flowtrain.parallel.worker MODULE:FUNCTION JOB.json``.

``flowtrain batch --workers N`` spawns it N times on 127.0.0.1; across machines the same
command runs under torchrun, which sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT::

    torchrun --nnodes=2 --nproc-per-node=1 --node-rank=<0|1> \\
        --master-addr=<node 0's address> --master-port=29500 \\
        -m flowtrain.parallel.worker flowtrain.train.jobs:train_worker /shared/run/job.json

The function is called as ``FUNCTION(ctx: DistContext, job: dict)`` after the process group
is up, on the job's ``device`` (top level or in its ``config``; auto, cpu or cuda: NCCL and
``cuda:LOCAL_RANK`` on a GPU, gloo on the CPU); it runs with ``FLOWTRAIN_THREADS`` (default:
cores / local world size) torch threads. With ``FLOWTRAIN_WORKER_MEMORY`` set (``--worker-memory``) the
worker caps itself before it (``flowtrain.parallel.memcap``) and ends with one line and exit code 3
when it goes over the cap. After it returns, every rank meets the others at a
barrier, destroys every process group and leaves (``_exit_cleanly``).
"""
from __future__ import annotations

import gc
import importlib
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

from flowtrain.parallel import init_from_env, memcap
from flowtrain.parallel.device import local_world_size
from flowtrain.parallel.launch import cap_worker, heartbeat, record_failure
from flowtrain.parallel.peers import exchange, lost_peers, use_route_to_master


def _threads() -> int:
    if os.environ.get("FLOWTRAIN_THREADS"):
        return int(os.environ["FLOWTRAIN_THREADS"])
    return max(1, (os.cpu_count() or 1) // local_world_size())


def _exit_cleanly(code: int) -> None:
    """End the process without tearing torch.distributed's C++ objects down in a half-finalized
    interpreter: the exit handlers run and the output is flushed as at a normal exit, then the
    process leaves (``os._exit``), so no store or gloo thread is destroyed at static-destruction
    time (a "terminate called without an active exception" abort; issue #11)."""
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or ":" not in argv[0]:
        print("usage: python -m flowtrain.parallel.worker MODULE:FUNCTION JOB.json", file=sys.stderr)
        return 2
    target, job_path = argv
    with open(job_path) as fh:
        job = json.load(fh)
    rank = os.environ.get("RANK", "0")
    heartbeat()  # alive (the imports are done) before the rendezvous
    try:
        torch.set_num_threads(_threads())
        device = job.get("device") or (job.get("config") or {}).get("device") or "auto"
        use_route_to_master()  # across machines gloo binds this host's address, not the hostname's
        ctx = init_from_env(timeout_s=float(job.get("failure_timeout_s", 60)), device=device)
        if ctx.distributed:
            exchange()  # every rank's host and address, to name a lost peer
        heartbeat(every_s=0.0)  # the rendezvous is over: the slowest peer has started too
        module, name = target.split(":")
        function = getattr(importlib.import_module(module), name)
        heartbeat(every_s=0.0)  # its imports are done
        if not getattr(function, "caps_after_setup", False):  # --worker-memory: capped from here on (calibrated on
            cap_worker(rank, ctx.is_main)  # what it holds now); a function that opens data first caps itself then
        function(ctx, job)
        if ctx.distributed:
            dist.barrier()  # nobody tears the group down while a peer still talks to it
            dist.destroy_process_group()  # every group, while the interpreter is whole
            gc.collect()  # process groups held in reference cycles go now, not during exit
            _exit_cleanly(0)
    except BaseException as err:  # noqa: BLE001 - every failure leaves with its rank named
        cap = memcap.applied()
        line = cap.exceeded_line() if cap is not None and memcap.over_cap(err) else \
            str(err) if isinstance(err, memcap.CapBelowOverhead) else None
        if line is not None:  # over --worker-memory: one line, no traceback
            record_failure(err, line=line)
            print(f"flowtrain worker rank {rank} {line}", file=sys.stderr, flush=True)
            os._exit(memcap.CAP_EXIT)
        record_failure(err)
        lost = lost_peers(err)
        print(f"flowtrain worker rank {rank} failed: " + (f"lost {lost}: " if lost else "") + f"{err!r}",
              file=sys.stderr)
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # do not wait on peers in a destroyed group
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
    return 0


if __name__ == "__main__":
    sys.exit(main())

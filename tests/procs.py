"""Process helpers the tests share: stop a process group the test started, find a job's workers."""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path


def stop_group(proc: subprocess.Popen, sig=signal.SIGINT, timeout: float = 60) -> None:
    """Send ``sig`` to the process group of ``proc`` (started with ``start_new_session=True``),
    wait up to ``timeout`` s, then SIGKILL the group. Nothing if it has exited already."""
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def worker_pids(job_path: str) -> dict[int, int]:
    """{rank: pid} of the live ``flowtrain.parallel.worker`` processes running the job file ``job_path``."""
    pids = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"flowtrain.parallel.worker" in cmd and job_path.encode() in cmd:
            rank = next((int(e.split(b"=")[1]) for e in env if e.startswith(b"RANK=")), None)
            if rank is not None:
                pids[rank] = int(proc.name)
    return pids

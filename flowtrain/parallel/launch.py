"""Spawning data-parallel workers on 127.0.0.1, and ending the job when one of them fails.

Every worker is ``python -m flowtrain.parallel.worker TARGET JOB.json``, the same entry point torchrun
runs across machines. The launcher gives each its rank in the environment variables torchrun
sets, one rendezvous port, and ``cores / N`` threads. It ends the whole job, within a bound,
when a worker exits non-zero, is killed, or stops making progress (no heartbeat for
``failure_timeout_s``); collectives themselves time out after the same bound inside the
workers. No worker process is left behind: the workers are children of a
:class:`flowtrain.local.processes.Supervisor` (each in its own process group), stopped on every way out,
and SIGTERM, SIGHUP or SIGINT to the launching process are forwarded to them (then the launcher ends as
the signal would have ended it). A launcher that dies without a word (SIGKILL, a native crash) takes its
workers with it at once: their parent-death signal is SIGKILL, not a stop they would act on (a stream
trainer's workers, told to stop, write a last checkpoint: after their launcher was gone, and maybe after a
new one had resumed from the checkpoint before it).

Everything the job listens on is on 127.0.0.1: the rendezvous store (``MASTER_ADDR=127.0.0.1``,
bound to loopback by :func:`flowtrain.parallel.context.init_from_env`) and gloo's (and NCCL's)
connections between the workers (``GLOO_SOCKET_IFNAME=lo``, ``NCCL_SOCKET_IFNAME=lo``).

Blame goes to the cause, not to its victims: a worker killed by a signal, or stopped (SIGSTOP,
state ``T``), is named before the peers that then failed or stalled waiting for it in a
collective; among stalled workers, the one whose heartbeat stopped first.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from connectors.secrets import redact
from flowtrain.local.processes import StopSignals, Supervisor
from flowtrain.local.tools import free_port
from flowtrain.parallel import memcap

HEARTBEAT_ENV = "FLOWTRAIN_HEARTBEAT_DIR"
_last_beat = 0.0


class WorkerFailure(RuntimeError):
    """A worker failed; the message names its rank and the cause."""

    def __init__(self, rank: int, cause: str, log_tail: str = ""):
        self.rank, self.cause, self.log_tail = rank, cause, log_tail
        super().__init__(f"worker rank {rank} {cause}" + (f"\n--- rank {rank} log ---\n{log_tail}" if log_tail else ""))


def cap_worker(rank: int | str, is_main: bool) -> memcap.MemoryCap | None:
    """``--worker-memory`` on this worker, once (``memcap.cap_from_env``; the cap recorded beside its heartbeat)."""
    return memcap.cap_from_env(rank, is_main, os.environ.get(HEARTBEAT_ENV))


def heartbeat(every_s: float = 1.0) -> None:
    """Called by workers each step: touches ``<dir>/rank-<r>.beat`` at most once per ``every_s``."""
    global _last_beat
    directory = os.environ.get(HEARTBEAT_ENV)
    now = time.monotonic()
    if not directory or now - _last_beat < every_s:
        return
    _last_beat = now
    path = Path(directory) / f"rank-{os.environ.get('RANK', '0')}.beat"
    path.touch()


def _cause(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def spawn(n_workers: int, target: str, job: dict, *, failure_timeout_s: float = 60.0,
          threads_per_worker: int | None = None, workdir: str | Path | None = None,
          extra_env: dict[str, str] | None = None, stop: Callable[[], bool] | None = None,
          memory_cap: int | None = None) -> float:
    """Run ``target(ctx, job)`` in ``n_workers`` processes; returns wall seconds or raises
    ``WorkerFailure`` (after every worker is gone).

    ``stop`` (polled) asks for a graceful end: every worker gets SIGTERM once, and the job ends
    when they have exited (a worker that fails meanwhile is still reported). SIGTERM, SIGHUP or
    SIGINT received while the job runs (in the main thread) do the same; when a worker then did
    not end cleanly, the launching process ends as the signal would have ended it, after its
    workers are gone.

    ``memory_cap`` (bytes, ``--worker-memory``): each worker caps itself (``flowtrain.parallel.memcap``);
    one that goes over its cap fails with one line naming the cap."""
    made_workdir = workdir is None  # a work directory made here (under /tmp) is removed when the job ends
    workdir = Path(workdir or tempfile.mkdtemp(prefix="flowtrain-workers-"))
    workdir.mkdir(parents=True, exist_ok=True)
    beats = workdir / "heartbeats"
    beats.mkdir(exist_ok=True)
    job_path = workdir / "job.json"
    # no secret in a file (connectors.secrets): a worker gets its secrets from its environment (extra_env)
    job_path.write_text(json.dumps(redact({**job, "failure_timeout_s": failure_timeout_s}), default=str))
    threads = threads_per_worker or max(1, (os.cpu_count() or 1) // n_workers)
    port = free_port()  # a rendezvous port no client socket can be holding
    supervisor = Supervisor(grace_s=5.0, death_signal=signal.SIGKILL)  # no worker outlives its launcher
    logs: list[Path] = []
    t0 = time.monotonic()
    signals = StopSignals(orphan_grace_s=failure_timeout_s).install()  # before the first worker exists
    failed = False
    try:
        for rank in range(n_workers):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(n_workers), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(n_workers), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       OMP_NUM_THREADS=str(threads), FLOWTRAIN_THREADS=str(threads), PYTHONFAULTHANDLER="1",
                       GLOO_SOCKET_IFNAME="lo", NCCL_SOCKET_IFNAME="lo",  # peers on 127.0.0.1 only
                       **{HEARTBEAT_ENV: str(beats)}, **(memcap.cap_env(memory_cap) if memory_cap else {}),
                       **(extra_env or {}))
            log = workdir / f"rank-{rank}.log"
            logs.append(log)
            # rank 0 shows its output (progress, epochs); the others only to their logs
            out = None if rank == 0 else open(log, "wb")
            err = open(log, "ab") if rank == 0 else subprocess.STDOUT
            try:
                supervisor.start(f"rank-{rank}", [sys.executable, "-m", "flowtrain.parallel.worker", target,
                                                  str(job_path)], env=env, stdout=out, stderr=err,
                                 stdin=subprocess.DEVNULL)
            finally:
                for fh in (out, err):
                    if hasattr(fh, "close"):
                        fh.close()
        requested = (lambda: signals.is_set() or stop()) if stop is not None else signals.is_set
        _watch(supervisor, logs, beats, failure_timeout_s, requested)
        return time.monotonic() - t0
    except BaseException:
        failed = True
        raise
    finally:
        _kill_all(supervisor)
        for rank in range(len(logs)):  # a capped worker's cgroup v2 (empty now)
            cap = memcap.read_cap(beats, rank)
            if cap is not None:
                memcap.remove_cgroup(cap)
        if made_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
        signals.restore()
        if signals.received is not None and (failed or any(c.proc.returncode for c in supervisor.children.values())):
            signals.reraise()


def record_failure(error: BaseException, line: str | None = None) -> None:
    """Called by a failing worker: when and why, so the launcher can name the first to fail
    (its peers fail a moment later with "connection closed" errors); ``line``: the whole cause in one
    line (a worker over its memory cap), reported without the log's tail."""
    directory = os.environ.get(HEARTBEAT_ENV)
    if directory:
        path = Path(directory) / f"rank-{os.environ.get('RANK', '0')}.failed"
        path.write_text(json.dumps({"time": time.time(), "error": repr(error)[:2000],
                                    **({"line": line} if line else {})}))


def _stopped(proc: subprocess.Popen) -> bool:
    """The process is stopped (SIGSTOP/SIGTSTP: state T) or traced (t)."""
    try:
        stat = Path(f"/proc/{proc.pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] in ("T", "t")


def _last_beat_time(beats: Path, rank: int, started: float) -> float:
    """Wall time of the rank's last heartbeat (the job's start if it never beat)."""
    try:
        return (beats / f"rank-{rank}.beat").stat().st_mtime
    except OSError:
        return started


def _stalled(procs, logs, beats: Path, timeout_s: float, started: float) -> WorkerFailure:
    """Some worker made no progress for ``timeout_s``: blame a stopped one, else the one whose
    heartbeat stopped first (its peers stall a moment later, waiting for it in a collective)."""
    alive = [rank for rank, p in enumerate(procs) if p.poll() is None]
    stopped = [rank for rank in alive if _stopped(procs[rank])]
    if stopped:
        rank = stopped[0]
        cause = (f"was stopped (process state T, e.g. SIGSTOP) and made no progress for "
                 f"{time.time() - _last_beat_time(beats, rank, started):.0f} s (bound {timeout_s:.0f} s)")
    else:
        rank = min(alive, key=lambda r: _last_beat_time(beats, r, started))
        cause = (f"made no progress for {time.time() - _last_beat_time(beats, rank, started):.0f} s "
                 f"(bound {timeout_s:.0f} s; a stalled collective or a hang)")
    return WorkerFailure(rank, cause, _tail(logs[rank]))


def _root_cause(procs, logs, beats: Path) -> WorkerFailure:
    """Among the failed workers, the one that failed first: a killed or stopped one (an outside
    cause), else the earliest recorded failure."""
    time.sleep(0.5)  # let the peers of the first failure finish failing
    stopped = [rank for rank, p in enumerate(procs) if p.poll() is None and _stopped(p)]
    if stopped:  # its peers failed waiting for it (a collective's timeout)
        rank = stopped[0]
        others = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
        return WorkerFailure(rank, f"was stopped (process state T, e.g. SIGSTOP); rank"
                                   f"{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} then failed "
                                   f"waiting for it", _tail(logs[rank]))
    failed = [(rank, p.returncode) for rank, p in enumerate(procs) if p.poll() not in (None, 0)]
    killed = [(rank, rc) for rank, rc in failed if rc < 0]

    def when(rank: int) -> float:
        try:
            return json.loads((beats / f"rank-{rank}.failed").read_text())["time"]
        except (OSError, ValueError, KeyError):
            return float("inf")

    def capped(rank: int, rc: int) -> str | None:
        """The one line of a worker that went over --worker-memory (its record, or its cgroup's OOM kill)."""
        if rc < 0:
            cap = memcap.read_cap(beats, rank)
            return memcap.killed_line(cap) if cap is not None else None
        try:
            return json.loads((beats / f"rank-{rank}.failed").read_text()).get("line")
        except (OSError, ValueError):
            return None

    over = [(rank, line) for rank, rc in failed if (line := capped(rank, rc))]
    if over:  # the cap is the cause; its peers failed waiting for it
        rank, line = min(over, key=lambda f: when(f[0]))
        return WorkerFailure(rank, line)
    rank, rc = killed[0] if killed else min(failed, key=lambda f: when(f[0]))
    others = [r for r, _ in failed if r != rank]
    note = f" (then rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} failed too)" if others else ""
    return WorkerFailure(rank, _cause(rc) + note, _tail(logs[rank]))


def _watch(supervisor: Supervisor, logs, beats: Path, timeout_s: float, stop: Callable[[], bool] | None = None) -> None:
    procs = [child.proc for child in supervisor.children.values()]
    started = time.monotonic()
    started_wall = time.time()
    forwarded = False
    while True:
        if stop is not None and not forwarded and stop():
            forwarded = True
            supervisor.send(signal.SIGTERM)  # each live worker's group (with SIGCONT: a stopped one acts on it)
        alive = 0
        for proc in procs:
            rc = proc.poll()
            if rc is None:
                alive += 1
            elif rc != 0:
                raise _root_cause(procs, logs, beats)
        if alive == 0:
            return
        now = time.time()
        for rank, proc in enumerate(procs):
            if proc.poll() is not None:
                continue
            beat = beats / f"rank-{rank}.beat"
            last = beat.stat().st_mtime if beat.exists() else None
            since = now - last if last else time.monotonic() - started
            if since > timeout_s:
                raise _stalled(procs, logs, beats, timeout_s, started_wall)
        time.sleep(0.1)


def _kill_all(supervisor: Supervisor, grace_s: float = 5.0) -> None:
    """Every worker ends: SIGTERM (a stopped one acts on it too), then SIGKILL after ``grace_s``."""
    supervisor.stop(signal.SIGTERM, grace_s=grace_s)

"""``--worker-memory`` enforced: each spawned worker capped, and a worker over its cap ends with one line.

The launcher passes the cap to each worker in its environment (``cap_env``); the worker applies it to
itself once its imports and the rendezvous are done (``apply_cap``), before training, with the first
mechanism that works here:

- **cgroup v2 ``memory.max``**, where ``/sys/fs/cgroup`` is the unified hierarchy, the memory controller
  is enabled for the children of this process's cgroup and the process may create a child cgroup there:
  the worker moves itself into its own child cgroup whose ``memory.max`` is the cap less what it holds
  already (its resident set stays charged to the parent; swap off). Over it, the kernel's OOM killer ends
  the worker (SIGKILL); the launcher reads the cgroup's ``memory.events`` and names the cap.
- **``RLIMIT_AS``** otherwise (cgroup v1, or no delegation, as in most containers): the address space is
  capped at the cap plus a *calibrated allowance*, the worker's mapped but not resident address space
  measured when the cap is applied (shared libraries, thread stacks, allocator reservations: about
  2.7 GiB with torch and gloo on this machine, against a resident set of about 0.5 GiB) plus
  ``HEADROOM`` for threads and mappings made later. The launcher sets ``MALLOC_ARENA_MAX=2`` for capped
  workers so glibc's per-thread arenas (64 MiB reservations each) do not eat the allowance, and
  ``MALLOC_MMAP_THRESHOLD_=131072`` so a freed tensor's memory goes back to the system: with glibc's
  dynamic threshold the first freed large block raises it (up to 32 MiB), later tensors come from the
  heap, which keeps their peak (measured: a ZeRO-3 rank's first step grew its address space by ~145 MiB
  against its ~30 MiB plan; ~23 MiB with the threshold fixed). Over it, an
  allocation fails (torch's "can't allocate memory", Python's ``MemoryError``) and the worker ends with
  exit code ``CAP_EXIT`` and one line naming the cap. The cap is then on the address space, not on
  resident pages: a worker may touch up to ``HEADROOM`` more than the cap before it fails.

The cap counts everything the worker holds, its fixed overhead included (as the plan's check before
training does: ``flowtrain.train.memory_plan.fits_line``).
"""
from __future__ import annotations

import json
import os
import resource
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["CAP_ENV", "CAP_EXIT", "HEADROOM", "CapBelowOverhead", "MemoryCap", "applied", "apply_cap", "cap_env",
           "cap_from_env", "killed_line", "mechanism", "over_cap", "read_cap", "remove_cgroup", "write_cap"]

CAP_ENV = "FLOWTRAIN_WORKER_MEMORY"  # bytes each worker may hold
CAP_EXIT = 3  # a worker that went over its cap (RLIMIT_AS)
HEADROOM = 256 * 2**20  # address space for threads and mappings made after the calibration
MMAP_THRESHOLD = 128 * 2**10  # glibc's default, fixed: larger blocks are mmapped and unmapped when freed (module doc)
CGROUP_ROOT = Path("/sys/fs/cgroup")


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def cap_env(cap_bytes: int) -> dict[str, str]:
    """The environment a capped worker is started with."""
    return {CAP_ENV: str(int(cap_bytes)), "MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}


def _own_cgroup() -> Path | None:
    """This process's cgroup v2 directory when its children may get the memory controller, else None."""
    if not (CGROUP_ROOT / "cgroup.controllers").exists():
        return None  # cgroup v1 or hybrid: no unified hierarchy
    try:
        with open("/proc/self/cgroup") as fh:
            rel = next((line[3:].strip() for line in fh if line.startswith("0::")), None)
        if rel is None:
            return None
        here = CGROUP_ROOT / rel.lstrip("/")
        if "memory" not in (here / "cgroup.subtree_control").read_text().split():
            return None
        return here if os.access(here, os.W_OK) else None
    except OSError:
        return None


def mechanism() -> str:
    """What a cap applied now would use: ``cgroup v2 memory.max`` or ``RLIMIT_AS``."""
    return "cgroup v2 memory.max" if _own_cgroup() is not None else "RLIMIT_AS"


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field}")


@dataclass(frozen=True)
class MemoryCap:
    """A cap applied to this worker."""

    bytes: int
    mechanism: str  # "cgroup v2 memory.max" | "RLIMIT_AS"
    limit: int  # the number written: memory.max, or RLIMIT_AS
    allowance: int = 0  # RLIMIT_AS: the calibrated address space beyond the cap
    cgroup: str | None = None

    def describe(self) -> str:
        if self.cgroup:
            return f"--worker-memory {_gib(self.bytes)} enforced by cgroup v2 memory.max ({self.cgroup})"
        return (f"--worker-memory {_gib(self.bytes)} enforced by RLIMIT_AS (address space {_gib(self.limit)}: the cap "
                f"plus a calibrated allowance of {_gib(self.allowance)} for mapped, non-resident memory)")

    def exceeded_line(self) -> str:
        return (f"exceeded its memory cap, {self.describe()}: it needs more than {_gib(self.bytes)} per worker; "
                f"shard more state (--shard-states parameters), add workers, or raise --worker-memory "
                f"(--print-plan shows what each rank holds)")


def _try_cgroup(cap_bytes: int, rss: int) -> MemoryCap | None:
    here = _own_cgroup()
    if here is None:
        return None
    child = here / f"flowtrain-worker-{os.getpid()}"
    limit = max(cap_bytes - rss, 1 << 20)
    try:
        child.mkdir()
    except OSError:
        return None
    try:
        (child / "memory.max").write_text(str(limit))
        if (child / "memory.swap.max").exists():
            (child / "memory.swap.max").write_text("0")
        (child / "cgroup.procs").write_text(str(os.getpid()))
    except OSError:
        try:
            child.rmdir()
        except OSError:
            pass
        return None
    return MemoryCap(cap_bytes, "cgroup v2 memory.max", limit, cgroup=str(child))


class CapBelowOverhead(ValueError):
    """The worker holds more than its cap before training (its message is the one line)."""


def apply_cap(cap_bytes: int) -> MemoryCap:
    """Cap this process (module doc); raises ``CapBelowOverhead`` when it holds more than the cap already."""
    rss = _status_kib("VmRSS") * 1024
    if rss >= cap_bytes:
        raise CapBelowOverhead(f"--worker-memory {_gib(cap_bytes)} is below this worker's fixed overhead ({_gib(rss)} "
                         f"resident after its imports and the rendezvous): give more than that")
    cap = _try_cgroup(cap_bytes, rss)
    if cap is not None:
        return cap
    mapped = _status_kib("VmSize") * 1024
    allowance = mapped - rss + HEADROOM
    limit = cap_bytes + allowance
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    return MemoryCap(cap_bytes, "RLIMIT_AS", limit, allowance=allowance)


_APPLIED: list[MemoryCap] = []  # this process's cap, once applied (``cap_from_env``)


def cap_from_env(rank: int | str, is_main: bool, record_in: str | None = None) -> MemoryCap | None:
    """``--worker-memory`` on this worker, once (a later call returns the cap applied): the cap in its environment
    (``CAP_ENV``) applied now, recorded in ``record_in`` (its heartbeat's directory: the launcher reads it) and said
    by rank 0. A training worker is capped once its data is open and training's lazy imports are done
    (``flowtrain.train.loop.fit``, ``flowtrain.train.preload``: the reader's threads, allocator reservations and the
    libraries it would load later are then part of the calibration, not of what it may still map); others at the start
    (``worker.main``); both through ``flowtrain.parallel.launch.cap_worker``."""
    if _APPLIED:
        return _APPLIED[0]
    if not os.environ.get(CAP_ENV):
        return None
    cap = apply_cap(int(os.environ[CAP_ENV]))
    _APPLIED.append(cap)
    if record_in:
        write_cap(record_in, rank, cap)
    if is_main:
        print(f"worker memory: {cap.describe()}", flush=True)
    return cap


def applied() -> MemoryCap | None:
    """The cap ``cap_from_env`` applied to this process (None: none yet)."""
    return _APPLIED[0] if _APPLIED else None


def over_cap(err: BaseException) -> bool:
    """The error is an allocation that failed (what RLIMIT_AS makes of going over the cap: memory, or a new thread's
    stack)."""
    if isinstance(err, MemoryError):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and any(s in text for s in ("can't allocate memory", "not enough memory",
                                                                         "std::bad_alloc", "Cannot allocate memory",
                                                                         "can't start new thread"))


def write_cap(directory: str | Path, rank: int | str, cap: MemoryCap) -> None:
    """Where the launcher finds a worker's cap (``rank-<r>.cap`` beside its heartbeat)."""
    (Path(directory) / f"rank-{rank}.cap").write_text(json.dumps(asdict(cap)))


def read_cap(directory: str | Path, rank: int | str) -> MemoryCap | None:
    try:
        return MemoryCap(**json.loads((Path(directory) / f"rank-{rank}.cap").read_text()))
    except (OSError, ValueError, TypeError):
        return None


def killed_line(cap: MemoryCap) -> str | None:
    """For a worker killed by a signal: the one line naming its cap when the cap killed it (its cgroup's OOM
    killer), else None."""
    if not cap.cgroup:
        return None
    try:
        events = dict(line.split() for line in (Path(cap.cgroup) / "memory.events").read_text().splitlines())
    except (OSError, ValueError):
        return None
    return cap.exceeded_line() if int(events.get("oom_kill", "0")) > 0 else None


def remove_cgroup(cap: MemoryCap) -> None:
    """The worker's empty cgroup, once it has exited."""
    if cap.cgroup:
        try:
            os.rmdir(cap.cgroup)
        except OSError:
            pass

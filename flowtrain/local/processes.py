"""The processes flowtrain starts, watches and stops: one place for who a pid is and how it ends.

* **Identity.** A pid read from a file (``broker.json``, ``cluster.json``) is trusted only while
  ``/proc/PID/stat`` still reports the start time recorded with it (and, for a record written
  without one, while its command line still holds a recorded marker): a pid the kernel reused
  for another process is never signalled. :func:`identity`, :func:`same_process`,
  :func:`stop_recorded`.
* **Children die with their parent.** :class:`Supervisor` starts each child in its own process
  group (its session: a terminal's Ctrl-C reaches only the parent, which forwards it) with a
  parent-death signal (``prctl(PR_SET_PDEATHSIG)``), so a parent killed by any signal, SIGKILL
  included, still ends its children. It stops them group by group: a signal, a deadline, then
  SIGKILL.
* **Stop signals.** :class:`StopSignals` turns SIGTERM, SIGHUP and SIGINT into a stop request
  the work polls (a final checkpoint, a cancelled pipeline), and bounds the stop of a process
  whose parent is gone: after ``orphan_grace_s`` its whole process group (its own children, a
  runner it started) is killed.

Linux only (``/proc``, ``prctl``), like the rest of ``flowtrain.local``.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

#: The signals that ask a flowtrain process to stop: systemd/kill, a closed terminal, Ctrl-C.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
_PR_SET_PDEATHSIG = 1


# -- identity ----------------------------------------------------------------------------------
def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat); None when
    no such process runs or it is a zombie (it has ended; only its exit status is left)."""
    try:
        with open(f"/proc/{int(pid)}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except (OSError, ValueError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def cmdline(pid: int) -> list[str] | None:
    """The process's command line (argv), or None when it cannot be read."""
    try:
        with open(f"/proc/{int(pid)}/cmdline", "rb") as fh:
            raw = fh.read()
    except (OSError, ValueError):
        return None
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def identity(pid: int) -> dict:
    """What to record beside a pid so that it can be recognised later: ``{"pid", "started"}``."""
    return {"pid": int(pid), "started": start_time(pid)}


def same_process(record: Mapping, marker: str | None = None) -> bool:
    """True while the process a record names still runs: the pid's start time is the recorded one
    and, when ``marker`` is given, its command line holds ``marker``. A record without a start time
    (written by an older flowtrain) is recognised by ``marker`` alone, or not at all."""
    pid = record.get("pid")
    if pid is None:
        return False
    started = start_time(pid)
    if started is None:
        return False
    if record.get("started") is not None and str(record["started"]) != started:
        return False
    if marker is not None:
        return any(marker in arg for arg in (cmdline(pid) or []))
    return record.get("started") is not None


def describe(pid: int) -> str:
    """What runs as ``pid`` now, for messages: "pid 123 now runs `sleep 600`" or "no process has pid 123"."""
    args = cmdline(pid)
    if start_time(pid) is None or not args:
        return f"no process has pid {pid}"
    text = " ".join(args)
    return f"pid {pid} now runs `{text[:80]}{'...' if len(text) > 80 else ''}`"


# -- stopping ----------------------------------------------------------------------------------
def _signal(pid: int, sig: int, group: bool) -> None:
    try:
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _reap(pid: int) -> int | None:
    """Collect the exit status of our own child ``pid`` if it has ended (a zombie no longer counts)."""
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return None
    return os.waitstatus_to_exitcode(status) if done else None


def stop_recorded(records: Sequence[Mapping], *, sig: int = signal.SIGTERM, grace_s: float = 30.0,
                  marker: str | None = None, group: bool = True) -> list[Mapping]:
    """Stop the processes ``records`` name (``{"pid", "started"}``) that are still those processes:
    ``sig`` (to their process groups with ``group``), up to ``grace_s`` seconds, then SIGKILL. Each
    is checked with :func:`same_process` before every signal, so a reused pid is never touched.
    Returns the records that were running (and are stopped now)."""
    live = [r for r in records if same_process(r, marker)]
    for r in live:
        _signal(int(r["pid"]), sig, group and _leads_group(int(r["pid"])))
        _signal(int(r["pid"]), signal.SIGCONT, group and _leads_group(int(r["pid"])))  # a stopped one acts on it
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        for r in live:
            _reap(int(r["pid"]))
        if not any(same_process(r, marker) for r in live):
            return live
        time.sleep(0.1)
    for r in live:
        if same_process(r, marker):
            _signal(int(r["pid"]), signal.SIGKILL, group and _leads_group(int(r["pid"])))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(same_process(r, marker) for r in live):
        for r in live:
            _reap(int(r["pid"]))
        time.sleep(0.05)
    return live


def descendants(pid: int) -> list[dict]:
    """Identity records (:func:`identity`) of every live process below ``pid``: its children, theirs, ..."""
    parent_of: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[0] not in ("Z", "X"):
                parent_of[int(entry.name)] = int(fields[1])
    found: list[int] = []
    frontier = [int(pid)]
    while frontier:
        current = frontier.pop()
        for child, parent in parent_of.items():
            if parent == current and child not in found:
                found.append(child)
                frontier.append(child)
    return [r for r in (identity(p) for p in found) if r["started"] is not None]


def _leads_group(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid
    except ProcessLookupError:
        return False


# -- children that die with their parent -------------------------------------------------------
def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets ``sig`` when this process (the thread
    that starts it) ends, however it ends. ``prctl`` is looked up here, before the fork, so the
    child only makes the call; a parent that died before it did is noticed and ``sig`` sent at once.
    The child's SIGINT is set back to its default: a parent started as a background job of a script
    inherits SIGINT ignored, and its children would ignore the SIGINT that asks them to stop (each child
    runs in a session of its own, so no terminal's Ctrl-C reaches it; only its supervisor sends it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    prctl = libc.prctl
    parent = os.getpid()

    def preexec() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent ended between fork and prctl
            os.kill(os.getpid(), sig)

    return preexec


@dataclass
class Child:
    """One supervised child: its name, process and identity (pid and start time)."""

    name: str
    proc: subprocess.Popen
    started: str | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def record(self) -> dict:
        return {"pid": self.proc.pid, "started": self.started}

    def poll(self) -> int | None:
        return self.proc.poll()


@dataclass
class Supervisor:
    """Starts children that end with this process, watches them, stops them as one.

    Each child runs in its own process group with a parent-death signal (``death_signal``): a
    parent that is killed (even by SIGKILL) leaves no child running. :meth:`stop` sends each live
    child's group ``sig`` (and SIGCONT, so a stopped child acts on it), waits up to ``grace_s``
    seconds, then SIGKILLs the groups that remain, and reaps them.
    """

    grace_s: float = 60.0
    #: 0: no parent-death signal, and no ``preexec_fn`` at all. For a parent running gRPC threads (Beam's
    #: worker pool): Python code between fork and exec there can hang or crash the child (gRPC skips its
    #: fork handlers while other threads call into it), which lost an SDK worker of every Flink job.
    death_signal: int = signal.SIGTERM
    children: dict[str, Child] = field(default_factory=dict)
    #: the children :meth:`stop` had to SIGKILL: they did not end within the grace period
    killed: list[str] = field(default_factory=list)

    def start(self, name: str, argv: Sequence[str], **popen) -> Child:
        """Start ``argv`` (keyword arguments go to ``subprocess.Popen``) as child ``name``."""
        if name in self.children:
            raise ValueError(f"a child named {name!r} was started already")
        preexec = die_with_parent(self.death_signal) if self.death_signal else None
        proc = subprocess.Popen(list(argv), start_new_session=True, preexec_fn=preexec, **popen)
        child = Child(name, proc, start_time(proc.pid))
        self.children[name] = child
        return child

    def alive(self) -> list[Child]:
        return [c for c in self.children.values() if c.poll() is None]

    def exited(self) -> list[Child]:
        return [c for c in self.children.values() if c.poll() is not None]

    def send(self, sig: int) -> None:
        """Send ``sig`` to every live child's process group (SIGCONT after it)."""
        for child in self.alive():
            _signal(child.pid, sig, True)
            _signal(child.pid, signal.SIGCONT, True)

    def stop(self, sig: int = signal.SIGTERM, grace_s: float | None = None) -> dict[str, int]:
        """Stop every child (see the class doc); returns each child's exit status (negative: the
        signal that ended it). The names of the children that had to be killed after the grace period
        are in :attr:`killed`."""
        grace = self.grace_s if grace_s is None else grace_s
        # what each child started, noted before the signal: a runner (Prism) or worker in a session of
        # its own is not in the child's process group, and may outlive its parent by the kill below
        below = {c.name: descendants(c.pid) for c in self.alive()}
        self.send(sig)
        deadline = time.monotonic() + grace
        for child in self.children.values():
            try:
                child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for child in self.children.values():
            # the child, or what it started in its group after it ended; a group id stays taken while
            # its leader's pid is: with no process holding that pid, only the child's leftovers have it
            if child.poll() is None:
                self.killed.append(child.name)
            if child.poll() is None or start_time(child.pid) is None:
                _signal(child.pid, signal.SIGKILL, True)
            for record in below.get(child.name, ()):
                if same_process(record):
                    _signal(int(record["pid"]), signal.SIGKILL, False)
        for child in self.children.values():
            try:
                child.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        return {name: c.proc.returncode for name, c in self.children.items()}

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc) -> None:
        if self.alive():
            self.stop()


# -- stop requests -----------------------------------------------------------------------------
class StopSignals:
    """SIGTERM, SIGHUP and SIGINT as a stop request: ``is_set()`` turns true, ``received`` names the
    first signal. Use as a context manager (the previous handlers come back at its end) or call
    :meth:`install`; only the main thread can install signal handlers (elsewhere nothing is
    installed and only :meth:`set` requests a stop).

    ``orphan_grace_s``: when a stop signal arrives and this process's parent is gone (a supervisor
    killed, the parent-death signal delivered), the process group this process leads is SIGKILLed
    after that many seconds, so an orphan's stop is bounded and takes its own children with it.
    """

    def __init__(self, signals: Sequence[int] = STOP_SIGNALS, *, orphan_grace_s: float | None = 120.0):
        self.signals = tuple(signals)
        self.orphan_grace_s = orphan_grace_s
        self.received: int | None = None
        self._event = threading.Event()
        self._previous: dict[int, object] = {}
        self._parent = os.getppid()

    def install(self) -> StopSignals:
        """Install the handlers; a signal this process ignores (``nohup``'s SIGHUP, SIGINT of a
        background job) stays ignored."""
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                if signal.getsignal(sig) != signal.SIG_IGN:
                    self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def __enter__(self) -> StopSignals:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.restore()

    def _handle(self, signum, _frame) -> None:
        if self.received is None:
            self.received = signum
            if self.orphan_grace_s is not None and os.getppid() != self._parent and os.getpgid(0) == os.getpid():
                timer = threading.Timer(self.orphan_grace_s, os.killpg, (os.getpid(), signal.SIGKILL))
                timer.daemon = True
                timer.start()
        self._event.set()

    def set(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)

    def reraise(self) -> None:
        """End this process as the signal received would have without a handler (after the caller
        has stopped its children): SIGINT raises KeyboardInterrupt, others kill with the default action."""
        if self.received is None:
            return
        self.restore()
        if self.received == signal.SIGINT:
            raise KeyboardInterrupt
        signal.signal(self.received, signal.SIG_DFL)
        os.kill(os.getpid(), self.received)
        time.sleep(5)  # the default action ends the process


def supervise(commands: Mapping[str, tuple[Sequence[str], Path]], *, report: Callable[[], None] | None = None,
              every_s: float = 2.0, stop_signal: int = signal.SIGINT, grace_s: float = 60.0,
              procs: dict | None = None, what: str = "flowtrain", env: Mapping[str, str] | None = None,
              pass_fds: Sequence[int] = ()) -> dict[str, int]:
    """Run ``{name: (argv, log)}`` as supervised children (output appended to ``log``) until one of them
    ends or this process gets SIGTERM, SIGHUP or SIGINT; then stop them all (``stop_signal`` to each
    group, so each stops its own work cleanly; SIGKILL after ``grace_s`` to its group and to everything
    it started, a runner included). ``report`` is called every ``every_s`` seconds meanwhile (a live
    status line), on a thread of its own: a report that waits (on brokers that do not answer) never
    delays a stop. ``procs`` gets ``{name: Popen}`` as they start (for a status page). Lines about the
    stop, a child that had to be killed among them, start with ``what``. ``env``: the children's environment
    (default: this process's); ``pass_fds``: file descriptors the children inherit (``subprocess.Popen``'s).
    Returns each child's exit status."""
    with StopSignals() as stop, Supervisor(grace_s=grace_s) as children:
        for name, (argv, log) in commands.items():
            with open(log, "ab") as out:
                child = children.start(name, argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       env=None if env is None else dict(env), pass_fds=tuple(pass_fds))
            if procs is not None:
                procs[name] = child.proc
        reporting: list[threading.Thread] = []
        while not stop.is_set() and not children.exited():
            if stop.wait(every_s) or children.exited():
                break
            if report is not None and not (reporting and reporting[-1].is_alive()):  # one report at a time
                reporting[:] = [threading.Thread(target=report, name="supervise-report", daemon=True)]
                reporting[0].start()
        why = (f"{signal.Signals(stop.received).name} received" if stop.received is not None else
               "ended: " + ", ".join(f"{c.name} ({c.poll()})" for c in children.exited()))
        print(f"{what}: stopping ({why}): {signal.Signals(stop_signal).name} to "
              f"{', '.join(c.name for c in children.alive()) or 'none left'}; each has {grace_s:g} s to stop, "
              f"then it is killed", flush=True)
        codes = children.stop(stop_signal)
        for name in children.killed:
            print(f"{what}: {name} did not stop within {grace_s:g} s of {signal.Signals(stop_signal).name}; killed "
                  f"(SIGKILL) with its process group and everything it started; see its log for what it was "
                  f"doing", file=sys.stderr, flush=True)
        return codes

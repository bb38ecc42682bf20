"""What the local services started from a cached download share: a state file, a log, a start that waits.

:class:`LocalService` is the base of ``LocalKafka`` (broker), ``LocalRegistry`` (Apicurio) and ``LocalAzurite``:
each runs one detached process bound to 127.0.0.1 with its state file (``{"pid", "started", ...}``) and log
in ``data_dir``. The pid recorded there is trusted only while it still is that service
(:func:`flowtrain.local.processes.same_process`, with the service's ``_marker``: what its command line holds).
A subclass sets ``prefix`` (its message prefix), ``noun`` (what it calls the process), ``state_file``,
``log_file``, ``error`` (its exception class), ``what``/``not_ready``/``start_timeout_s`` (its start's words and
bound) and defines ``_marker``. :meth:`LocalService.start` is the one start of them all, a template: already
running, its status; else its ports checked (``_ports``: each must be free), the preparation (``_prepare``: its
tools, downloads, the data directory, its configuration; the command line and what the state file records),
the launch (:meth:`LocalService._launch`), the wait (:meth:`LocalService._wait_ready` on ``_ready``), one line
(``_started``) and its ``status()`` with ``start_seconds``. Its ``stop`` calls :meth:`LocalService._stop_recorded`.
A service of several processes (``LocalKafkaCluster``, ``LocalFlink``) starts its own way on the same parts.
"""
from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from flowtrain.local.processes import describe, identity, same_process, stop_recorded
from flowtrain.local.tools import java_major, port_open, require_tool

__all__ = ["LocalService"]


class LocalService:
    """A detached local process with its state file and log in ``data_dir`` (see the module doc)."""

    prefix: str = "service"
    noun: str = "service"
    state_file: str = "service.json"
    log_file: str = "service.log"
    error: type[Exception] = RuntimeError
    data_dir: Path

    def __post_init__(self) -> None:  # called by each subclass's dataclass __init__
        self.data_dir = Path(self.data_dir).expanduser().resolve()

    @property
    def _marker(self) -> str:
        raise NotImplementedError

    @property
    def log_path(self) -> Path:
        return self.data_dir / self.log_file

    @property
    def _state_path(self) -> Path:
        return self.data_dir / self.state_file

    def _read_state(self) -> dict | None:
        try:
            return json.loads(self._state_path.read_text())
        except (OSError, ValueError):
            return None

    def running_pid(self) -> int | None:
        """The pid of this data directory's service, if the recorded process still is that service."""
        state = self._read_state()
        if state and same_process(state, self._marker):
            return int(state["pid"])
        return None

    # -- the start, a template -----------------------------------------------------------------------------
    what: str = "the service"  # in "<what> exited with code N during start", "<what> <not_ready> within T s"
    not_ready: str = "did not answer"
    start_timeout_s: float = 60.0  # the start's bound when the caller gives none
    poll_s: float = 0.3  # how often the start asks whether the process is ready

    def start(self, *, timeout_s: float | None = None, quiet: bool = False) -> dict:
        """Start the service unless it runs already (idempotent); return its ``status()``, with ``start_seconds``
        when this call started it. A failed start raises ``error`` with the log's tail (the process stopped)."""
        pid = self.running_pid()
        if pid is not None:
            if not quiet:
                print(f"{self.prefix}: already running (pid {pid}) {self._where}; log {self.log_path}")
            return self.status()
        for port in self._ports:
            if port_open(port):
                raise self.error(f"port {port} on 127.0.0.1 is taken by another process; choose another with --port")
        t0 = time.monotonic()
        cmd, record = self._prepare(quiet)
        proc = self._launch(cmd, record)
        took = self._wait_ready(proc, self._ready, what=self.what, not_ready=self.not_ready, t0=t0,
                                timeout_s=self.start_timeout_s if timeout_s is None else timeout_s, poll_s=self.poll_s)
        if not quiet:
            print(f"{self.prefix}: {self._started(proc.pid, took)}; log {self.log_path}", flush=True)
        return self.status() | {"start_seconds": took}

    def status(self) -> dict:
        raise NotImplementedError

    @property
    def _where(self) -> str:
        """Where it answers, as its lines say it ("on 127.0.0.1:9092", "at http://...")."""
        raise NotImplementedError

    @property
    def _ports(self) -> tuple[int, ...]:
        """The ports on 127.0.0.1 it binds: each must be free before it starts."""
        raise NotImplementedError

    def _prepare(self, quiet: bool) -> tuple[list[str], dict]:
        """Its download, data directory and configuration: ``(the command line, what the state file records)``."""
        raise NotImplementedError

    def _ready(self) -> bool:
        raise NotImplementedError

    def _started(self, pid: int, took: float) -> str:
        """The line a start says, after the prefix (the log's path follows it)."""
        raise NotImplementedError

    def _java(self, minimum: int = 17) -> str:
        """The ``java`` to run it with (a Java ``minimum``+ runtime), else ``error`` saying how to get one."""
        java = require_tool("java", f"to run {self.what}", f"Install a Java {minimum}+ runtime (Debian: `apt-get "
                            f"install openjdk-{minimum}-jre-headless`).", self.error)
        if java_major(java) < minimum:
            raise self.error(f"{self.what} needs Java {minimum} or newer; `java -version` reports an older one. "
                             f"Install Java {minimum}+ and put it first on PATH (or set JAVA_HOME).")
        return java

    def _launch(self, cmd: Sequence[str], record: Mapping) -> subprocess.Popen:
        """Start ``cmd`` detached (its own session, output appended to the log, cwd ``data_dir``) and write the
        state file: its identity, ``record``, the start time."""
        log = open(self.log_path, "ab")
        proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=self.data_dir)
        log.close()
        self._state_path.write_text(json.dumps({**identity(proc.pid), **record, "started_at": time.time()}))
        return proc

    def _wait_ready(self, proc: subprocess.Popen, ready: Callable[[], bool], *, what: str, not_ready: str,
                    t0: float, timeout_s: float, poll_s: float) -> float:
        """Wait until ``ready()``; return the seconds since ``t0``. A process that exits meanwhile raises
        ``error``; one not ready within ``timeout_s`` is stopped, then ``error`` is raised ("``what`` ``not_ready``
        within ... s"), each with the log's tail."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise self.error(f"{what} exited with code {proc.returncode} during start; see {self.log_path}:\n"
                                 f"{self._log_tail()}")
            if ready():
                return time.monotonic() - t0
            time.sleep(poll_s)
        self.stop(quiet=True)
        raise self.error(f"{what} {not_ready} within {timeout_s:.0f} s; see {self.log_path}:\n{self._log_tail()}")

    def stop(self, *, timeout_s: float = 30.0, quiet: bool = False) -> bool:
        raise NotImplementedError

    def _stop_recorded(self, timeout_s: float, quiet: bool) -> dict | None:
        """SIGTERM the recorded process while it still is this service, SIGKILL after ``timeout_s``; return its
        record, or None (saying why unless ``quiet``) when none ran."""
        state = self._read_state()
        if not state or self.running_pid() is None:
            if not quiet:
                if state and state.get("pid") is not None:
                    print(f"{self.prefix}: the {self.noun} recorded in {self._state_path} (pid {state['pid']}) is "
                          f"not running; nothing stopped ({describe(int(state['pid']))})")
                else:
                    print(f"{self.prefix}: no {self.noun} running for {self.data_dir}")
            return None
        stop_recorded([state], sig=signal.SIGTERM, grace_s=timeout_s, marker=self._marker)
        return state

    def _log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

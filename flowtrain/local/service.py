"""What the local services started from a cached download share: a state file, a log, a start that waits.

:class:`LocalService` is the base of ``LocalKafka`` (broker), ``LocalRegistry`` (Apicurio) and ``LocalAzurite``:
each runs one detached process bound to 127.0.0.1 with its state file (``{"pid", "started", ...}``) and log
in ``data_dir``. The pid recorded there is trusted only while it still is that service
(:func:`flowtrain.local.processes.same_process`, with the service's ``_marker``: what its command line holds).
A subclass sets ``prefix`` (its message prefix), ``noun`` (what it calls the process), ``state_file``,
``log_file`` and ``error`` (its exception class) and defines ``_marker``; its ``start`` launches with
:meth:`LocalService._launch` and waits with :meth:`LocalService._wait_ready`, its ``stop`` calls
:meth:`LocalService._stop_recorded`.
"""
from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from flowtrain.local.processes import describe, identity, same_process, stop_recorded

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

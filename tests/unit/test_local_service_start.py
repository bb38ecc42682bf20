"""Issue 48 item 5: one ``LocalService.start()`` template for the local services (Kafka's broker, Apicurio, Azurite),
run here on a service of a few lines: a Python process that listens on a port. Its start waits until it is ready and
says so; a second start finds it running; a taken port, a process that exits during its start and one that never
gets ready are errors naming the log (the last one stopped); its stop stops it."""
from __future__ import annotations

import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from flowtrain.local.service import LocalService
from flowtrain.local.tools import free_port, port_open

LISTEN = ("import socket, sys, time\n"
          "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
          "s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen()\n"
          "print('listening', flush=True)\n"
          "time.sleep(120)\n")


class ToyError(RuntimeError):
    pass


@dataclass
class ToyService(LocalService):
    prefix = "toy"
    noun = "toy"
    state_file = "toy.json"
    log_file = "toy.log"
    error = ToyError
    what = "the toy"
    not_ready = "did not listen"
    poll_s = 0.05

    port: int = 0
    data_dir: Path = field(default_factory=Path)
    script: str = LISTEN

    @property
    def _marker(self) -> str:
        return f"toy-{self.port}"

    def status(self) -> dict:
        pid = self.running_pid()
        return {"running": pid is not None, "pid": pid, "port": self.port}

    @property
    def _where(self) -> str:
        return f"on 127.0.0.1:{self.port}"

    @property
    def _ports(self) -> tuple[int, ...]:
        return (self.port,)

    def _prepare(self, quiet: bool) -> tuple[list[str], dict]:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        return [sys.executable, "-c", self.script, str(self.port), self._marker], {"port": self.port}

    def _ready(self) -> bool:
        return port_open(self.port)

    def _started(self, pid: int, took: float) -> str:
        return f"listening on 127.0.0.1:{self.port} (pid {pid}, {took:.1f} s)"

    def stop(self, *, timeout_s: float = 5.0, quiet: bool = True) -> bool:
        return self._stop_recorded(timeout_s, quiet) is not None


@pytest.mark.timeout(60)
def test_the_start_template_starts_waits_finds_it_running_and_stops_it(tmp_path, capsys):
    toy = ToyService(port=free_port(), data_dir=tmp_path / "toy")
    try:
        status = toy.start()
        assert status["running"] and status["pid"] and status["start_seconds"] >= 0, status
        assert port_open(toy.port)
        out = capsys.readouterr().out
        assert f"toy: listening on 127.0.0.1:{toy.port} (pid {status['pid']}" in out and str(toy.log_path) in out
        again = toy.start()  # idempotent: the same process, no second one
        assert again["pid"] == status["pid"] and "start_seconds" not in again, again
        assert f"toy: already running (pid {status['pid']}) on 127.0.0.1:{toy.port}" in capsys.readouterr().out
    finally:
        assert toy.stop()
    assert toy.running_pid() is None and not toy.stop()


@pytest.mark.timeout(60)
def test_the_start_template_refuses_a_taken_port_and_names_the_log_of_a_failed_start(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        toy = ToyService(port=taken.getsockname()[1], data_dir=tmp_path / "taken")
        with pytest.raises(ToyError, match=f"port {toy.port} on 127.0.0.1 is taken by another process"):
            toy.start(quiet=True)
        assert not (tmp_path / "taken").exists()  # refused before anything was written

    dies = ToyService(port=free_port(), data_dir=tmp_path / "dies", script="print('no such thing'); raise SystemExit(4)")
    with pytest.raises(ToyError, match=r"the toy exited with code 4 during start; see .*toy.log:\nno such thing"):
        dies.start(quiet=True)

    idle = ToyService(port=free_port(), data_dir=tmp_path / "idle", script="import time; time.sleep(60)")
    with pytest.raises(ToyError, match=r"the toy did not listen within 1 s; see .*toy.log"):
        idle.start(timeout_s=1.0, quiet=True)
    assert idle.running_pid() is None  # stopped, not left behind

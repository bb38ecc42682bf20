"""The project's local Schema Registry: Apicurio Registry (Apache 2.0) from Maven Central, in-memory storage.

``ensure_registry()`` resolves ``io.apicurio:apicurio-registry-app:<version>:tar.gz:all`` with ``mvn`` once per
machine and unpacks it into ``<cache>/apicurio/<version>``; ``LocalRegistry(port).start()`` runs it as a
detached ``java`` process bound to 127.0.0.1 (HTTP, and the Quarkus management interface, which is also
turned off), leaving ``registry.json`` in its data directory for ``status`` and ``stop`` (the pid is trusted
only while it still is that registry: ``flowtrain.local.processes.same_process``); ``LocalRegistry.of(data_dir)``
is the registry that file records, on its port. The Confluent-compatible
API is at ``http://127.0.0.1:PORT/apis/ccompat/v7`` (``LocalRegistry.url``). Storage is in memory: a
restart forgets every schema.
"""
from __future__ import annotations

import shutil
import subprocess
import tarfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from flowtrain.local.paths import cache_root
from flowtrain.local.service import LocalService
from flowtrain.local.tools import port_open, require_tool

APICURIO_VERSION = "3.0.9"
#: Where the Confluent-compatible API is, under the registry's root.
CCOMPAT_PATH = "/apis/ccompat/v7"

__all__ = ["APICURIO_VERSION", "CCOMPAT_PATH", "LocalRegistry", "RegistryError", "ensure_registry"]


class RegistryError(RuntimeError):
    """The registry could not be provisioned, started or stopped; the message says what to do."""


def ensure_registry(version: str = APICURIO_VERSION, *, quiet: bool = False) -> Path:
    """Resolve and unpack the registry once per machine; return its directory (holding the runner jar)."""
    home = cache_root() / "apicurio" / version
    if (home / ".complete").exists():
        return home
    mvn = require_tool("mvn", "to fetch Apicurio Registry from Maven Central",
                       "Install Apache Maven 3.8+ (Debian: `apt-get install maven`).", RegistryError)
    partial = home.with_name(f"{version}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    if not quiet:
        print(f"registry: first use on this machine: resolving io.apicurio:apicurio-registry-app:{version} (tar.gz, "
              f"~110 MB) from Maven Central into {home} (once)", flush=True)
    t0 = time.monotonic()
    proc = subprocess.run([mvn, "-B", "-q", "dependency:copy",
                           f"-Dartifact=io.apicurio:apicurio-registry-app:{version}:tar.gz:all",
                           f"-DoutputDirectory={partial}"], capture_output=True, text=True, timeout=900, cwd=partial)
    archive = partial / f"apicurio-registry-app-{version}-all.tar.gz"
    if proc.returncode != 0 or not archive.exists():
        raise RegistryError(f"mvn could not resolve Apicurio Registry {version}:\n{proc.stdout[-2000:]}"
                            f"{proc.stderr[-2000:]}")
    with tarfile.open(archive) as tar:
        tar.extractall(partial, filter="data")
    archive.unlink()
    shutil.rmtree(home, ignore_errors=True)
    partial.rename(home)
    (home / ".complete").write_text(version)
    if not quiet:
        print(f"registry: Apicurio Registry {version} ready in {time.monotonic() - t0:.0f} s", flush=True)
    return home


@dataclass
class LocalRegistry(LocalService):
    """One Apicurio Registry on 127.0.0.1:``port``, its state file and log in ``data_dir``."""

    prefix = "registry"
    noun = "registry"
    state_file = "registry.json"
    log_file = "registry.log"
    error = RegistryError
    what = "Apicurio Registry"
    start_timeout_s = 120.0

    port: int = 8081
    data_dir: Path = field(default_factory=lambda: cache_root() / "registry-data")
    version: str = APICURIO_VERSION
    heap: str = "256m"

    @classmethod
    def of(cls, data_dir: Path | None = None, port: int | None = None) -> LocalRegistry:
        """The registry of ``data_dir`` (default: the cache's): on ``port`` when given, else on the port its
        ``registry.json`` records (the one started there: what ``stop`` and ``status`` are about), else 8081."""
        reg = cls(**({"data_dir": Path(data_dir)} if data_dir is not None else {}))
        if port is None:
            recorded = (reg._read_state() or {}).get("port")
            port = recorded if isinstance(recorded, int) and not isinstance(recorded, bool) else cls.port
        reg.port = int(port)
        return reg

    @property
    def url(self) -> str:
        """The Confluent-compatible API (what ``--schema-registry`` takes)."""
        return f"http://127.0.0.1:{self.port}{CCOMPAT_PATH}"

    @property
    def _marker(self) -> str:
        """What this registry's command line holds: its own port setting."""
        return f"-Dquarkus.http.port={self.port}"

    def answers(self, timeout_s: float = 3.0) -> bool:
        """Whether the Confluent-compatible API answers (``GET /subjects``)."""
        try:
            with urllib.request.urlopen(f"{self.url}/subjects", timeout=timeout_s) as resp:
                return resp.status == 200
        except Exception:  # noqa: BLE001 - any failure means "not ready"
            return False

    def status(self) -> dict:
        pid = self.running_pid()
        return {"running": pid is not None, "pid": pid, "url": self.url, "data_dir": str(self.data_dir),
                "log": str(self.log_path), "version": self.version, "answers": bool(pid) and self.answers()}

    @property
    def _where(self) -> str:
        return f"at {self.url}"

    @property
    def _ports(self) -> tuple[int, ...]:
        return (self.port,)

    def _prepare(self, quiet: bool) -> tuple[list[str], dict]:
        java = self._java()
        home = ensure_registry(self.version, quiet=quiet)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cmd = [java, f"-Xmx{self.heap}", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-Djava.awt.headless=true",
               "-Dquarkus.http.host=127.0.0.1", self._marker,
               "-Dquarkus.management.enabled=false", "-Dquarkus.management.host=127.0.0.1",
               "-Dquarkus.log.level=WARN",
               "-jar", str(home / f"apicurio-registry-app-{self.version}-runner.jar")]
        return cmd, {"url": self.url, "port": self.port, "version": self.version, "log": str(self.log_path)}

    def _ready(self) -> bool:
        return port_open(self.port) and self.answers()

    def _started(self, pid: int, took: float) -> str:
        return f"Apicurio Registry {self.version} at {self.url} (pid {pid}, {took:.1f} s, in-memory storage)"

    def stop(self, *, timeout_s: float = 20.0, quiet: bool = False) -> bool:
        """Stop the registry (SIGTERM, then SIGKILL after ``timeout_s``); False if none ran."""
        state = self._stop_recorded(timeout_s, quiet)
        if state is not None and not quiet:
            print(f"registry: stopped pid {state['pid']} at {self.url}")
        return state is not None

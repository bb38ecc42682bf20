"""A local object store: Azurite (Microsoft's Azure Storage server, MIT, on npm), its blob service only.

``ensure_azurite()`` installs ``azurite@<version>`` with ``npm`` once per machine into
``<cache>/azurite/<version>``; ``LocalAzurite(port).start()`` runs ``azurite-blob`` as a detached process bound to
127.0.0.1, its blobs in ``data_dir``, leaving ``azurite.json`` there for ``stop`` (the pid is trusted only while it
still is that server: ``flowtrain.local.processes.same_process``). Clients use the well-known development
account (``DEV_ACCOUNT``, ``DEV_KEY``: public, documented by Microsoft, for local emulators only) through
``LocalAzurite.connection_string`` (what ``$AZURE_STORAGE_CONNECTION_STRING`` takes for adlfs's ``az://``).
"""
from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from flowtrain.local.paths import cache_root
from flowtrain.local.service import LocalService
from flowtrain.local.tools import free_port, port_open, require_tool

AZURITE_VERSION = "3.37.0"
#: Azurite's development account and key: public constants of the emulator, not secrets.
DEV_ACCOUNT = "devstoreaccount1"
DEV_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="

__all__ = ["AZURITE_VERSION", "DEV_ACCOUNT", "DEV_KEY", "AzuriteError", "LocalAzurite", "ensure_azurite",
           "free_port"]


class AzuriteError(RuntimeError):
    """Azurite could not be provisioned, started or stopped; the message says what to do."""


def ensure_azurite(version: str = AZURITE_VERSION, *, quiet: bool = False) -> Path:
    """Install Azurite with npm once per machine; return the path of its ``azurite-blob`` script."""
    home = cache_root() / "azurite" / version
    script = home / "node_modules" / ".bin" / "azurite-blob"
    if (home / ".complete").exists() and script.exists():
        return script
    npm = require_tool("npm", "to install Azurite (the local object store of the tests)",
                       "Install Node.js 18+ with npm (Debian: `apt-get install nodejs npm`).", AzuriteError)
    partial = home.with_name(f"{version}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    if not quiet:
        print(f"azurite: first use on this machine: npm install azurite@{version} into {home} (once)", flush=True)
    t0 = time.monotonic()
    proc = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--loglevel=error", "--prefix", str(partial),
                           f"azurite@{version}"], capture_output=True, text=True, timeout=900, cwd=partial)
    if proc.returncode != 0 or not (partial / "node_modules" / ".bin" / "azurite-blob").exists():
        shutil.rmtree(partial, ignore_errors=True)
        raise AzuriteError(f"npm could not install azurite@{version}:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    shutil.rmtree(home, ignore_errors=True)
    partial.rename(home)  # npm's .bin links are relative: they survive the rename
    (home / ".complete").write_text(version)
    if not quiet:
        print(f"azurite: Azurite {version} ready in {time.monotonic() - t0:.0f} s", flush=True)
    return script


@dataclass
class LocalAzurite(LocalService):
    """One Azurite blob service on 127.0.0.1:``port``, its blobs, state file and log in ``data_dir``."""

    prefix = "azurite"
    noun = "blob service"
    state_file = "azurite.json"
    log_file = "azurite.log"
    error = AzuriteError
    what = "Azurite"
    poll_s = 0.2

    port: int = 10000
    data_dir: Path = field(default_factory=lambda: cache_root() / "azurite-data")
    version: str = AZURITE_VERSION

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/{DEV_ACCOUNT}"

    @property
    def connection_string(self) -> str:
        """For ``$AZURE_STORAGE_CONNECTION_STRING`` (adlfs, azure-storage-blob)."""
        return (f"DefaultEndpointsProtocol=http;AccountName={DEV_ACCOUNT};AccountKey={DEV_KEY};"
                f"BlobEndpoint={self.endpoint};")

    @property
    def _marker(self) -> str:
        return str(self.data_dir / "blobs")

    def status(self) -> dict:
        pid = self.running_pid()
        return {"running": pid is not None, "pid": pid, "endpoint": self.endpoint, "data_dir": str(self.data_dir),
                "log": str(self.log_path), "version": self.version}

    @property
    def not_ready(self) -> str:
        return f"did not listen on 127.0.0.1:{self.port}"

    @property
    def _where(self) -> str:
        return f"at {self.endpoint}"

    @property
    def _ports(self) -> tuple[int, ...]:
        return (self.port,)

    def _prepare(self, quiet: bool) -> tuple[list[str], dict]:
        script = ensure_azurite(self.version, quiet=quiet)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        (self.data_dir / "blobs").mkdir(exist_ok=True)
        cmd = [str(script), "--blobHost", "127.0.0.1", "--blobPort", str(self.port), "--location",
               self._marker, "--skipApiVersionCheck", "--loose", "--silent"]
        return cmd, {"port": self.port, "version": self.version}

    def _ready(self) -> bool:
        return port_open(self.port)

    def _started(self, pid: int, took: float) -> str:
        return f"blob service at {self.endpoint} (pid {pid}, {took:.1f} s)"

    def stop(self, *, timeout_s: float = 5.0, quiet: bool = True) -> bool:
        """Stop the blob service (SIGTERM to its process group, SIGKILL after ``timeout_s``: Azurite waits for its
        clients' keep-alive connections to close); False if none ran (said only when not ``quiet``)."""
        return self._stop_recorded(timeout_s, quiet) is not None

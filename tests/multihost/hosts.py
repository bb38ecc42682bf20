"""Hosts on a private LAN, made of Linux network namespaces, for tests that need more than one machine.

``HostLAN(n)`` makes ``n`` namespaces ``ft-<id>-host<K>`` (K = 0..n-1), each with a veth ``eth0`` holding
``10.<a>.<b>.<K + 2>/24`` (a /24 no route of this machine uses) and ``lo``, the other ends of the veths on one
bridge ``ft<id>``: hosts on a switch that reach each other and nothing else. The filesystem and the process
table stay shared, so a tmp directory is the "shared filesystem" every host sees. Commands run inside a host
with ``ip netns exec``.

Teardown (``close``) is idempotent and always complete: every process in each namespace is killed first,
then ``ip netns del``, then ``ip link del`` of the bridge and the veths. ``<id>`` is unique per run (so
parallel runs do not collide) and every name stays within Linux's 15-character interface limit. A run that
was SIGKILLed cannot clean up after itself: ``remove_stale`` (called by every new ``HostLAN``) removes the
namespaces and links of runs whose creating process is gone, found through their marker files.
"""
from __future__ import annotations

import ipaddress
import json
import os
import random
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

MARKERS = Path("/run/flowtrain-multihost")  # one JSON file per live LAN: who made it, what it holds


class HostsUnavailable(RuntimeError):
    """Network namespaces cannot be made here; the message says why in one line."""


def _ip(*args: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=timeout)


def why_unavailable() -> str | None:
    """None when this process can make network namespaces, else one line saying why not."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed: apt-get install iproute2"
    name = f"ft-probe-{uuid.uuid4().hex[:6]}"
    proc = _ip("netns", "add", name, check=False)
    if proc.returncode != 0:
        detail = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        return f"cannot create a network namespace (needs root or CAP_NET_ADMIN/CAP_SYS_ADMIN): ip netns add: {detail}"
    _ip("netns", "del", name, check=False)
    return None


def _used_networks() -> list[ipaddress.IPv4Network]:
    nets = []
    for line in _ip("-4", "route", "show", "table", "all", check=False).stdout.splitlines():
        word = line.split()[0] if line.split() else ""
        try:
            nets.append(ipaddress.ip_network(word, strict=False))
        except ValueError:
            continue
    return nets


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_pids(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


class HostLAN:
    """``n`` namespace hosts on one bridge; ``close()`` (or the context manager) removes everything."""

    def __init__(self, n: int, *, run_id: str | None = None):
        if n < 1 or n > 200:
            raise ValueError(f"HostLAN: n must be 1..200, got {n}")
        self.n = n
        self.id = run_id or uuid.uuid4().hex[:6]
        self.bridge = f"ft{self.id}"
        self.names = [f"ft-{self.id}-host{k}" for k in range(n)]
        self.veths = [f"ft{self.id}h{k}" for k in range(n)]
        assert all(len(v) <= 15 for v in [self.bridge, *self.veths]), "interface names exceed 15 chars"
        self.network = self._pick_network()
        self.addresses = [str(self.network.network_address + 2 + k) for k in range(n)]
        self._procs: list[subprocess.Popen] = []
        self._closed = False
        self._marker = MARKERS / f"{self.id}.json"

    # -- making ---------------------------------------------------------------------------
    @staticmethod
    def _pick_network() -> ipaddress.IPv4Network:
        used = _used_networks()
        markers = MARKERS.glob("*.json") if MARKERS.exists() else []
        taken = {json.loads(p.read_text()).get("network") for p in markers}
        for _ in range(200):
            net = ipaddress.ip_network(f"10.{random.randrange(64, 250)}.{random.randrange(1, 255)}.0/24")
            if str(net) not in taken and not any(net.overlaps(u) for u in used):
                return net
        raise HostsUnavailable("no free private /24 under 10.0.0.0/8 for the test hosts")

    def start(self) -> HostLAN:
        remove_stale()
        MARKERS.mkdir(parents=True, exist_ok=True)
        self._marker.write_text(json.dumps({"pid": os.getpid(), "bridge": self.bridge, "names": self.names,
                                            "veths": self.veths, "network": str(self.network)}))
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for name, veth, addr in zip(self.names, self.veths, self.addresses):
                _ip("netns", "add", name)
                _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name)
                _ip("link", "set", veth, "master", self.bridge)
                _ip("link", "set", veth, "up")
                _ip("-n", name, "addr", "add", f"{addr}/{self.network.prefixlen}", "dev", "eth0")
                _ip("-n", name, "link", "set", "eth0", "up")
                _ip("-n", name, "link", "set", "lo", "up")
        except subprocess.CalledProcessError as err:
            self.close()
            raise HostsUnavailable(f"making the test hosts failed: {' '.join(err.cmd)}: {err.stderr.strip()}") from err
        return self

    def __enter__(self) -> HostLAN:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- running --------------------------------------------------------------------------
    def command(self, k: int, argv: list[str]) -> list[str]:
        """``argv`` as run on host ``k``."""
        return ["ip", "netns", "exec", self.names[k], *argv]

    def popen(self, k: int, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` on host ``k`` in its own session (``close`` kills it with the host)."""
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.command(k, argv), **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, k: int, argv: list[str], *, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.command(k, argv), timeout=timeout, **kwargs)

    def pids(self, k: int) -> list[int]:
        """Every process whose network namespace is host ``k``'s."""
        out = _ip("netns", "pids", self.names[k], check=False).stdout
        return [int(p) for p in out.split() if p.isdigit()]

    def kill_host(self, k: int, sig: int = signal.SIGKILL, timeout: float = 20) -> list[int]:
        """Kill every process of host ``k`` (as a machine losing power would); returns the pids killed."""
        killed: list[int] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pids = self.pids(k)
            if not pids:
                break
            killed += [p for p in pids if p not in killed]
            _kill_pids(pids, sig)
            for proc in self._procs:  # reap our own children so they do not linger as zombies
                if proc.poll() is None:
                    try:
                        proc.wait(timeout=0.05)
                    except subprocess.TimeoutExpired:
                        pass
            time.sleep(0.1)
        return killed

    def listening(self, k: int) -> list[tuple[str, int, str]]:
        """(local address, port, process) of the TCP sockets listening on host ``k`` (``ss -tlnp``)."""
        return _ss(self.run(k, ["ss", "-H", "-tlnp"]).stdout)

    def connected(self, k: int) -> list[tuple[str, int, str, int, str]]:
        """(local address, local port, peer address, peer port, process) of host ``k``'s established TCP sockets."""
        rows = []
        for line in self.run(k, ["ss", "-H", "-tnp", "state", "established"]).stdout.splitlines():
            parts = line.split()
            if len(parts) < 4:
                continue
            local, peer = parts[2], parts[3]
            (la, lp), (pa, pp) = local.rsplit(":", 1), peer.rsplit(":", 1)
            rows.append((la.strip("[]"), int(lp), pa.strip("[]"), int(pp), " ".join(parts[4:])))
        return rows

    # -- teardown -------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _remove(self.names, self.veths, self.bridge)
        for proc in self._procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self._marker.unlink(missing_ok=True)


def _ss(text: str) -> list[tuple[str, int, str]]:
    rows = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        addr, port = parts[3].rsplit(":", 1)
        rows.append((addr.strip("[]"), int(port), " ".join(parts[5:])))
    return rows


def _remove(names: list[str], veths: list[str], bridge: str) -> None:
    """Kill each namespace's processes (SIGKILL, until none is left), then delete namespaces and links."""
    existing = set(_ip("netns", "list", check=False).stdout.split())
    for name in names:
        if name not in existing:
            continue
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            pids = [int(p) for p in _ip("netns", "pids", name, check=False).stdout.split() if p.isdigit()]
            pids = [p for p in pids if p != os.getpid()]
            if not pids:
                break
            _kill_pids(pids, signal.SIGKILL)
            time.sleep(0.1)
        _ip("netns", "del", name, check=False)
    for link in [*veths, bridge]:
        _ip("link", "del", link, check=False)


def remove_stale() -> list[str]:
    """Remove the hosts of earlier runs whose creating process is gone (a SIGKILLed pytest); returns their ids."""
    removed = []
    if not MARKERS.exists():
        return removed
    for marker in MARKERS.glob("*.json"):
        try:
            state = json.loads(marker.read_text())
        except (OSError, ValueError):
            continue
        if _pid_alive(int(state["pid"])):
            continue
        _remove(state["names"], state["veths"], state["bridge"])
        marker.unlink(missing_ok=True)
        removed.append(marker.stem)
    return removed


if __name__ == "__main__":  # the make test-multihost preflight: one line and exit 1 where hosts cannot be made
    import sys

    reason = why_unavailable()
    if reason is not None:
        print(f"make test-multihost: {reason}", file=sys.stderr)
        sys.exit(1)

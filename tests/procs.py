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


def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def descendants(pid: int) -> dict[int, str]:
    """{pid: start time} of every live process below ``pid`` (children, their children, ...)."""
    parent_of, started = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields and fields[0] not in ("Z", "X"):
                parent_of[int(entry.name)] = int(fields[1])
                started[int(entry.name)] = fields[19]
    found, frontier = {}, [pid]
    while frontier:
        current = frontier.pop()
        for child, parent in parent_of.items():
            if parent == current and child not in found:
                found[child] = started[child]
                frontier.append(child)
    return found


def still_running(processes: dict[int, str]) -> dict[int, str]:
    """The entries of ``{pid: start time}`` that still run as the same process (not zombies), with their
    command lines."""
    left = {}
    for pid, started in processes.items():
        fields = _stat(pid)
        if fields and fields[0] not in ("Z", "X") and fields[19] == started:
            try:
                left[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                left[pid] = "?"
    return left


def kill_tree(proc: subprocess.Popen, tree: dict[int, str]) -> None:
    """SIGKILL what still runs of ``tree`` (``{pid: start time}``, from :func:`descendants`) and the process group
    of ``proc`` (started with ``start_new_session=True``), then reap ``proc``."""
    for pid in still_running(tree):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def _address(hex_addr: str) -> tuple[str, int]:
    import ipaddress

    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    # /proc/net/tcp{,6} print each 32-bit word of the address in host (little-endian) byte order
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words)), int(port, 16)


def listening_sockets(pids) -> dict[int, list[tuple[str, int]]]:
    """{pid: [(address, port), ...]} of the TCP sockets in state LISTEN that each process holds."""
    listening = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A":
                listening[cols[9]] = _address(cols[1])
    held: dict[int, list[tuple[str, int]]] = {}
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in listening:
                held.setdefault(pid, []).append(listening[target[8:-1]])
    return held


def is_loopback(address: str) -> bool:
    import ipaddress

    ip = ipaddress.ip_address(address)
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback

"""What the local Flink cluster's processes listen on (Linux ``/proc``) and this machine's network interfaces:
``start`` refuses a process that listens on every interface, ``status`` shows the listeners."""
from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path


def _proc_address(hex_addr: str) -> tuple[str, int]:
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    # /proc/net/tcp{,6} print each 32-bit word of the address in host (little-endian) byte order
    ip = ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), int(port, 16)


def listening(pids) -> dict[int, list[tuple[str, int]]]:
    """{pid: [(address, port), ...]}: the TCP sockets in state LISTEN each of ``pids`` holds (Linux /proc)."""
    inodes = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if cols[3] == "0A":
                inodes[cols[9]] = _proc_address(cols[1])
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
            if target.startswith("socket:[") and target[8:-1] in inodes:
                held.setdefault(pid, []).append(inodes[target[8:-1]])
    return held


def network_interfaces() -> list[str]:
    """This machine's network interfaces other than loopback (``lo``)."""
    try:
        return [name for _, name in socket.if_nameindex() if name != "lo"]
    except OSError:
        return []

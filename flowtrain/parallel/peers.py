"""Which address a worker talks on across machines, and which rank a lost peer was.

Under torchrun on several machines, gloo binds the address the machine's *hostname* resolves to
unless ``GLOO_SOCKET_IFNAME`` names an interface; where the hostname maps to 127.0.0.1 (common in
/etc/hosts, containers and namespaces) gloo falls back to loopback and the peers on the other
machines can never connect to it. ``use_route_to_master`` picks the interface this machine uses
to reach ``MASTER_ADDR`` (the one address every node must reach anyway) unless the user named
one, so gloo and NCCL bind this host's own address, never 0.0.0.0 or 127.0.0.1.

``exchange`` records every rank's host and address once the group is up; ``lost_peers`` reads
a collective's error (gloo names the peer's address: "Connection closed by peer [10.0.0.3]:...")
and names the ranks on that host, so a dead machine is reported as "lost rank 1 on host ...".
"""
from __future__ import annotations

import ipaddress
import os
import re
import socket

_table: list[dict] = []  # [{"rank": r, "host": hostname, "address": a}] in rank order, once exchanged


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def route_source(destination: str) -> str | None:
    """The local IPv4 address this machine sends from to reach ``destination`` (no packet is sent)."""
    try:
        target = socket.getaddrinfo(destination, None, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((target, 9))
            return sock.getsockname()[0]
    except OSError:
        return None


def interface_of(address: str) -> str | None:
    """The name of the interface holding IPv4 ``address`` (Linux ``SIOCGIFADDR``), or None."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) == address:
                return name
    return None


def use_route_to_master() -> str | None:
    """Point gloo (and NCCL) at the interface that reaches ``MASTER_ADDR``, unless the user chose one
    or the job is on one machine (loopback master). Returns the interface set, or None."""
    master = os.environ.get("MASTER_ADDR", "")
    if not master or _is_loopback(master) or os.environ.get("GLOO_SOCKET_IFNAME"):
        return None
    source = route_source(master)
    name = interface_of(source) if source else None
    if name is None or _is_loopback(source):
        return None
    os.environ["GLOO_SOCKET_IFNAME"] = name
    os.environ.setdefault("NCCL_SOCKET_IFNAME", name)
    return name


def exchange() -> list[dict]:
    """Every rank's hostname and address (the source address towards ``MASTER_ADDR``), in rank order."""
    from flowtrain.parallel import gather_json

    global _table
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    if _is_loopback(master):  # one machine: every rank has the same address, nothing to tell apart
        return []
    me = {"host": socket.gethostname(), "address": route_source(master) or master}
    _table = [dict(entry, rank=rank) for rank, entry in enumerate(gather_json(me))]
    return _table


def lost_peers(error: BaseException | str) -> str | None:
    """"rank 1 on host vm (10.0.0.3)" for the peers whose address the error names; None when it
    names none this worker knows (or every rank shares the address, as on one machine)."""
    text = str(error)
    named = set(re.findall(r"\[?(?:::ffff:)?(\d{1,3}(?:\.\d{1,3}){3})\]?:\d+", text))
    me = os.environ.get("RANK")
    hits = [e for e in _table if e["address"] in named and str(e["rank"]) != me]
    if not hits or len(hits) == len(_table) - 1 and len({e["address"] for e in _table}) == 1:
        return None
    ranks = ", ".join(str(e["rank"]) for e in hits)
    hosts = ", ".join(sorted({f"{e['host']} ({e['address']})" for e in hits}))
    return f"rank{'s' if len(hits) > 1 else ''} {ranks} on host {hosts}"

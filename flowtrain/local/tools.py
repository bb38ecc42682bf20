"""What the local services (Kafka broker, Flink cluster) need from the machine: tools on PATH,
the Java version, TCP ports on 127.0.0.1."""
from __future__ import annotations

import random
import shutil
import socket
import subprocess


def require_tool(name: str, purpose: str, hint: str, error: type[Exception] = RuntimeError) -> str:
    """The path of ``name`` on PATH, or ``error`` saying what it is needed for and how to install it."""
    path = shutil.which(name)
    if path is None:
        raise error(f"`{name}` was not found on PATH; flowtrain needs it {purpose}. {hint}")
    return path


def java_major(java: str) -> int:
    """The major version ``java -version`` reports (8 for "1.8.0_x"); 0 when it reports none."""
    out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30).stderr
    for token in out.split():  # e.g. 'openjdk version "17.0.15" 2025-04-15'
        token = token.strip('"')
        if token[:1].isdigit():
            head = token.split(".")[0]
            return int(head) if head != "1" else int(token.split(".")[1])
    return 0


def port_open(port: int, host: str = "127.0.0.1", timeout: float = 0.5) -> bool:
    """True when something accepts a TCP connection on ``host:port`` within ``timeout`` seconds."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


#: Where ``free_port`` picks: under Linux's ephemeral range (32768+), where client sockets take their ports.
FREE_PORTS = range(20000, 30000)
_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, with the next one free too (a Kafka broker's controller), picked
    under the ephemeral range: a service binds it seconds later (a JVM starting) or again after a restart, and
    meanwhile any client's socket could take a port of the ephemeral range (seen in CI: a broker's controller port
    taken while its JVM started). Never the same port twice in one process."""
    for _ in range(400):
        port = random.choice(FREE_PORTS)
        if port in _handed_out or port + 1 in _handed_out or not all(_bindable(p) for p in (port, port + 1)):
            continue
        _handed_out.update((port, port + 1))
        return port
    raise OSError(f"no free pair of TCP ports found on 127.0.0.1 in {FREE_PORTS.start}-{FREE_PORTS.stop - 1}")


def _bindable(port: int) -> bool:
    if port_open(port, timeout=0.1):  # a listener (bind would succeed with SO_REUSEADDR on some systems)
        return False
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False

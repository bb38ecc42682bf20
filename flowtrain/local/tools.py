"""What the local services (Kafka broker, Flink cluster) need from the machine: tools on PATH,
the Java version, TCP ports on 127.0.0.1."""
from __future__ import annotations

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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the kernel's pick, in the ephemeral range)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

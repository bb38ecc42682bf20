"""How the cluster's JVMs start (JobManager, TaskManagers, Beam's job server) and what their logs say."""
from __future__ import annotations

import subprocess
from pathlib import Path

from flowtrain.local.flink.jars import classpath
from flowtrain.local.processes import identity

# C1 only: on a couple of busy cores the C2 compiler's threads cost more CPU than its code saves
# for these processes (the data path is the Python SDK workers; the JVMs move bytes, schedule, translate).
_JVM_FLAGS = ["-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC"]
# Java 17 closes the JDK internals Flink 1.19 reflects on; its start scripts pass these.
_JAVA_OPENS = [
    "-XX:+IgnoreUnrecognizedVMOptions",
    "--add-exports=java.base/sun.net.util=ALL-UNNAMED",
    "--add-exports=java.rmi/sun.rmi.registry=ALL-UNNAMED",
    "--add-exports=java.security.jgss/sun.security.krb5=ALL-UNNAMED",
    *[f"--add-opens=java.base/{pkg}=ALL-UNNAMED" for pkg in (
        "java.lang", "java.net", "java.io", "java.nio", "sun.nio.ch", "java.lang.reflect", "java.text",
        "java.time", "java.util", "java.util.concurrent", "java.util.concurrent.atomic",
        "java.util.concurrent.locks")],
]


def start_java(name: str, main: str, heap: list[str], args: list[str], *, libs: Path, java: str, log_dir: Path,
               log4j: Path, cwd: Path) -> dict:
    """Start ``main`` of the jars in ``libs`` as a detached process named ``name`` (its own session; logs
    ``<log_dir>/<name>.log`` and ``.out``): its identity (``flowtrain.local.processes.identity``), log and ``popen``."""
    log = log_dir / f"{name}.log"
    out = open(log_dir / f"{name}.out", "ab")
    cmd = [java, *heap, *_JVM_FLAGS, *_JAVA_OPENS, f"-Dlog.file={log}", f"-Dlog4j.configurationFile={log4j}", "-cp",
           classpath(libs), main, *args]
    try:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=cwd)
    finally:
        out.close()
    return {**identity(proc.pid), "log": str(log), "popen": proc}


def logged(path: Path, text: str, after: int = 0) -> bool:
    """``text`` in the log at ``path`` (from byte ``after`` on: what a process started again wrote)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(after)
            return text in fh.read().decode(errors="replace")
    except OSError:
        return False


def log_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0

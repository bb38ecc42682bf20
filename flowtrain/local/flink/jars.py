"""Provisioning: Beam's Flink runner and the Flink runtime it was built against, from Maven.

``mvn dependency:copy-dependencies`` on the ``pom.xml`` beside this file resolves
``org.apache.beam:beam-runners-flink-1.19:2.62.0`` with its dependencies (Flink 1.19.0 among
them, ~160 jars, ~150 MiB) into ``<cache>/flink/beam-2.62.0-flink-1.19/libs``, once per machine.
The same jars run the JobManager, the TaskManagers and Beam's job server.

Why this pairing: the registry reachable here serves no ``beam-runners-flink-*-job-server``
(shaded) jar at any version, and 2.62.0 is the newest non-shaded runner whose dependencies all
resolve (2.70.0 misses ``beam-runners-java-job-service``). Beam's Python SDK 2.77 talks to it
through the portable job API; Beam does not promise that pairing, the tests hold it.

Three small extras are built beside them:

* ``flowtrain-flink-job-server.jar`` (beside ``libs/``): no classes, a manifest whose ``Class-Path`` lists the
  jars and whose ``Main-Class`` is the job server driver, for Beam's ``FlinkRunner
  --flink_job_server_jar`` (another cluster: Beam starts the job server itself).
* ``flowtrain-flink-helpers.jar`` (in ``libs/``, when a JDK's ``javac`` is present): a Beam resource
  detector that stages no jars with a job. The local TaskManagers run with the runner's classpath
  already, so staging it again would upload ~150 MiB per job (~15 s here). Without ``javac``
  the cluster works the same and every job uploads the classpath.
* ``flowtrain-flink-bind.jar`` (beside ``libs/``, first on every JVM's classpath; needs ``javac``):
  Beam's own ``org.apache.beam.sdk.fn.server.ServerFactory`` from its ``-sources`` jar on Maven,
  with one call changed. Beam 2.62 builds every gRPC server of the job server (job service,
  artifact staging) and of the TaskManagers (the Fn API services the SDK workers call: control,
  data, state, logging, provisioning) with ``NettyServerBuilder.forPort(port)``: every interface,
  whatever ``--job-host`` says. The patched class builds them with ``forAddress(host:port)``: the
  job server on ``--job-host`` (127.0.0.1, or ``--bind`` across hosts), the Fn API services on
  loopback (their address is ``localhost`` already). If a Beam version changes that line, the
  build stops with a message naming the file instead of producing a jar that binds everywhere.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from flowtrain.local import tools
from flowtrain.local.paths import cache_root

BEAM_RUNNER_VERSION = "2.62.0"
FLINK_VERSION = "1.19"  # Beam's runner artifact names the Flink minor version
NO_STAGING_FACTORY = "dev.flowtrain.flink.NoStagingDetectorFactory"
JOB_SERVER_MAIN = "org.apache.beam.runners.flink.FlinkJobServerDriver"
JOB_SERVER_JAR = "flowtrain-flink-job-server.jar"
HELPERS_JAR = "flowtrain-flink-helpers.jar"
BIND_JAR = "flowtrain-flink-bind.jar"
#: The Beam class patched into BIND_JAR: the artifact whose -sources jar holds it, its path, the call replaced.
_SERVER_FACTORY_ARTIFACT = f"org.apache.beam:beam-sdks-java-core:{BEAM_RUNNER_VERSION}:jar:sources"
_SERVER_FACTORY_SOURCE = "org/apache/beam/sdk/fn/server/ServerFactory.java"
_BINDS_EVERYWHERE = "NettyServerBuilder.forPort(socket.getPort())"
_BINDS_ITS_ADDRESS = "NettyServerBuilder.forAddress(socket)"
_HERE = Path(__file__).resolve().parent


class FlinkError(RuntimeError):
    """The Flink cluster could not be provisioned, started or used; the message says what to do."""


def require_tool(name: str, purpose: str, install_hint: str) -> str:
    """:func:`flowtrain.local.tools.require_tool` raising :class:`FlinkError`."""
    return tools.require_tool(name, purpose, install_hint, FlinkError)


java_major = tools.java_major


def libs_dir() -> Path:
    return cache_root() / "flink" / f"beam-{BEAM_RUNNER_VERSION}-flink-{FLINK_VERSION}" / "libs"


def _manifest_line(text: str) -> bytes:
    """A manifest header wrapped at 72 bytes, continuation lines starting with a space."""
    raw, out = text.encode(), []
    out.append(raw[:72])
    raw = raw[72:]
    while raw:
        out.append(b" " + raw[:71])
        raw = raw[71:]
    return b"\r\n".join(out) + b"\r\n"


def classpath(libs: Path) -> str:
    """The JVMs' ``-cp``: the bind patch (when built) ahead of the jars it overrides a class of."""
    bind = libs.parent / BIND_JAR
    return os.pathsep.join([str(bind)] * bind.exists() + [str(libs / "*")])


def _write_job_server_jar(libs: Path) -> None:
    bind = libs.parent / BIND_JAR
    jars = [bind] * bind.exists() + sorted(libs.glob("*.jar"))
    manifest = (b"Manifest-Version: 1.0\r\n" + _manifest_line(f"Main-Class: {JOB_SERVER_MAIN}")
                + _manifest_line("Class-Path: " + " ".join(p.resolve().as_uri() for p in jars)) + b"\r\n")
    with zipfile.ZipFile(libs.parent / JOB_SERVER_JAR, "w") as jar:  # beside libs/, not on its classpath
        jar.writestr("META-INF/MANIFEST.MF", manifest)


def _build_helpers(libs: Path, *, quiet: bool) -> bool:
    """Compile the no-staging detector into a jar in ``libs``; False when no ``javac`` exists."""
    javac = shutil.which("javac")
    if javac is None:
        if not quiet:
            print("flink: no `javac` (a JDK) on PATH: jobs on the local cluster will upload the runner's "
                  "classpath (~150 MiB) each time. Install a JDK 11+ to skip that.", flush=True)
        return False
    classes = libs.parent / "helper-classes"
    shutil.rmtree(classes, ignore_errors=True)
    proc = subprocess.run([javac, "--release", "11", "-nowarn", "-cp", str(libs / "*"), "-d", str(classes),
                           str(_HERE / "NoStagingDetectorFactory.java")], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise FlinkError(f"compiling flowtrain's Flink helper failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    with zipfile.ZipFile(libs / HELPERS_JAR, "w") as jar:
        jar.writestr("META-INF/MANIFEST.MF", "Manifest-Version: 1.0\r\n\r\n")
        for path in sorted(classes.rglob("*.class")):
            jar.write(path, path.relative_to(classes).as_posix())
    shutil.rmtree(classes, ignore_errors=True)
    return True


def _build_bind_patch(libs: Path, mvn: str | None, *, quiet: bool) -> bool:
    """Build BIND_JAR beside ``libs`` (see the module's docstring); False without ``javac`` or ``mvn``."""
    javac = shutil.which("javac")
    if javac is None or mvn is None:
        if not quiet:
            print("flink: no `javac` (a JDK) or `mvn` on PATH: Beam's job server would listen on every interface, so "
                  "`flowtrain flink start` refuses to start it on a machine with a network interface unless given "
                  "--expose-job-server. Install a JDK 11+ to bind it to 127.0.0.1.", flush=True)
        return False
    work = Path(tempfile.mkdtemp(prefix="bind-patch.", dir=libs.parent))  # two starts at once build apart
    try:
        proc = subprocess.run([mvn, "-B", "-q", "-f", str(_HERE / "pom.xml"), "dependency:copy",
                               f"-Dartifact={_SERVER_FACTORY_ARTIFACT}", f"-DoutputDirectory={work}"],
                              capture_output=True, text=True, timeout=600)
        sources = sorted(work.glob("*-sources.jar"))
        if proc.returncode != 0 or not sources:
            print(f"flink: mvn could not fetch {_SERVER_FACTORY_ARTIFACT} (Beam's ServerFactory source, patched to "
                  f"bind the job server to its address; tried again on the next start): "
                  f"{(proc.stdout + proc.stderr).strip()[-600:]}", file=sys.stderr, flush=True)
            return False
        with zipfile.ZipFile(sources[0]) as jar:
            text = jar.read(_SERVER_FACTORY_SOURCE).decode()
        if text.count(_BINDS_EVERYWHERE) != 1:
            raise FlinkError(f"{_SERVER_FACTORY_SOURCE} in {sources[0].name} no longer holds `{_BINDS_EVERYWHERE}` "
                             f"once: flowtrain's patch that binds Beam's gRPC servers to their address does not apply "
                             f"to Beam {BEAM_RUNNER_VERSION}; update flowtrain/local/flink/jars.py")
        source = work / "src" / _SERVER_FACTORY_SOURCE
        source.parent.mkdir(parents=True)
        source.write_text(text.replace(_BINDS_EVERYWHERE, _BINDS_ITS_ADDRESS))
        classes = work / "classes"
        proc = subprocess.run([javac, "--release", "11", "-nowarn", "-proc:none", "-cp", str(libs / "*"), "-d",
                               str(classes), str(source)], capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise FlinkError(f"compiling Beam's ServerFactory with flowtrain's bind patch failed:\n"
                             f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        tmp = work / BIND_JAR
        with zipfile.ZipFile(tmp, "w") as jar:
            jar.writestr("META-INF/MANIFEST.MF", "Manifest-Version: 1.0\r\n\r\n")
            for path in sorted(classes.rglob("*.class")):
                jar.write(path, path.relative_to(classes).as_posix())
        os.replace(tmp, libs.parent / BIND_JAR)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return True


def bind_patched(libs: Path | None = None) -> bool:
    """True when the JVMs run with BIND_JAR: Beam's gRPC servers listen on their own address only."""
    return ((libs or libs_dir()).parent / BIND_JAR).exists()


def provisioned(libs: Path | None = None) -> dict | None:
    """What ``ensure_jars`` recorded (versions, whether the helper jar exists), or None."""
    marker = (libs or libs_dir()) / ".complete"
    try:
        return json.loads(marker.read_text())
    except (OSError, ValueError):
        return None


def ensure_jars(*, quiet: bool = False) -> Path:
    """Resolve the runner and Flink jars once per machine; return the directory that holds them. Processes that
    ask at once (``make test`` and ``make test-multihost`` start together) resolve them one at a time: the second
    waits for the first (an exclusive lock beside the jars' directory) and finds them there."""
    libs = libs_dir()
    marker = provisioned(libs)
    if marker is not None and bind_patched(libs):
        return libs
    libs.parent.mkdir(parents=True, exist_ok=True)
    with open(libs.with_name("libs.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when this process dies
        return _ensure_jars(libs, quiet=quiet)


def _ensure_jars(libs: Path, *, quiet: bool) -> Path:
    marker = provisioned(libs)
    if marker is not None:
        # provisioned before the patch existed, or without a JDK or the sources then: build it now
        if not bind_patched(libs) and shutil.which("javac") and shutil.which("mvn"):
            marker["bind_patch"] = _build_bind_patch(libs, shutil.which("mvn"), quiet=quiet)
            _write_job_server_jar(libs)
            (libs / ".complete").write_text(json.dumps(marker))
        return libs
    mvn = require_tool("mvn", "to fetch Beam's Flink runner and the Flink jars from the Maven registry",
                       "Install Apache Maven 3.8+ (Debian: `apt-get install maven`).")
    tmp = libs.with_name("libs.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = [mvn, "-B", "-q", "-f", str(_HERE / "pom.xml"), f"-Dbeam.runner.version={BEAM_RUNNER_VERSION}",
           f"-Dflink.minor={FLINK_VERSION}", "dependency:copy-dependencies", f"-DoutputDirectory={tmp}",
           "-DincludeScope=runtime"]
    if not quiet:
        print(f"flink: resolving org.apache.beam:beam-runners-flink-{FLINK_VERSION}:{BEAM_RUNNER_VERSION} "
              f"(and Flink {FLINK_VERSION}) with mvn into {libs}", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise FlinkError(f"mvn could not resolve Beam's Flink runner {BEAM_RUNNER_VERSION}:\n"
                         f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    helpers = _build_helpers(tmp, quiet=quiet)
    shutil.rmtree(libs, ignore_errors=True)
    tmp.rename(libs)
    bind_patch = _build_bind_patch(libs, mvn, quiet=quiet)
    _write_job_server_jar(libs)  # absolute jar URLs: written where the jars finally live
    (libs / ".complete").write_text(json.dumps({
        "beam_runner": BEAM_RUNNER_VERSION, "flink": FLINK_VERSION, "no_staging_helper": helpers,
        "bind_patch": bind_patch, "jars": len(list(libs.glob("*.jar")))}))
    return libs


def job_server_jar() -> Path:
    """The manifest-only jar for ``FlinkRunner --flink_job_server_jar`` (resolved on first use)."""
    return ensure_jars().parent / JOB_SERVER_JAR

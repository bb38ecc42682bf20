"""A local Apache Flink session cluster on 127.0.0.1, Beam's Flink job server and a worker pool.

Everything runs from the jars :mod:`flowtrain.local.flink.jars` resolves (no Flink
distribution, no Docker), as detached processes that ``flowtrain flink start`` leaves running:

* a JobManager (``StandaloneSessionClusterEntrypoint``), REST API on ``rest_port``;
* ``taskmanagers`` TaskManagers (``TaskManagerRunner``) with ``slots`` slots each, their
  memory given explicitly (the options Flink's start scripts would compute);
* Beam's ``FlinkJobServerDriver`` on ``job_port``, submitting to the JobManager;
* a worker pool (:mod:`flowtrain.local.flink.worker_pool`) that starts the Python SDK workers
  (``--environment_type=EXTERNAL``) with this Python, so they import flowtrain's code.

``<data_dir>/cluster.json`` records the processes (pid and start time, so a recycled pid is
never signalled), ports and logs; ``status`` and ``stop`` read it, and ``beam_args`` turns it
into the Beam options that run a pipeline there.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from flowtrain.local.flink.jars import (
    BEAM_RUNNER_VERSION,
    FLINK_VERSION,
    NO_STAGING_FACTORY,
    FlinkError,
    ensure_jars,
    provisioned,
    require_tool,
)
from flowtrain.local.flink.worker_pool import worker_env
from flowtrain.local.paths import cache_root
from flowtrain.local.processes import identity, same_process, stop_recorded
from flowtrain.local.tools import free_port, java_major, port_open

#: Where `flowtrain flink` keeps the default cluster; FLOWTRAIN_FLINK_DIR picks another one
#: (for `flowtrain batch --runner flink` as for `flowtrain flink start`).
DIR_ENV = "FLOWTRAIN_FLINK_DIR"

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

_LOG4J = """\
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = MainAppender
appender.main.name = MainAppender
appender.main.type = File
appender.main.fileName = ${sys:log.file}
appender.main.layout.type = PatternLayout
appender.main.layout.pattern = %d{yyyy-MM-dd HH:mm:ss,SSS} %-5p %-60c %x - %m%n
logger.pekko.name = org.apache.pekko
logger.pekko.level = WARN
"""


def default_dir() -> Path:
    return Path(os.environ.get(DIR_ENV) or cache_root() / "flink-cluster").expanduser()


@dataclass
class TaskManagerMemory:
    """One TaskManager's memory (MiB), given to Flink explicitly as its start scripts would.

    The defaults suit the tests' inputs. A pipeline that broadcasts a big side input or
    aggregates into one big element (the flights ETL's reference tables at 10x: one 23 MB
    record) needs more of all three of task heap (records on the JVM side), managed memory
    (Flink's sort buffers: a record must fit one) and task off-heap (the gRPC data plane to the
    Python workers uses direct memory); the 10x flights ETL ran with 1024 / 768 / 768.
    """

    framework_heap: int = 128
    task_heap: int = 384
    framework_off_heap: int = 128
    task_off_heap: int = 256  # Beam's Fn API data plane (gRPC, Netty) allocates direct buffers
    network_per_slot: int = 256  # Beam's batch jobs deploy every operator at once: many channels
    managed: int = 128
    metaspace: int = 256
    overhead: int = 192

    def flink_options(self, slots: int) -> dict[str, str]:
        net = f"{self.network_per_slot * slots}m"
        return {
            "taskmanager.memory.framework.heap.size": f"{self.framework_heap}m",
            "taskmanager.memory.task.heap.size": f"{self.task_heap}m",
            "taskmanager.memory.framework.off-heap.size": f"{self.framework_off_heap}m",
            "taskmanager.memory.task.off-heap.size": f"{self.task_off_heap}m",
            "taskmanager.memory.network.min": net,
            "taskmanager.memory.network.max": net,
            "taskmanager.memory.managed.size": f"{self.managed}m",
            "taskmanager.memory.jvm-metaspace.size": f"{self.metaspace}m",
            "taskmanager.memory.jvm-overhead.min": f"{self.overhead}m",
            "taskmanager.memory.jvm-overhead.max": f"{self.overhead}m",
        }

    def jvm_options(self, slots: int) -> list[str]:
        heap = self.framework_heap + self.task_heap
        direct = self.framework_off_heap + self.task_off_heap + self.network_per_slot * slots
        return [f"-Xmx{heap}m", f"-Xms{heap}m", f"-XX:MaxDirectMemorySize={direct}m",
                f"-XX:MaxMetaspaceSize={self.metaspace}m"]


def _alive(proc: dict) -> bool:
    return same_process(proc)


def _rest(port: int, path: str, timeout: float = 3.0):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as resp:
        return json.loads(resp.read())


_ACTIVE = ("INITIALIZING", "CREATED", "RUNNING", "RESTARTING", "CANCELLING", "FAILING", "RECONCILING")


def cancel_flink_jobs(rest_url: str, job_name: str, *, timeout_s: float = 60.0) -> list[str]:
    """Cancel the Flink jobs named ``job_name`` through the REST API; returns their ids once
    they are CANCELED (or otherwise ended). Beam's job server cannot do it: its cancel only stops
    waiting for the job, which would run on (and keep reading and committing)."""
    base = rest_url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        base = f"http://{base}"

    def jobs() -> list[dict]:
        with urllib.request.urlopen(f"{base}/jobs/overview", timeout=10) as resp:
            return [j for j in json.loads(resp.read())["jobs"] if j["name"] == job_name]

    ids = [j["jid"] for j in jobs() if j["state"] in _ACTIVE]
    for jid in ids:
        req = urllib.request.Request(f"{base}/jobs/{jid}?mode=cancel", method="PATCH")
        urllib.request.urlopen(req, timeout=10).close()
    deadline = time.monotonic() + timeout_s
    while ids and time.monotonic() < deadline:
        if all(j["state"] not in _ACTIVE for j in jobs() if j["jid"] in ids):
            return ids
        time.sleep(0.5)
    if ids:
        raise FlinkError(f"Flink jobs {ids} ({job_name}) were not cancelled within {timeout_s:.0f} s; see {base}")
    return ids


@dataclass
class LocalFlink:
    """A Flink session cluster with ``taskmanagers`` x ``slots`` slots, a job server and a worker pool."""

    taskmanagers: int = 2
    slots: int = 1
    rest_port: int = 8081
    job_port: int = 8099
    data_dir: Path = field(default_factory=default_dir)
    memory: TaskManagerMemory = field(default_factory=TaskManagerMemory)
    jobmanager_heap_mb: int = 512
    job_server_heap_mb: int = 512

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir).expanduser().resolve()
        if self.taskmanagers < 1 or self.slots < 1:
            raise FlinkError(f"--taskmanagers and --slots must be at least 1 (got {self.taskmanagers}, {self.slots})")

    # -- paths and state -----------------------------------------------------------------
    @property
    def conf_dir(self) -> Path:
        return self.data_dir / "conf"

    @property
    def log_dir(self) -> Path:
        return self.data_dir / "log"

    @property
    def _state_path(self) -> Path:
        return self.data_dir / "cluster.json"

    def read_state(self) -> dict | None:
        try:
            return json.loads(self._state_path.read_text())
        except (OSError, ValueError):
            return None

    def _write_state(self, state: dict) -> None:
        tmp = self._state_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(state, indent=2))
        os.replace(tmp, self._state_path)

    def running(self) -> bool:
        """True when every process of the recorded cluster is alive."""
        state = self.read_state()
        return bool(state and state.get("complete") and all(_alive(p) for p in state["processes"].values()))

    def status(self) -> dict:
        state = self.read_state() or {}
        procs = state.get("processes", {})
        out = {
            "running": self.running(),
            "data_dir": str(self.data_dir),
            "logs": str(self.log_dir),
            "rest": state.get("rest", f"http://127.0.0.1:{self.rest_port}"),
            "job_endpoint": state.get("job_endpoint"),
            "worker_pool": state.get("worker_pool"),
            "versions": {"flink": state.get("flink_version"), "beam_runner": BEAM_RUNNER_VERSION},
            "processes": {name: {"pid": p["pid"], "alive": _alive(p), "log": p["log"]} for name, p in procs.items()},
        }
        if out["running"]:
            try:
                overview = _rest(state["rest_port"], "/overview")
                out.update(taskmanagers=overview["taskmanagers"], slots=overview["slots-total"],
                           slots_available=overview["slots-available"], jobs_running=overview["jobs-running"])
            except (OSError, ValueError, KeyError):
                out["rest_answers"] = False
        return out

    def beam_args(self) -> list[str]:
        """Beam options that run a pipeline on this (running) cluster."""
        state = self.read_state()
        if not self.running() or state is None:
            raise FlinkError(f"no local Flink cluster is running in {self.data_dir}. Start one with "
                             f"`flowtrain flink start` (set {DIR_ENV} for another directory), or pass "
                             f"--flink-master HOST:PORT to use another Flink cluster")
        # environment_cache_millis: keep a TaskManager's SDK worker between the stages of a job.
        # Without it every batch stage (a Flink task) starts a fresh Python worker (imports of
        # Beam, pyarrow and the pipeline: seconds each on 2 cores), ~10 per TaskManager per ETL.
        args = ["--runner=PortableRunner", f"--job_endpoint={state['job_endpoint']}",
                "--environment_type=EXTERNAL", f"--environment_config={state['worker_pool']}",
                "--environment_cache_millis=30000"]
        if state.get("no_staging"):
            args.append(f"--pipeline_resources_detector_factory_class={NO_STAGING_FACTORY}")
        return args

    # -- config --------------------------------------------------------------------------
    def _flink_conf(self, rpc_port: int) -> str:
        conf = {
            "jobmanager.rpc.address": "127.0.0.1",
            "jobmanager.rpc.port": rpc_port,
            "jobmanager.bind-host": "127.0.0.1",
            "rest.address": "127.0.0.1",
            "rest.bind-address": "127.0.0.1",
            "rest.port": self.rest_port,
            "taskmanager.host": "127.0.0.1",
            "taskmanager.bind-host": "127.0.0.1",
            "taskmanager.numberOfTaskSlots": self.slots,
            "parallelism.default": self.taskmanagers * self.slots,
            # The TaskManagers run with Beam's runner on their classpath; jobs stage no jars
            # (or, without the helper, the same ones): load Beam's classes from the one copy.
            "classloader.resolve-order": "parent-first",
            "classloader.check-leaked-classloader": "false",
            # Beam's batch jobs deploy every stage at once; Flink's default of 512 buffers per
            # sort-shuffle partition would need ~GBs of network memory for them.
            "taskmanager.network.sort-shuffle.min-buffers": 64,
            # Generous: the machine this runs on may be busy (2 cores shared with Kafka, tests).
            "pekko.ask.timeout": "120 s",
            "heartbeat.timeout": 180000,
            "io.tmp.dirs": str(self.data_dir / "tmp"),
            "blob.storage.directory": str(self.data_dir / "tmp" / "blobs"),
            "web.tmpdir": str(self.data_dir / "tmp" / "web"),
        }
        return "".join(f"{k}: {v}\n" for k, v in conf.items())

    def _java(self, name: str, main: str, heap: list[str], args: list[str], libs: Path, java: str) -> dict:
        log = self.log_dir / f"{name}.log"
        out = open(self.log_dir / f"{name}.out", "ab")
        cmd = [java, *heap, *_JVM_FLAGS, *_JAVA_OPENS, f"-Dlog.file={log}",
               f"-Dlog4j.configurationFile={self.conf_dir / 'log4j2.properties'}", "-cp", str(libs / "*"), main, *args]
        try:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, cwd=self.data_dir)
        finally:
            out.close()
        return {**identity(proc.pid), "log": str(log), "popen": proc}

    # -- lifecycle -----------------------------------------------------------------------
    def start(self, *, timeout_s: float = 180.0, quiet: bool = False) -> dict:
        """Start the cluster unless it runs already; return its status. Idempotent."""
        if self.running():
            state = self.read_state()
            if not quiet:
                note = ""
                if (state.get("taskmanagers"), state.get("slots")) != (self.taskmanagers, self.slots):
                    note = (f" with {state.get('taskmanagers')} TaskManager(s) x {state.get('slots')} slot(s); "
                            f"`flowtrain flink stop` first to change that")
                print(f"flink: already running{note}; REST {state['rest']}, job server {state['job_endpoint']}, "
                      f"logs {self.log_dir}")
            return self.status()
        if self.read_state():
            self.stop(quiet=True)  # leftovers of a cluster that partly died
        java = require_tool("java", "to run Flink and Beam's Flink job server",
                            "Install a Java 11+ runtime (Debian: `apt-get install openjdk-17-jre-headless`).")
        if java_major(java) < 11:
            raise FlinkError("Flink 1.19 needs Java 11 or newer; `java -version` reports an older one.")
        for port, what in ((self.rest_port, "--rest-port"), (self.job_port, "--job-port")):
            if port_open(port):
                raise FlinkError(f"port {port} on 127.0.0.1 is taken by another process; choose another with {what}")
        t0 = time.monotonic()
        libs = ensure_jars(quiet=quiet)
        no_staging = bool((provisioned(libs) or {}).get("no_staging_helper"))
        for d in (self.conf_dir, self.log_dir, self.data_dir / "tmp", self.data_dir / "artifacts"):
            d.mkdir(parents=True, exist_ok=True)
        rpc_port, pool_port = free_port(), free_port()
        artifact_port, expansion_port = free_port(), free_port()
        (self.conf_dir / "flink-conf.yaml").write_text(self._flink_conf(rpc_port))
        (self.conf_dir / "log4j2.properties").write_text(_LOG4J)
        state = {"complete": False, "rest_port": self.rest_port, "rest": f"http://127.0.0.1:{self.rest_port}",
                 "job_endpoint": f"127.0.0.1:{self.job_port}", "worker_pool": f"127.0.0.1:{pool_port}",
                 "taskmanagers": self.taskmanagers, "slots": self.slots, "flink_version": FLINK_VERSION,
                 "beam_runner": BEAM_RUNNER_VERSION, "jars": str(libs), "no_staging": no_staging,
                 "python": sys.executable, "started_at": time.time(), "processes": {}}
        popens: dict[str, subprocess.Popen] = {}

        def record(name: str, proc: dict) -> None:
            popens[name] = proc.pop("popen")
            state["processes"][name] = proc
            self._write_state(state)

        try:
            pool_log = self.log_dir / "worker-pool.log"
            with open(pool_log, "ab") as out:
                pool = subprocess.Popen(
                    [sys.executable, "-m", "flowtrain.local.flink.worker_pool", "--port", str(pool_port),
                     "--log-dir", str(self.log_dir / "sdk-workers")],
                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                    env=worker_env(), cwd=self.data_dir)
            record("worker-pool", {**identity(pool.pid), "log": str(pool_log), "popen": pool})
            conf = ["--configDir", str(self.conf_dir)]
            record("jobmanager", self._java("jobmanager", "org.apache.flink.runtime.entrypoint."
                                            "StandaloneSessionClusterEntrypoint",
                                            [f"-Xmx{self.jobmanager_heap_mb}m"], conf, libs, java))
            tm_opts = [x for k, v in {"taskmanager.cpu.cores": self.slots,
                                      **self.memory.flink_options(self.slots)}.items() for x in ("-D", f"{k}={v}")]
            for i in range(1, self.taskmanagers + 1):
                record(f"taskmanager-{i}", self._java(
                    f"taskmanager-{i}", "org.apache.flink.runtime.taskexecutor.TaskManagerRunner",
                    self.memory.jvm_options(self.slots), [*conf, *tm_opts, "-D", f"taskmanager.resource-id=tm-{i}"],
                    libs, java))
            record("job-server", self._java(
                "job-server", "org.apache.beam.runners.flink.FlinkJobServerDriver", [f"-Xmx{self.job_server_heap_mb}m"],
                ["--flink-master", f"127.0.0.1:{self.rest_port}", "--flink-conf-dir", str(self.conf_dir),
                 "--job-host", "127.0.0.1", "--job-port", str(self.job_port), "--artifact-port", str(artifact_port),
                 "--expansion-port", str(expansion_port), "--artifacts-dir", str(self.data_dir / "artifacts")],
                libs, java))
            self._await_ready(popens, pool_port, timeout_s)
        except BaseException:
            self.stop(quiet=True)
            raise
        state["complete"] = True
        state["start_seconds"] = round(time.monotonic() - t0, 1)
        self._write_state(state)
        if not quiet:
            print(f"flink: session cluster (Flink {FLINK_VERSION}, Beam runner {BEAM_RUNNER_VERSION}) started in "
                  f"{state['start_seconds']:.1f} s: {self.taskmanagers} TaskManager(s) x {self.slots} slot(s)\n"
                  f"  REST        {state['rest']}\n  job server  {state['job_endpoint']}\n"
                  f"  worker pool {state['worker_pool']} (python {sys.executable})\n  logs        {self.log_dir}",
                  flush=True)
        return self.status() | {"start_seconds": state["start_seconds"]}

    def _await_ready(self, popens: dict[str, subprocess.Popen], pool_port: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        want = self.taskmanagers * self.slots
        registered = None
        while time.monotonic() < deadline:
            for name, proc in popens.items():
                if proc.poll() is not None:
                    raise FlinkError(f"the {name} process exited with code {proc.returncode} during start; see "
                                     f"{self.log_dir}/{name}.log and .out:\n{self._tail(name)}")
            try:
                registered = _rest(self.rest_port, "/overview", timeout=2)
            except (OSError, ValueError):
                registered = None
            if (registered and registered.get("slots-total", 0) >= want and port_open(self.job_port)
                    and port_open(pool_port)):
                return
            time.sleep(0.5)
        raise FlinkError(f"the Flink cluster was not ready within {timeout_s:.0f} s (REST overview: {registered}, "
                         f"job server port {self.job_port} open: {port_open(self.job_port)}); logs in {self.log_dir}")

    def _tail(self, name: str, lines: int = 25) -> str:
        text = ""
        for suffix in (".out", ".log"):
            try:
                text += "\n".join((self.log_dir / f"{name}{suffix}").read_text(errors="replace").splitlines()[-lines:])
            except OSError:
                pass
        return text or "(no log)"

    def stop(self, *, timeout_s: float = 30.0, quiet: bool = False) -> bool:
        """Stop every process of the cluster (SIGTERM, then SIGKILL); False if none ran."""
        state = self.read_state()
        procs = [(name, p) for name, p in reversed(list((state or {}).get("processes", {}).items())) if _alive(p)]
        if not procs:
            if not quiet:
                print(f"flink: no cluster running in {self.data_dir}")
            return False
        # each runs in its own session: its process group holds its children
        stop_recorded([p for _, p in procs], sig=signal.SIGTERM, grace_s=timeout_s)
        state["complete"] = False
        self._write_state(state)
        if not quiet:
            print(f"flink: stopped {', '.join(name for name, _ in procs)} (data dir {self.data_dir})")
        return True

"""An Apache Flink session cluster (on 127.0.0.1, or across hosts), Beam's Flink job server and a worker pool.

Everything runs from the jars :mod:`flowtrain.local.flink.jars` resolves (no Flink
distribution, no Docker), as detached processes that ``flowtrain flink start`` leaves running:

* a JobManager (``StandaloneSessionClusterEntrypoint``), REST API on ``rest_port``;
* ``taskmanagers`` TaskManagers (``TaskManagerRunner``) with ``slots`` slots each, their
  memory given explicitly (the options Flink's start scripts would compute);
* Beam's ``FlinkJobServerDriver`` on ``job_port``, submitting to the JobManager (on ``bind`` only with the
  bind patch of :mod:`flowtrain.local.flink.jars`; Beam alone binds it on every interface);
* a worker pool (:mod:`flowtrain.local.flink.worker_pool`) that starts the Python SDK workers
  (``--environment_type=EXTERNAL``) with this Python, so they import flowtrain's code.

Across hosts (``bind``: the address every Flink process listens on and advertises), the
JobManager's host runs the JobManager, the job server and any local TaskManagers; each other host
runs ``taskmanagers`` TaskManagers with its own worker pool against that JobManager
(``jobmanager="HOST:RPC_PORT"``). The worker pool of every host listens on 127.0.0.1 at the same
``pool_port``: a job names one ``--environment_config`` for all its TaskManagers, and Beam's
TaskManager side advertises its Fn API services to the SDK workers as ``localhost``, so each
TaskManager must find a pool on its own host at that one address.

``<data_dir>/cluster.json`` records the processes (pid and start time, so a recycled pid is
never signalled), ports and logs; ``status`` and ``stop`` read it, and ``beam_args`` turns it
into the Beam options that run a pipeline there.
"""
from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from flowtrain.local.flink.jars import (
    BEAM_RUNNER_VERSION,
    FLINK_VERSION,
    NO_STAGING_FACTORY,
    FlinkError,
    bind_patched,
    ensure_jars,
    provisioned,
    require_tool,
)
from flowtrain.local.flink.jvm import log_size, logged, start_java
from flowtrain.local.flink.listeners import listening, network_interfaces
from flowtrain.local.flink.memory import LOG4J, TaskManagerMemory
from flowtrain.local.flink.rest import LOOPBACK, rest_json
from flowtrain.local.flink.worker_pool import worker_env
from flowtrain.local.paths import cache_root
from flowtrain.local.processes import identity, same_process, stop_recorded
from flowtrain.local.service import LocalService
from flowtrain.local.tools import free_port, java_major, port_open

#: Where `flowtrain flink` keeps the default cluster; FLOWTRAIN_FLINK_DIR picks another one
#: (for `flowtrain batch --runner flink` as for `flowtrain flink start`).
DIR_ENV = "FLOWTRAIN_FLINK_DIR"

#: Across hosts the ports must be known in advance (every TaskManager host names the JobManager's RPC
#: port, every worker pool listens on the port the jobs name): Flink's and Beam's conventional ones.
DEFAULT_RPC_PORT = 6123
DEFAULT_POOL_PORT = 50000

def default_dir() -> Path:
    return Path(os.environ.get(DIR_ENV) or cache_root() / "flink-cluster").expanduser()


def _alive(proc: dict) -> bool:
    return same_process(proc)


@dataclass
class LocalFlink(LocalService):
    """A Flink session cluster with ``taskmanagers`` x ``slots`` slots, a job server and a worker pool.

    ``bind``: the address every process listens on and advertises (127.0.0.1 by default).
    ``jobmanager`` ("HOST:RPC_PORT"): start only ``taskmanagers`` TaskManagers and a worker pool on this
    host, registering with that JobManager (another host's ``flowtrain flink start --bind``).
    ``taskmanagers=0`` on the JobManager's host: only the JobManager and the job server, TaskManagers join
    from other hosts; ``parallelism`` (the jobs' default) is then required. ``rpc_port`` / ``pool_port``:
    free ports on loopback, 6123 / 50000 with another ``bind`` (every host must agree on them).

    Every process listens on ``bind`` (the worker pool and the TaskManagers' Fn API services on loopback),
    never on every interface: Beam's job server only with the bind patch of :mod:`~flowtrain.local.flink.jars`
    (it needs a JDK). Without the patch ``start`` refuses to run the job server on a machine with a network
    interface unless ``expose_job_server``; and a started cluster any of whose processes listens on a wildcard
    address (other than that job server, so allowed) is stopped with an error.
    """

    taskmanagers: int = 2
    slots: int = 1
    rest_port: int = 8081
    job_port: int = 8099
    data_dir: Path = field(default_factory=default_dir)
    memory: TaskManagerMemory = field(default_factory=TaskManagerMemory)
    jobmanager_heap_mb: int = 512
    job_server_heap_mb: int = 512
    bind: str = LOOPBACK
    jobmanager: str | None = None
    rpc_port: int | None = None
    pool_port: int | None = None
    parallelism: int | None = None
    expose_job_server: bool = False

    prefix = "flink"
    noun = "cluster"
    state_file = "cluster.json"  # read as every local service reads its own (LocalService._read_state)
    log_file = "log/jobmanager.log"
    error = FlinkError

    def __post_init__(self) -> None:
        super().__post_init__()
        least = 1 if self.jobmanager else 0
        if self.taskmanagers < least or self.slots < 1:
            raise FlinkError(f"--taskmanagers must be at least {least} and --slots at least 1 (got "
                             f"{self.taskmanagers}, {self.slots})")
        try:
            ipaddress.ip_address(self.bind)
        except ValueError:
            raise FlinkError(f"--bind {self.bind!r} is not an IP address; give this host's address on the network "
                             f"the other hosts reach (e.g. 10.0.0.2), or leave it out for 127.0.0.1") from None
        if self.bind in ("0.0.0.0", "::"):
            raise FlinkError(f"--bind {self.bind} would listen on every interface and advertise an address no other "
                             f"host can reach; give this host's own address")
        if self.jobmanager is not None:
            host, sep, port = self.jobmanager.rpartition(":")
            if not (sep and host and port.isdigit()):
                raise FlinkError(f"--taskmanager-of {self.jobmanager!r} is not HOST:RPC_PORT (the JobManager's "
                                 f"address and RPC port, as its `flowtrain flink start --bind` printed)")
            self._jm_host, self._jm_port = host.strip("[]"), int(port)
        joinable = self.bind != LOOPBACK or self.jobmanager is not None
        if self.pool_port is None and joinable:
            self.pool_port = DEFAULT_POOL_PORT
        if self.rpc_port is None and self.bind != LOOPBACK and self.jobmanager is None:
            self.rpc_port = DEFAULT_RPC_PORT
        if self.parallelism is None and self.jobmanager is None and self.taskmanagers:
            self.parallelism = self.taskmanagers * self.slots

    # -- paths and state -----------------------------------------------------------------
    @property
    def conf_dir(self) -> Path:
        return self.data_dir / "conf"

    @property
    def log_dir(self) -> Path:
        return self.data_dir / "log"

    def read_state(self) -> dict | None:
        """The recorded cluster (``cluster.json``), or None: none recorded, or an unreadable record."""
        return self._read_state()

    def _write_state(self, state: dict) -> None:
        tmp = self._state_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(state, indent=2))
        os.replace(tmp, self._state_path)

    @property
    def role(self) -> str:
        """"cluster" (a JobManager, a job server and any local TaskManagers) or "taskmanagers" (joining one)."""
        return "taskmanagers" if self.jobmanager else "cluster"

    def running(self) -> bool:
        """True when every process of the recorded cluster is alive."""
        state = self._read_state()
        return bool(state and state.get("complete") and all(_alive(p) for p in state["processes"].values()))

    def status(self) -> dict:
        state = self._read_state() or {}
        procs = state.get("processes", {})
        out = {
            "running": self.running(),
            "role": state.get("role", self.role),
            "data_dir": str(self.data_dir),
            "logs": str(self.log_dir),
            "bind": state.get("bind", self.bind),
            "rest": state.get("rest", f"http://{self.bind}:{self.rest_port}"),
            "job_endpoint": state.get("job_endpoint"),
            "worker_pool": state.get("worker_pool"),
            "versions": {"flink": state.get("flink_version"), "beam_runner": BEAM_RUNNER_VERSION},
            "processes": {name: {"pid": p["pid"], "alive": _alive(p), "log": p["log"]} for name, p in procs.items()},
        }
        alive = {p["pid"]: name for name, p in procs.items() if _alive(p)}
        out["listening"] = {alive[pid]: sorted(f"[{a}]:{port}" if ":" in a else f"{a}:{port}" for a, port in addrs)
                            for pid, addrs in listening(alive).items()}
        if state.get("role") == "taskmanagers":
            out["jobmanager"] = state.get("jobmanager")
            out.pop("rest")
        elif out["running"]:
            out["jobmanager"] = state.get("jobmanager")
            try:
                overview = rest_json(state["rest_port"], "/overview", host=state.get("bind", LOOPBACK))
                out.update(taskmanagers=overview["taskmanagers"], slots=overview["slots-total"],
                           slots_available=overview["slots-available"], jobs_running=overview["jobs-running"])
            except (OSError, ValueError, KeyError):
                out["rest_answers"] = False
        return out

    def beam_args(self) -> list[str]:
        """Beam options that run a pipeline on this (running) cluster."""
        state = self._read_state()
        if not self.running() or state is None:
            raise FlinkError(f"no local Flink cluster is running in {self.data_dir}. Start one with "
                             f"`flowtrain flink start` (set {DIR_ENV} for another directory), or pass "
                             f"--flink-master HOST:PORT to use another Flink cluster")
        if state.get("role") == "taskmanagers":
            raise FlinkError(f"{self.data_dir} holds TaskManagers of the JobManager at {state['jobmanager']}, no job "
                             f"server: run pipelines against the JobManager host's cluster directory (its "
                             f"`flowtrain flink start --bind` printed the job server)")
        # environment_cache_millis: keep a TaskManager's SDK worker between the stages of a job.
        # Without it every batch stage (a Flink task) starts a fresh Python worker (imports of
        # Beam, pyarrow and the pipeline: seconds each on 2 cores), ~10 per TaskManager per ETL.
        # disable_logging_submission_environment: Beam would run `pip freeze` before each submission to stage the
        # submitting environment's package list for a runtime mismatch warning; the pool's workers run this very
        # interpreter, so there is nothing to compare (and one subprocess fewer before a job reaches the server).
        args = ["--runner=PortableRunner", f"--job_endpoint={state['job_endpoint']}",
                "--environment_type=EXTERNAL", f"--environment_config={state['worker_pool']}",
                "--environment_cache_millis=30000", "--experiments=disable_logging_submission_environment"]
        if state.get("no_staging"):
            args.append(f"--pipeline_resources_detector_factory_class={NO_STAGING_FACTORY}")
        return args

    # -- config --------------------------------------------------------------------------
    def _flink_conf(self, jm_host: str, rpc_port: int) -> str:
        conf = {
            "jobmanager.rpc.address": jm_host,
            "jobmanager.rpc.port": rpc_port,
            "jobmanager.bind-host": self.bind,
            "rest.address": self.bind,
            "rest.bind-address": self.bind,
            "rest.port": self.rest_port,
            "taskmanager.host": self.bind,
            "taskmanager.bind-host": self.bind,
            "taskmanager.numberOfTaskSlots": self.slots,
            "parallelism.default": self.parallelism or self.taskmanagers * self.slots,
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
        return start_java(name, main, heap, args, libs=libs, java=java, log_dir=self.log_dir,
                          log4j=self.conf_dir / "log4j2.properties", cwd=self.data_dir)

    # -- lifecycle -----------------------------------------------------------------------
    def start(self, *, timeout_s: float = 180.0, quiet: bool = False) -> dict:
        """Start the cluster (or, with ``jobmanager``, this host's TaskManagers) unless it runs already;
        return its status. Idempotent."""
        if self.running():
            state = self._read_state()
            if not quiet:
                note = ""
                if (state.get("taskmanagers"), state.get("slots")) != (self.taskmanagers, self.slots):
                    note = (f" with {state.get('taskmanagers')} TaskManager(s) x {state.get('slots')} slot(s); "
                            f"`flowtrain flink stop` first to change that")
                if state.get("role") == "taskmanagers":
                    print(f"flink: already running{note}: TaskManagers of {state['jobmanager']} on {state['bind']}, "
                          f"logs {self.log_dir}")
                else:
                    print(f"flink: already running{note}; REST {state['rest']}, job server {state['job_endpoint']}, "
                          f"logs {self.log_dir}")
            return self.status()
        if self._restart_dead_taskmanagers(timeout_s=timeout_s, quiet=quiet):
            return self.status()
        if not self.parallelism and not self.jobmanager:
            raise FlinkError("--taskmanagers 0 (TaskManagers join from other hosts) needs --parallelism N: "
                             "the jobs' default parallelism, the slots those TaskManagers will offer")
        if self._read_state():
            self.stop(quiet=True)  # leftovers of a cluster that partly died
        java = require_tool("java", "to run Flink and Beam's Flink job server",
                            "Install a Java 11+ runtime (Debian: `apt-get install openjdk-17-jre-headless`).")
        if java_major(java) < 11:
            raise FlinkError("Flink 1.19 needs Java 11 or newer; `java -version` reports an older one.")
        ports = [] if self.jobmanager else [(self.rest_port, "--rest-port", self.bind), (self.job_port, "--job-port",
                                                                                           self.bind)]
        if self.rpc_port is not None and not self.jobmanager:
            ports.append((self.rpc_port, "--rpc-port", self.bind))
        if self.pool_port is not None and self.taskmanagers:
            ports.append((self.pool_port, "--pool-port", LOOPBACK))
        for port, what, host in ports:
            if port_open(port, host):
                raise FlinkError(f"port {port} on {host} is taken by another process; choose another with {what}")
        t0 = time.monotonic()
        libs = ensure_jars(quiet=quiet)
        no_staging = bool((provisioned(libs) or {}).get("no_staging_helper"))
        patched = bind_patched(libs)
        if not self.jobmanager and not patched and not self.expose_job_server and network_interfaces():
            raise FlinkError(f"Beam's job server would listen on every interface (no bind patch in {libs.parent}: "
                             f"building it needs a JDK's `javac`, `mvn` and Beam's sources jar from the Maven registry), and this machine has network interfaces "
                             f"({', '.join(network_interfaces()[:4])}): anyone reaching its port could run code as "
                             f"you. Install a JDK 11+ (the patch is built on the next start), or pass "
                             f"--expose-job-server to start it anyway")
        for d in (self.conf_dir, self.log_dir, self.data_dir / "tmp", self.data_dir / "artifacts"):
            d.mkdir(parents=True, exist_ok=True)
        pool_port = self.pool_port or free_port()
        if self.jobmanager:
            jm_host, rpc_port = self._jm_host, self._jm_port
        else:
            jm_host, rpc_port = self.bind, self.rpc_port or free_port()
        (self.conf_dir / "flink-conf.yaml").write_text(self._flink_conf(jm_host, rpc_port))
        (self.conf_dir / "log4j2.properties").write_text(LOG4J)
        state = {"complete": False, "role": self.role, "bind": self.bind, "jobmanager": f"{jm_host}:{rpc_port}",
                 "taskmanagers": self.taskmanagers, "slots": self.slots, "flink_version": FLINK_VERSION,
                 "beam_runner": BEAM_RUNNER_VERSION, "jars": str(libs), "no_staging": no_staging,
                 "bind_patch": patched,
                 "python": sys.executable, "started_at": time.time(), "processes": {}}
        if self.taskmanagers:
            state["worker_pool"] = f"{LOOPBACK}:{pool_port}"
        if not self.jobmanager:
            state.update(rest_port=self.rest_port, rest=f"http://{self.bind}:{self.rest_port}",
                         job_endpoint=f"{self.bind}:{self.job_port}", worker_pool=f"{LOOPBACK}:{pool_port}",
                         parallelism=self.parallelism)
        popens: dict[str, subprocess.Popen] = {}

        def record(name: str, proc: dict) -> None:
            popens[name] = proc.pop("popen")
            state["processes"][name] = proc
            self._write_state(state)

        try:
            if self.taskmanagers:
                pool_log = self.log_dir / "worker-pool.log"
                with open(pool_log, "ab") as out:
                    pool = subprocess.Popen(
                        [sys.executable, "-m", "flowtrain.local.flink.worker_pool", "--port", str(pool_port),
                         "--log-dir", str(self.log_dir / "sdk-workers")],
                        stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                        env=worker_env(), cwd=self.data_dir)
                record("worker-pool", {**identity(pool.pid), "log": str(pool_log), "popen": pool})
            conf = ["--configDir", str(self.conf_dir)]
            if not self.jobmanager:
                record("jobmanager", self._java("jobmanager", "org.apache.flink.runtime.entrypoint."
                                                "StandaloneSessionClusterEntrypoint",
                                                [f"-Xmx{self.jobmanager_heap_mb}m"], conf, libs, java))
            for i in range(1, self.taskmanagers + 1):
                record(f"taskmanager-{i}", self._taskmanager(i, libs, java))
            if not self.jobmanager:
                artifact_port, expansion_port = free_port(), free_port()
                record("job-server", self._java(
                    "job-server", "org.apache.beam.runners.flink.FlinkJobServerDriver",
                    [f"-Xmx{self.job_server_heap_mb}m"],
                    ["--flink-master", f"{self.bind}:{self.rest_port}", "--flink-conf-dir", str(self.conf_dir),
                     "--job-host", self.bind, "--job-port", str(self.job_port), "--artifact-port", str(artifact_port),
                     "--expansion-port", str(expansion_port), "--artifacts-dir", str(self.data_dir / "artifacts")],
                    libs, java))
            self._await_ready(popens, pool_port, timeout_s)
            self._check_listeners(state["processes"])
        except BaseException:
            self.stop(quiet=True)
            raise
        state["complete"] = True
        state["start_seconds"] = round(time.monotonic() - t0, 1)
        self._write_state(state)
        if not quiet:
            pool_line = (f"  worker pool {state['worker_pool']} (python {sys.executable})\n" if self.taskmanagers
                         else "")
            if self.jobmanager:
                print(f"flink: {self.taskmanagers} TaskManager(s) x {self.slots} slot(s) on {self.bind} (Flink "
                      f"{FLINK_VERSION}) registered with the JobManager at {state['jobmanager']} in "
                      f"{state['start_seconds']:.1f} s\n{pool_line}  logs        {self.log_dir}", flush=True)
            else:
                join = (f"  TaskManagers of other hosts join with: flowtrain flink start --bind THEIR_ADDRESS "
                        f"--taskmanager-of {state['jobmanager']} --pool-port {pool_port}\n"
                        if self.bind != LOOPBACK else "")
                print(f"flink: session cluster (Flink {FLINK_VERSION}, Beam runner {BEAM_RUNNER_VERSION}) started in "
                      f"{state['start_seconds']:.1f} s: {self.taskmanagers} TaskManager(s) x {self.slots} slot(s)\n"
                      f"  REST        {state['rest']}\n  job server  {state['job_endpoint']}\n"
                      f"  JobManager  {state['jobmanager']} (RPC)\n{pool_line}{join}  logs        {self.log_dir}",
                      flush=True)
        return self.status() | {"start_seconds": state["start_seconds"]}

    def _taskmanager(self, i: int, libs: Path, java: str) -> dict:
        """Start TaskManager ``i`` (``taskmanager-<i>``) with the cluster's configuration."""
        tm_opts = [x for k, v in {"taskmanager.cpu.cores": self.slots,
                                  **self.memory.flink_options(self.slots)}.items() for x in ("-D", f"{k}={v}")]
        # resource ids name a TaskManager in the whole cluster: the host's address keeps them unique
        prefix = f"tm-{self.bind}-" if self.jobmanager else "tm-"
        return self._java(f"taskmanager-{i}", "org.apache.flink.runtime.taskexecutor.TaskManagerRunner",
                          self.memory.jvm_options(self.slots),
                          ["--configDir", str(self.conf_dir), *tm_opts, "-D", f"taskmanager.resource-id={prefix}{i}"],
                          libs, java)

    def _restart_dead_taskmanagers(self, *, timeout_s: float, quiet: bool) -> bool:
        """A started cluster of which only TaskManagers died (killed, or out of memory): start those again with the
        same configuration, the JobManager, the job server, the worker pool and the running jobs kept (a job that
        failed with them is the submitter's to run again). False when that is not the case (nothing recorded, or
        another process died: the caller starts the whole cluster anew)."""
        state = self._read_state()
        if not state or not state.get("complete"):
            return False
        dead = [name for name, p in state["processes"].items() if not _alive(p)]
        if not dead or not all(name.startswith("taskmanager-") for name in dead) or \
                (state.get("taskmanagers"), state.get("slots")) != (self.taskmanagers, self.slots):
            return False
        java = require_tool("java", "to run Flink", "Install a Java 11+ runtime.")
        popens, marks = {}, {}
        for name in dead:
            marks[name] = log_size(self.log_dir / f"{name}.log")
            proc = self._taskmanager(int(name.rsplit("-", 1)[1]), Path(state["jars"]), java)
            popens[name] = proc.pop("popen")
            state["processes"][name] = proc
        self._write_state(state)
        deadline = time.monotonic() + timeout_s
        while not all(logged(self.log_dir / f"{n}.log", "Successful registration at resource manager", marks[n])
                      for n in dead):
            for name, proc in popens.items():
                if proc.poll() is not None:
                    raise FlinkError(f"{name}, started again, exited with code {proc.returncode}; see "
                                     f"{self.log_dir}/{name}.log and .out:\n{self._tail(name)}")
            if time.monotonic() > deadline:
                raise FlinkError(f"{', '.join(dead)}, started again, did not register with the JobManager within "
                                 f"{timeout_s:.0f} s; logs in {self.log_dir}")
            time.sleep(0.5)
        if not quiet:
            print(f"flink: {', '.join(dead)} had stopped and started again (the JobManager, job server, worker pool "
                  f"and running jobs kept); logs {self.log_dir}", flush=True)
        return True

    def _await_ready(self, popens: dict[str, subprocess.Popen], pool_port: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        want = self.taskmanagers * self.slots
        registered = None
        while time.monotonic() < deadline:
            for name, proc in popens.items():
                if proc.poll() is not None:
                    raise FlinkError(f"the {name} process exited with code {proc.returncode} during start; see "
                                     f"{self.log_dir}/{name}.log and .out:\n{self._tail(name)}")
            pool_ready = not self.taskmanagers or port_open(pool_port)
            if self.jobmanager:  # no REST port known here: each TaskManager logs its registration
                registered = [i for i in range(1, self.taskmanagers + 1) if logged(
                    self.log_dir / f"taskmanager-{i}.log", "Successful registration at resource manager")]
                if len(registered) == self.taskmanagers and pool_ready:
                    return
            else:
                try:
                    registered = rest_json(self.rest_port, "/overview", timeout=2, host=self.bind)
                except (OSError, ValueError):
                    registered = None
                if (registered and registered.get("slots-total", 0) >= want
                        and port_open(self.job_port, self.bind) and pool_ready):
                    return
            time.sleep(0.5)
        if self.jobmanager:
            raise FlinkError(f"the TaskManagers on {self.bind} did not register with the JobManager at "
                             f"{self.jobmanager} within {timeout_s:.0f} s (registered: {registered}); is it running "
                             f"with --bind on that address, and reachable from here? Logs in {self.log_dir}")
        raise FlinkError(f"the Flink cluster was not ready within {timeout_s:.0f} s (REST overview: {registered}, "
                         f"job server port {self.job_port} open: {port_open(self.job_port, self.bind)}); logs in "
                         f"{self.log_dir}")

    def _check_listeners(self, processes: dict[str, dict]) -> None:
        """No process of the cluster listens on a wildcard address (0.0.0.0, ::), but an exposed job server."""
        names = {p["pid"]: name for name, p in processes.items()}
        wild = {f"{names[pid]} (pid {pid})": sorted({f"{a}:{port}" for a, port in addrs
                                                     if ipaddress.ip_address(a).is_unspecified})
                for pid, addrs in listening(names).items()
                if not (self.expose_job_server and names[pid] == "job-server")}
        wild = {name: addrs for name, addrs in wild.items() if addrs}
        if wild:
            raise FlinkError(f"listening on every interface, not only {self.bind}: "
                             + "; ".join(f"{name} on {', '.join(addrs)}" for name, addrs in wild.items())
                             + f" (the cluster was stopped; logs in {self.log_dir})")

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
        state = self._read_state()
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

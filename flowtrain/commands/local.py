"""``flowtrain kafka|flink|registry start|stop|status``: the options of each action (fields: flags, ``--config``
keys, ``--print-config``; ``connectors.fields``) and the actions themselves, on the local services of
``flowtrain.local.kafka``, ``flowtrain.local.flink`` and ``flowtrain.local.registry``.

``run_kafka(action, job)`` and ``run_flink(action, job)`` print what the commands print and return their exit
status: 0, 2 when the service failed (one line naming why), 3 from ``status`` when it (or a node) is down;
``run_registry(action, job)`` returns 1 from ``status`` when the registry does not run.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from connectors.fields import option, tailor
from flowtrain.commands.shared_options import Timeout
from flowtrain.local.flink import DIR_ENV, FlinkError, LocalFlink, TaskManagerMemory
from flowtrain.local.kafka import BrokerError, LocalKafka
from flowtrain.local.kafka.cluster import LocalKafkaCluster
from flowtrain.local.registry import LocalRegistry, RegistryError

_HOSTS = "across hosts (docs/cluster-rehearsal.md, \"Flink across hosts\")"
_MEMORY = "TaskManager memory (MiB; defaults in flowtrain.local.flink.TaskManagerMemory)"
_FLINK_DIR = ("config, logs, state and scratch files (default $FLOWTRAIN_FLINK_DIR or "
              "~/.cache/flowtrain/flink-cluster; --runner flink uses the same)")


# --- the sections every local service's actions share (each service tailors its own help and defaults; --timeout
# is shared_options.Timeout) ------------------------------------------------------------------------------------
@dataclass
class ServiceDir:
    """Where a local service keeps its state."""

    data_dir: str | None = option(None, "where the service keeps its config, state and logs")


@dataclass
class ServicePort:
    """The port a local service listens on (127.0.0.1)."""

    port: int | None = option(None, "its port on 127.0.0.1")


@dataclass
class StatusJson:
    """``status --json``."""

    json: bool = option(False, "status as one JSON object")


# --- Kafka ------------------------------------------------------------------------------------------------
@dataclass
@tailor(
        # each service has its own port: Kafka's client port
        port={"default": 9092, "help": "client port on 127.0.0.1 (with --brokers N: the first node's; node i listens "
                                       "on PORT+2i); the controller uses PORT+1 (default 9092)"},
        data_dir={"help": "where Kafka keeps its log segments, config and broker.log (default "
                          "~/.cache/flowtrain/kafka-data, with --brokers N ~/.cache/flowtrain/kafka-cluster)"})
class KafkaJob(ServiceDir, ServicePort):
    """The options of ``flowtrain kafka stop`` (and of every Kafka action): which broker or cluster."""

    brokers: int = option(1, "N > 1: a replicated cluster of N KRaft nodes; topics flowtrain creates get "
                             "replication min(3, N) and min.insync.replicas 2 (default 1: one broker)")


@dataclass
@tailor(timeout={"help": "seconds to wait for Kafka to answer a metadata request (default 90)"})
class KafkaStartJob(Timeout, KafkaJob):
    """The options of ``flowtrain kafka start``."""


@dataclass
class KafkaStatusJob(StatusJson, KafkaJob):
    """The options of ``flowtrain kafka status``."""


def run_kafka(action: str, job: KafkaJob) -> int:
    """``flowtrain kafka ACTION``: one broker, or with ``brokers`` > 1 a replicated KRaft cluster."""
    kwargs = {"port": job.port} | ({"data_dir": Path(job.data_dir)} if job.data_dir else {})
    try:
        if job.brokers != 1:
            return _kafka_action(action, job, LocalKafkaCluster(brokers=job.brokers, **kwargs), _cluster_status)
        return _kafka_action(action, job, LocalKafka(**kwargs), _broker_status)
    except BrokerError as err:
        print(f"flowtrain kafka {action}: {err}", file=sys.stderr)
        return 2


def _kafka_action(action: str, job, service, show) -> int:
    if action == "start":
        service.start(timeout_s=job.timeout)
    elif action == "stop":
        service.stop()
    else:
        status = service.status()
        if job.json:
            print(json.dumps(status))
        return show(status, job.json)
    return 0


def _broker_status(status: dict, quiet: bool) -> int:
    if quiet:
        return 0
    if status["running"]:
        print(f"kafka: running (pid {status['pid']}) on {status['bootstrap']}, Kafka {status['version']}, answers "
              f"metadata: {status['answers_metadata']}\n  data {status['data_dir']}\n  log  {status['log']}")
        return 0
    print(f"kafka: not running (data dir {status['data_dir']})")
    return 3


def _cluster_status(status: dict, quiet: bool) -> int:
    if not quiet:
        print(f"kafka: {status['running']} of {status['brokers']} broker(s) running, bootstrap "
              f"{status['bootstrap']}, Kafka {status['version']}, data {status['data_dir']}")
        for node in status["nodes"]:
            state = f"running (pid {node['pid']})" if node["running"] else "down"
            print(f"  node {node['node_id']}: {state} on {node['bootstrap']}, log {node['log']}")
    return 0 if status["running"] == status["brokers"] else 3


# --- Flink ------------------------------------------------------------------------------------------------
@dataclass
class FlinkCluster:
    """The session cluster ``flowtrain flink start`` starts: its processes, ports, hosts and memory."""

    taskmanagers: int = option(2, "TaskManager processes (default 2; 0 with --bind: only the JobManager and the job "
                                  "server, TaskManagers join from other hosts)")
    slots: int = option(1, "task slots per TaskManager (default 1); the default parallelism of a job is "
                           "TASKMANAGERS x SLOTS")
    rest_port: int = option(8081, "JobManager REST port (default 8081)")
    job_port: int = option(8099, "Beam job server port (default 8099)")
    bind: str = option("127.0.0.1", "this host's address: every Flink process and the job server listen on it and "
                                    "advertise it (default 127.0.0.1: nothing reachable from other hosts)",
                       metavar="ADDRESS", group=_HOSTS)
    taskmanager_of: str | None = option(
        None, "start only --taskmanagers TaskManagers and this host's worker pool, registering with the JobManager "
              "there (started elsewhere with --bind; it prints this address)", metavar="JM_ADDRESS:RPC_PORT",
        group=_HOSTS)
    rpc_port: int | None = option(None, "JobManager RPC port (default: a free one on 127.0.0.1, 6123 with --bind)",
                                  group=_HOSTS)
    pool_port: int | None = option(
        None, "the SDK worker pool's port on 127.0.0.1 of every TaskManager host; the same on all hosts (default: a "
              "free one on 127.0.0.1, 50000 with --bind or --taskmanager-of)", group=_HOSTS)
    parallelism: int | None = option(
        None, "the jobs' default parallelism (default TASKMANAGERS x SLOTS; required with --taskmanagers 0)",
        group=_HOSTS)
    expose_job_server: bool = option(
        False, "start Beam's job server even where it cannot be bound to --bind (no JDK to build flowtrain's bind "
               "patch of Beam, docs/cluster.md): it then listens on every interface, and anyone who reaches its port "
               "runs code as you", group=_HOSTS)
    task_heap_mb: int | None = option(None, "JVM heap for tasks (records on the Java side)", group=_MEMORY)
    managed_mb: int | None = option(None, "Flink managed memory (sort buffers of batch jobs: one record must fit one)",
                                    group=_MEMORY)
    task_off_heap_mb: int | None = option(None, "direct memory for tasks (Beam's gRPC data plane to the Python "
                                                "workers)", group=_MEMORY)


@dataclass
@tailor(
        # every TaskManager must register: longer than a broker's start (Timeout's 90 s)
        timeout={"default": 180.0, "help": "seconds to wait for every TaskManager to register (default 180)"},
        data_dir={"help": "config, logs, state and scratch files (default $FLOWTRAIN_FLINK_DIR or "
                          "~/.cache/flowtrain/flink-cluster; --runner flink uses the same)"})
class FlinkStartJob(Timeout, ServiceDir, FlinkCluster):
    """The options of ``flowtrain flink start``: the cluster, where it keeps its files, how long it may take."""



@dataclass
@tailor(
        # per process, after SIGTERM
        timeout={"default": 30.0, "help": "seconds each process has to end after SIGTERM before SIGKILL (default 30)"},
        data_dir={"help": "config, logs, state and scratch files (default $FLOWTRAIN_FLINK_DIR or "
                          "~/.cache/flowtrain/flink-cluster; --runner flink uses the same)"})
class FlinkStopJob(Timeout, ServiceDir):
    """The options of ``flowtrain flink stop``."""


@dataclass
@tailor(data_dir={"help": "config, logs, state and scratch files (default $FLOWTRAIN_FLINK_DIR or "
                          "~/.cache/flowtrain/flink-cluster; --runner flink uses the same)"})
class FlinkStatusJob(StatusJson, ServiceDir):
    """The options of ``flowtrain flink status``."""


def run_flink(action: str, job: FlinkStartJob | FlinkStopJob | FlinkStatusJob) -> int:
    """``flowtrain flink ACTION``: the local session cluster (``flowtrain.local.flink.LocalFlink``)."""
    kwargs = {}
    if action == "start":
        memory = {k: v for k, v in {"task_heap": job.task_heap_mb, "managed": job.managed_mb,
                                    "task_off_heap": job.task_off_heap_mb}.items() if v is not None}
        kwargs = {"taskmanagers": job.taskmanagers, "slots": job.slots, "rest_port": job.rest_port,
                  "job_port": job.job_port, "memory": TaskManagerMemory(**memory), "bind": job.bind,
                  "jobmanager": job.taskmanager_of, "rpc_port": job.rpc_port, "pool_port": job.pool_port,
                  "parallelism": job.parallelism, "expose_job_server": job.expose_job_server}
    if job.data_dir:
        kwargs["data_dir"] = job.data_dir
    try:
        cluster = LocalFlink(**kwargs)
        if action == "start":
            cluster.start(timeout_s=job.timeout)
            if job.data_dir:
                print(f"  use it: {DIR_ENV}={cluster.data_dir} flowtrain batch --runner flink ...")
        elif action == "stop":
            cluster.stop(timeout_s=job.timeout)
        else:
            status = cluster.status()
            if job.json:
                print(json.dumps(status))
                return 0
            return _flink_status(status)
    except FlinkError as err:
        print(f"flowtrain flink {action}: {err}", file=sys.stderr)
        return 2
    return 0


def _flink_status(status: dict) -> int:
    if not status["running"]:
        print(f"flink: not running (data dir {status['data_dir']})")
        return 3
    procs = ", ".join(f"{name} {p['pid']}" for name, p in status["processes"].items())
    if status["role"] == "taskmanagers":
        print(f"flink: running TaskManagers on {status['bind']} of the JobManager at {status['jobmanager']}\n"
              f"  worker pool {status['worker_pool']}\n  processes   {procs}\n  logs        {status['logs']}")
        return 0
    print(f"flink: running (Flink {status['versions']['flink']}, Beam runner {status['versions']['beam_runner']}), "
          f"{status.get('taskmanagers', '?')} TaskManager(s), {status.get('slots', '?')} slot(s) "
          f"({status.get('slots_available', '?')} free), {status.get('jobs_running', '?')} job(s) running\n"
          f"  REST        {status['rest']}\n  job server  {status['job_endpoint']}\n"
          f"  worker pool {status['worker_pool']}\n  processes   {procs}\n  logs        {status['logs']}")
    hosts = sorted({a.rsplit(":", 1)[0] for addrs in status["listening"].values() for a in addrs})
    ports = sum(len(addrs) for addrs in status["listening"].values())
    print(f"  listening   on {', '.join(hosts)} only ({ports} ports; --json lists them)")
    return 0


# --- Schema Registry (Apicurio) ---------------------------------------------------------------------------
@dataclass
@tailor(json={"help": "print the status as JSON"},
        port={"help": "HTTP port on 127.0.0.1 (default: the port the data dir's registry.json records, the one "
                      "started there; else 8081)"},
        data_dir={"help": "its state file and log (default ~/.cache/flowtrain/registry-data)"})
class RegistryJob(StatusJson, ServiceDir, ServicePort):
    """The options of ``flowtrain registry stop`` and ``status`` (and of every registry action)."""


@dataclass
@tailor(
        # the registry started listens on 8081 unless told (stop and status find it in its data dir's registry.json)
        port={"default": 8081, "help": "HTTP port on 127.0.0.1 (default 8081)"},
        # a JVM registry's start (Apicurio: ~4 s here, slower on a busy host)
        timeout={"default": 120.0, "help": "seconds to wait for it to answer (default 120)"})
class RegistryStartJob(Timeout, RegistryJob):
    """The options of ``flowtrain registry start``."""


def run_registry(action: str, job: RegistryJob) -> int:
    """``flowtrain registry ACTION``: a local Apicurio Registry (``flowtrain.local.registry.LocalRegistry``)."""
    # stop and status: the registry the data dir records (its port), unless --port names another
    reg = LocalRegistry.of(Path(job.data_dir) if job.data_dir else None, job.port)
    try:
        if action == "start":
            status = reg.start(timeout_s=job.timeout, quiet=job.json)
        elif action == "stop":
            reg.stop(quiet=job.json)
            status = reg.status()
        else:
            status = reg.status()
            if not job.json:
                print(f"registry: running (pid {status['pid']}) at {status['url']}, answers: {status['answers']}"
                      if status["running"] else f"registry: not running (data dir {status['data_dir']})")
    except RegistryError as err:
        print(f"flowtrain registry {action}: {err}", file=sys.stderr)
        return 2
    if job.json:
        print(json.dumps(status))
    return 0 if action != "status" or status["running"] else 1


#: Each command's actions and their options: ``{command: {action: job class}}``.
ACTIONS = {"kafka": {"start": KafkaStartJob, "stop": KafkaJob, "status": KafkaStatusJob},
           "flink": {"start": FlinkStartJob, "stop": FlinkStopJob, "status": FlinkStatusJob},
           "registry": {"start": RegistryStartJob, "stop": RegistryJob, "status": RegistryJob}}
RUN = {"kafka": run_kafka, "flink": run_flink, "registry": run_registry}

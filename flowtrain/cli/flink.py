"""``flowtrain flink start|stop|status``: a local Apache Flink session cluster for Beam pipelines,
and the ``--runner flink`` / ``--flink-master`` options of ``flowtrain batch`` and ``flowtrain stream``."""
from __future__ import annotations

import argparse
import json
import sys


def register(sub) -> None:
    p = sub.add_parser(
        "flink", help="start, stop or inspect a local Apache Flink cluster (JobManager, TaskManagers, Beam job server)",
        description="A Flink 1.19 session cluster on 127.0.0.1 (a JobManager and N TaskManagers; across hosts "
                    "with --bind and --taskmanager-of), Beam's Flink "
                    "job server and a worker pool for the Python SDK workers, from Maven jars resolved with mvn on "
                    "first use into ~/.cache/flowtrain/flink (or $FLOWTRAIN_CACHE). Then run pipelines there with "
                    "`flowtrain batch --runner flink` or `flowtrain stream pipeline --runner flink`.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=["start", "stop", "status"], help="start (no-op if running), stop, or status")
    p.add_argument("--taskmanagers", type=int, default=2, help="TaskManager processes (default 2; 0 with --bind: "
                   "only the JobManager and the job server, TaskManagers join from other hosts)")
    p.add_argument("--slots", type=int, default=1, help="task slots per TaskManager (default 1); the default "
                   "parallelism of a job is TASKMANAGERS x SLOTS")
    p.add_argument("--rest-port", type=int, default=8081, help="JobManager REST port (default 8081)")
    p.add_argument("--job-port", type=int, default=8099, help="Beam job server port (default 8099)")
    h = p.add_argument_group("across hosts (docs/cluster-rehearsal.md, \"Flink across hosts\")")
    h.add_argument("--bind", default="127.0.0.1", metavar="ADDRESS",
                   help="this host's address: every Flink process and the job server listen on it and advertise it "
                        "(default 127.0.0.1: nothing reachable from other hosts)")
    h.add_argument("--taskmanager-of", default=None, metavar="JM_ADDRESS:RPC_PORT",
                   help="start only --taskmanagers TaskManagers and this host's worker pool, registering with the "
                        "JobManager there (started elsewhere with --bind; it prints this address)")
    h.add_argument("--rpc-port", type=int, default=None,
                   help="JobManager RPC port (default: a free one on 127.0.0.1, 6123 with --bind)")
    h.add_argument("--pool-port", type=int, default=None,
                   help="the SDK worker pool's port on 127.0.0.1 of every TaskManager host; the same on all hosts "
                        "(default: a free one on 127.0.0.1, 50000 with --bind or --taskmanager-of)")
    h.add_argument("--parallelism", type=int, default=None,
                   help="the jobs' default parallelism (default TASKMANAGERS x SLOTS; required with --taskmanagers 0)")
    m = p.add_argument_group("TaskManager memory (MiB; defaults in flowtrain.local.flink.TaskManagerMemory)")
    m.add_argument("--task-heap-mb", type=int, default=None, help="JVM heap for tasks (records on the Java side)")
    m.add_argument("--managed-mb", type=int, default=None,
                   help="Flink managed memory (sort buffers of batch jobs: one record must fit one)")
    m.add_argument("--task-off-heap-mb", type=int, default=None,
                   help="direct memory for tasks (Beam's gRPC data plane to the Python workers)")
    p.add_argument("--data-dir", default=None, help="config, logs, state and scratch files (default "
                   "$FLOWTRAIN_FLINK_DIR or ~/.cache/flowtrain/flink-cluster; --runner flink uses the same)")
    p.add_argument("--timeout", type=float, default=180.0,
                   help="seconds to wait for every TaskManager to register (default 180)")
    p.add_argument("--json", action="store_true", help="status as one JSON object")
    p.set_defaults(func=_flink)


def _flink(args: argparse.Namespace) -> int:
    from flowtrain.local.flink import DIR_ENV, FlinkError, LocalFlink, TaskManagerMemory

    memory = {k: v for k, v in {"task_heap": args.task_heap_mb, "managed": args.managed_mb,
                                "task_off_heap": args.task_off_heap_mb}.items() if v is not None}
    kwargs = {"taskmanagers": args.taskmanagers, "slots": args.slots, "rest_port": args.rest_port,
              "job_port": args.job_port, "memory": TaskManagerMemory(**memory), "bind": args.bind,
              "jobmanager": args.taskmanager_of, "rpc_port": args.rpc_port, "pool_port": args.pool_port,
              "parallelism": args.parallelism}
    if args.data_dir:
        kwargs["data_dir"] = args.data_dir
    try:
        cluster = LocalFlink(**kwargs)
        if args.action == "start":
            cluster.start(timeout_s=args.timeout)
            if args.data_dir:
                print(f"  use it: {DIR_ENV}={cluster.data_dir} flowtrain batch --runner flink ...")
        elif args.action == "stop":
            cluster.stop()
        else:
            status = cluster.status()
            if args.json:
                print(json.dumps(status))
            elif status["running"] and status["role"] == "taskmanagers":
                procs = ", ".join(f"{name} {p['pid']}" for name, p in status["processes"].items())
                print(f"flink: running TaskManagers on {status['bind']} of the JobManager at {status['jobmanager']}\n"
                      f"  worker pool {status['worker_pool']}\n  processes   {procs}\n  logs        {status['logs']}")
            elif status["running"]:
                procs = ", ".join(f"{name} {p['pid']}" for name, p in status["processes"].items())
                print(f"flink: running (Flink {status['versions']['flink']}, Beam runner "
                      f"{status['versions']['beam_runner']}), {status.get('taskmanagers', '?')} TaskManager(s), "
                      f"{status.get('slots', '?')} slot(s) ({status.get('slots_available', '?')} free), "
                      f"{status.get('jobs_running', '?')} job(s) running\n"
                      f"  REST        {status['rest']}\n  job server  {status['job_endpoint']}\n"
                      f"  worker pool {status['worker_pool']}\n  processes   {procs}\n  logs        {status['logs']}")
            else:
                print(f"flink: not running (data dir {status['data_dir']})")
                return 3
    except FlinkError as err:
        print(f"flowtrain flink {args.action}: {err}", file=sys.stderr)
        return 2
    return 0


def with_runner(args: argparse.Namespace, beam_args: list[str], command: str) -> list[str]:
    """``beam_args`` with the Beam options that ``--runner`` / ``--flink-master`` stand for in front."""
    from flowtrain.local.runners import RunnerError, runner_args

    try:
        return runner_args(getattr(args, "runner", None), getattr(args, "flink_master", None), beam_args) + beam_args
    except RunnerError as err:
        raise SystemExit(f"flowtrain {command}: {err}") from None

"""``flowtrain kafka start|stop|status`` and ``flowtrain flink start|stop|status``: each action's flags are the
fields of its job (``flowtrain.commands.local``), which runs it."""
from __future__ import annotations

import argparse

from connectors.fields import build
from flowtrain.cli.options import add_fields, print_config
from flowtrain.commands.local import ACTIONS, RUN

_KAFKA_JARS = ("The jars are fetched from Maven Central with mvn on first use into ~/.cache/flowtrain/kafka "
               "(or $FLOWTRAIN_CACHE).")
_KAFKA_SAME = "the same --port, --data-dir and --brokers"
#: command -> (help, description, {action: (help, description)})
_TEXTS = {
    "kafka": (
        "start, stop or inspect a local Apache Kafka (KRaft, 127.0.0.1): one broker or a replicated cluster "
        "(--brokers N)",
        "A real Apache Kafka on 127.0.0.1 from the Apache jars: one KRaft broker, or with --brokers N a replicated "
        "cluster of N nodes. `flowtrain kafka ACTION --help`: that action's options. " + _KAFKA_JARS,
        {"start": ("start the broker (or the --brokers N nodes) and wait until it answers; nothing to do when it runs",
                   "Starts a real Apache Kafka on 127.0.0.1 and returns once it answers a metadata request: one KRaft "
                   "broker, or with --brokers N > 1 a replicated cluster of N nodes (broker + controller each). "
                   "Nothing to do when it already runs. " + _KAFKA_JARS),
         "stop": ("stop the broker (or the --brokers N nodes) started from --data-dir",
                  f"Stops the Kafka started by `flowtrain kafka start` with {_KAFKA_SAME}."),
         "status": ("is it running, where, which version (exit status 3 when not)",
                    f"Prints whether the Kafka of `flowtrain kafka start` ({_KAFKA_SAME}) runs, on which address, "
                    f"its version and log; exit status 3 when it (or one of its nodes) is down.")}),
    "flink": (
        "start, stop or inspect a local Apache Flink cluster (JobManager, TaskManagers, Beam job server)",
        "A Flink 1.19 session cluster on 127.0.0.1 (a JobManager and N TaskManagers; across hosts with --bind and "
        "--taskmanager-of), Beam's Flink job server and a worker pool for the Python SDK workers, from Maven jars "
        "resolved with mvn on first use into ~/.cache/flowtrain/flink (or $FLOWTRAIN_CACHE). Then run pipelines "
        "there with `flowtrain batch --runner flink` or `flowtrain stream pipeline --runner flink`. "
        "`flowtrain flink ACTION --help` shows each action's options.",
        {"start": ("start the cluster (no-op if it runs already)",
                   "Start a JobManager, TASKMANAGERS TaskManagers, Beam's Flink job server and a worker pool for the "
                   "Python SDK workers (no-op when the cluster in --data-dir runs already). Every process listens on "
                   "127.0.0.1 only, unless --bind names this host's address for a cluster across hosts "
                   "(docs/security.md lists each listener)."),
         "stop": ("stop every process of the cluster",
                  "Stop every process recorded in --data-dir's cluster.json (SIGTERM, then SIGKILL after --timeout); "
                  "a pid the kernel gave to another process is left alone."),
         "status": ("whether it runs: addresses, processes, slots, jobs, logs",
                    "Whether the cluster in --data-dir runs: its REST address, job server, worker pool, processes, "
                    "slots and running jobs, logs. Exit status 3 when it does not run.")}),
}


def register_kafka(sub) -> None:
    _register(sub, "kafka")


def register_flink(sub) -> None:
    _register(sub, "flink")


def _register(sub, command: str) -> None:
    """``flowtrain COMMAND ACTION``: each action its own parser, its flags the fields of its job."""
    text, description, actions = _TEXTS[command]
    p = sub.add_parser(command, help=text, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    choices = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    for action, (action_help, action_description) in actions.items():
        a = choices.add_parser(action, help=action_help, description=action_description)
        add_fields(a, ACTIONS[command][action])
        a.set_defaults(func=_run, options_parser=a, job_class=ACTIONS[command][action])


def _run(args: argparse.Namespace) -> int:
    job = build(args.job_class, args.options)
    if args.print_config:
        print_config(job)
        return 0
    return RUN[args.command](args.action, job)

"""The ``flowtrain`` command line.

Each command's work lives in its own module and is imported only when that command runs, so
``flowtrain --help`` answers at once instead of importing Beam and torch.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path


def _kafka(args: argparse.Namespace) -> int:
    from flowtrain.local.kafka import BrokerError, LocalKafka

    broker_kwargs = {"port": args.port}
    if args.data_dir:
        broker_kwargs["data_dir"] = Path(args.data_dir)
    if args.brokers != 1:
        return _kafka_cluster(args, broker_kwargs)
    broker = LocalKafka(**broker_kwargs)
    try:
        if args.action == "start":
            broker.start(timeout_s=args.timeout)
        elif args.action == "stop":
            broker.stop()
        else:
            status = broker.status()
            if args.json:
                print(json.dumps(status))
            elif status["running"]:
                print(f"kafka: running (pid {status['pid']}) on {status['bootstrap']}, "
                      f"Kafka {status['version']}, answers metadata: {status['answers_metadata']}\n"
                      f"  data {status['data_dir']}\n  log  {status['log']}")
            else:
                print(f"kafka: not running (data dir {status['data_dir']})")
                return 3
    except BrokerError as err:
        print(f"flowtrain kafka {args.action}: {err}", file=sys.stderr)
        return 2
    return 0


def _kafka_cluster(args: argparse.Namespace, cluster_kwargs: dict) -> int:
    """``flowtrain kafka ACTION --brokers N``: a replicated KRaft cluster (flowtrain.local.kafka.cluster)."""
    from flowtrain.local.kafka import BrokerError
    from flowtrain.local.kafka.cluster import LocalKafkaCluster

    try:
        cluster = LocalKafkaCluster(brokers=args.brokers, **cluster_kwargs)
        if args.action == "start":
            cluster.start(timeout_s=args.timeout)
        elif args.action == "stop":
            cluster.stop()
        else:
            status = cluster.status()
            if args.json:
                print(json.dumps(status))
            else:
                print(f"kafka: {status['running']} of {status['brokers']} broker(s) running, bootstrap "
                      f"{status['bootstrap']}, Kafka {status['version']}, data {status['data_dir']}")
                for node in status["nodes"]:
                    state = f"running (pid {node['pid']})" if node["running"] else "down"
                    print(f"  node {node['node_id']}: {state} on {node['bootstrap']}, log {node['log']}")
            return 0 if status["running"] == status["brokers"] else 3
    except BrokerError as err:
        print(f"flowtrain kafka {args.action}: {err}", file=sys.stderr)
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flowtrain",
        description="Train PyTorch models straight from Apache Beam dataflows.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    from flowtrain import __version__

    parser.add_argument("--version", action="version", version=f"flowtrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    kafka = sub.add_parser(
        "kafka", help="start, stop or inspect a local Apache Kafka broker (KRaft, 127.0.0.1)",
        description="A real single-node Apache Kafka broker on 127.0.0.1. The jars are fetched "
                    "from Maven Central with mvn on first use into ~/.cache/flowtrain/kafka "
                    "(or $FLOWTRAIN_CACHE).")
    kafka.add_argument("action", choices=["start", "stop", "status"],
                       help="start (no-op if running), stop, or status")
    kafka.add_argument("--port", type=int, default=9092,
                       help="client port on 127.0.0.1; the controller uses PORT+1 (default 9092)")
    kafka.add_argument("--data-dir", default=None,
                       help="where the broker keeps its log segments, config and broker.log "
                            "(default ~/.cache/flowtrain/kafka-data)")
    kafka.add_argument("--timeout", type=float, default=90.0,
                       help="seconds to wait for the broker to answer a metadata request (default 90)")
    kafka.add_argument("--json", action="store_true", help="status as one JSON object")
    kafka.add_argument("--brokers", type=int, default=1,
                       help="N > 1: a replicated cluster of N KRaft nodes (broker + controller each) on ports "
                            "PORT, PORT+2, ...; topics flowtrain creates get replication min(3, N) and "
                            "min.insync.replicas 2 (default 1: one broker; data default "
                            "~/.cache/flowtrain/kafka-cluster)")
    kafka.set_defaults(func=_kafka)

    for register in _command_registrars():
        register(sub)
    return parser


def _command_registrars():
    """Commands with their own modules; each adds its sub-parser (and imports its work lazily)."""
    from flowtrain.cli import batch, bench, compare, flink, predict, stream

    return [batch.register, predict.register, bench.register, flink.register, stream.register, compare.register]


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str] | None]:
    """The command line as the command will see it: ``(args, beam_args)``, where ``beam_args`` is
    None for commands that take no Beam options. ``args.options`` holds what --config or the
    command line set. A bad option exits with status 2 and a message naming it."""
    from flowtrain.cli import options

    ours, passthrough = options.split_passthrough(argv)  # after `--`: Beam's, unchecked
    parser = build_parser()
    args, unknown = parser.parse_known_args(ours, namespace=argparse.Namespace())
    sub = getattr(args, "options_parser", None) or parser
    try:
        if getattr(args, "options_parser", None) is not None:
            # --config YAML under the command line; args then holds every option's value
            args.options = options.resolve(parser, args, ours)
        if getattr(args, "accepts_beam_args", False):
            # Options flowtrain does not know must be Beam pipeline options (--runner=..., --flink_master=...).
            options.check_beam_args(unknown, [s for a in sub._actions for s in a.option_strings])
            return args, unknown + passthrough
    except options.OptionError as err:
        sub.error(str(err))
    if unknown or passthrough:
        sub.error(f"unrecognized arguments: {' '.join(unknown + passthrough)}")
    return args, None


def _drop_import_noise(record: logging.LogRecord) -> bool:
    """Beam's BigQuery client package warns on import, through the root logger, that apitools is
    missing (flowtrain uses no BigQuery): that line would come before every error message."""
    return not str(record.msg).startswith("apitools not found")


def main(argv: list[str] | None = None) -> int:
    logging.getLogger().addFilter(_drop_import_noise)
    args, beam_args = parse(list(sys.argv[1:] if argv is None else argv))
    from flowtrain.errors import FlowtrainError

    try:
        if beam_args is None:
            return int(args.func(args) or 0)
        return int(args.func(args, beam_args) or 0)
    except FlowtrainError as err:  # a user's error: one line naming the input and the fix
        print(f"flowtrain {args.command}: {err}", file=sys.stderr)
        return 2


def entry() -> None:
    """The process entry point (the ``flowtrain`` command, ``python -m flowtrain.cli``).

    A command that failed with its one-line message runs the exit handlers (Beam's stop the
    runner and job-server processes it started, flowtrain's close Kafka clients) and then ends
    without the rest of the interpreter's teardown: a native thread that torch or Beam's gRPC
    started could otherwise abort the process while it is destroyed ("terminate called without
    an active exception", SIGABRT, seen after a schema error), turning exit status 2 into a crash."""
    code = main()
    if code:
        import atexit

        atexit._run_exitfuncs()  # the documented handlers, in their order (CPython's own exit runs them too)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(0)


if __name__ == "__main__":
    entry()

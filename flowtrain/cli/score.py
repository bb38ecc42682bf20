"""``flowtrain stream score`` (the scoring pipeline) and ``flowtrain stream --score`` (all three halves).

Its options are fields of ``flowtrain.commands.stream`` (``ScoreOptions``); Beam, torch and Kafka load only when
a command runs.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from flowtrain.cli.options import kafka_config
from flowtrain.cli.stream_status import JOB_PART_ENV
from flowtrain.commands.stream_inputs import dataset_path, enrichment, raw_partitions, stream_manifest


def update_key_source(args, command: str):
    """``--update-key-file`` or ``$FLOWTRAIN_UPDATE_KEY`` (checked now: a bad key stops the command),
    else None with a loud warning: model versions are then not authenticated."""
    from connectors.model_updates import UPDATE_KEY_ENV, UpdateKeySource

    source = UpdateKeySource.from_options(args.update_key_file)
    if source is None:
        print(f"{command}: WARNING: model updates are NOT authenticated (no --update-key-file, no "
              f"${UPDATE_KEY_ENV}): any producer on the updates topic can make this scorer load its file",
              file=sys.stderr, flush=True)
        return None
    try:
        source.load()
    except ValueError as err:
        raise SystemExit(f"{command}: {err}") from None
    return source


def scoring_config(args, *, beam_status: str | None = None, enrichment=None):
    """A ``ScoreConfig`` from the command line (waits for the first valid model version).

    ``enrichment``: a picklable factory of the domain's enrichment step (the flights' join), else
    the events hold the dataset's own columns."""
    from connectors.dataset import read_manifest
    from flowtrain.train.loader import TabularDataset, target_scale
    from flowtrain.train.published import LoadPublishedVersion
    from pipelines.serving.config import ScoreConfig
    from pipelines.serving.versions import wait_for_version
    from pipelines.stream.events import ParseBounds

    command = "flowtrain stream score"
    dataset = dataset_path(args)
    data = TabularDataset(dataset)
    cfg = ScoreConfig(
        bootstrap=args.bootstrap, load_version=LoadPublishedVersion(dataset, max_bytes=args.max_model_bytes),
        spec=data.spec, stats=read_manifest(dataset)["stats"], enrichment=enrichment, id_column=args.id_column,
        raw_topic=args.raw_topic, predictions_topic=args.predictions_topic,
        dead_letter_topic=args.score_dead_letter_topic, updates_topic=args.updates_topic,
        group_id=args.score_group_id, batch_size=args.score_batch_size, max_delay_s=args.score_max_delay,
        swap_interval_s=args.swap_interval, kafka_config=kafka_config(args.kafka_config, args.kafka_config_file),
        status_path=beam_status,
        target_scale=target_scale(data) if data.spec.task == "regression" else (0.0, 1.0),
        classes=list(data.classes) if data.spec.task == "classification" else None,
        bounds=ParseBounds(max_event_bytes=args.max_event_bytes, max_depth=args.max_json_depth,
                           max_abs_number=args.max_abs_number),
        update_key=update_key_source(args, command), model_cache_dir=str(Path(args.out).resolve() / "models"),
        keep_models=args.keep_models, max_model_bytes=args.max_model_bytes)
    print(f"stream score: waiting for a valid model version on {args.updates_topic} "
          f"(up to {args.wait_model:.0f} s)", flush=True)
    try:
        first, tracker = wait_for_version(cfg, timeout_s=args.wait_model)
    except (TimeoutError, ValueError) as err:
        raise SystemExit(f"{command}: {err}") from None
    for r in tracker.rejected:
        print(f"stream score: rejected version {r['version']} ({r['published_at']}): {r['reason']}", flush=True)
    print(f"stream score: starting with model version {first.version} of run {first.run_id or '(unnamed)'} "
          f"({first.path})", flush=True)
    cfg.initial_model = first.model_id()
    return cfg


def run_scorer(args, beam_args: list[str]) -> int:
    """``flowtrain stream score``: run the scoring pipeline until Ctrl-C / SIGTERM."""
    import logging

    import apache_beam as beam

    from connectors.kafka import close_all_clients, ensure_topic
    from flowtrain.local.runners import pipeline_options
    from pipelines.flights.status import clear_status
    from pipelines.serving.scoring import build_scoring_pipeline

    # Rejected versions and swaps are logged by the pipeline: show them (Beam set up the root logger).
    serving_log = logging.getLogger("pipelines.serving")
    serving_log.setLevel(logging.INFO)
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("stream score: %(levelname)s %(message)s"))
    serving_log.addHandler(handler)
    serving_log.propagate = False

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kcfg = kafka_config(args.kafka_config, args.kafka_config_file)
    raw_parts = raw_partitions(args.bootstrap, args.raw_topic, kcfg)
    rf = {"replication_factor": args.replication_factor}
    for topic in (args.predictions_topic, args.score_dead_letter_topic):
        ensure_topic(args.bootstrap, topic, partitions=raw_parts, client_config=kcfg, **rf)
    ensure_topic(args.bootstrap, args.updates_topic, client_config=kcfg, **rf)
    clear_status(str(out / "score-status.json"))  # counters of an earlier run: the live line counts this run's
    scfg = scoring_config(args, beam_status=str(out / "score-status.json"),
                          enrichment=enrichment(args, stream_manifest(args)))
    p = beam.Pipeline(options=pipeline_options("streaming", beam_args))
    build_scoring_pipeline(p, scfg)
    from flowtrain.local.processes import StopSignals

    stop = StopSignals().install()  # SIGINT/SIGTERM/SIGHUP: cancel the pipeline (installed before the runner starts)
    result = p.run()
    print(f"stream score: {args.raw_topic} -> RunInference -> {args.predictions_topic} "
          f"(+ {args.score_dead_letter_topic}), versions from {args.updates_topic} every "
          f"{args.swap_interval:g} s, group {args.score_group_id}; Ctrl-C stops", flush=True)
    from connectors.atomic import atomic_write
    from flowtrain.local.runners import beam_counters, watch_pipeline
    from pipelines.serving.predictions import METRICS_NAMESPACE

    def save_metrics() -> None:  # the runner's own counts (Beam Metrics) every 5 s, beside the status files
        counts = beam_counters(result, METRICS_NAMESPACE)
        atomic_write(out / "score-metrics.json", json.dumps({"namespace": METRICS_NAMESPACE, "counters": counts}))

    state, code = watch_pipeline(result, p.options, stop, what="stream score", every=save_metrics)
    if state not in ("CANCELLED", "RUNNING"):
        print(f"stream score: ended in state {state}", file=sys.stderr, flush=True)
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
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from flowtrain.cli.stream_status import (
        CHILD_ARGS,
        live_line,
        process_states,
        serve_stream_status,
        stop_stream_status,
    )

    procs = {}  # --metrics-port: this process serves the whole job's /metrics and status page
    status = serve_stream_status(args, process_states(procs), title="flowtrain stream")
    common = [a for a in sys.argv[2:] if a not in ("pipeline", "train", "score", "--local-kafka", "--score")]
    common += CHILD_ARGS
    base = [sys.executable, "-m", "flowtrain.cli", "stream"]
    from flowtrain.local.processes import supervise

    last = [(time.monotonic(), 0)]

    def report() -> None:
        line, last[0] = live_line(args, out, last[0])
        print(f"{line} | {serving_line(out)}", flush=True)

    os.environ[JOB_PART_ENV] = "1"  # the parts inherit it: this job wrote config.json
    try:  # children that end with this process; SIGINT/SIGTERM/SIGHUP stop them (SIGINT: each stops its
        # runner / writes its checkpoint), SIGKILL after 60 s
        codes = supervise({half: (base + [half] + common, out / log) for half, log in (
            ("pipeline", "pipeline.log"), ("train", "trainer.log"), ("score", "scorer.log"))},
            report=report, procs=procs)
    finally:
        stop_stream_status(status)
        os.environ.pop(JOB_PART_ENV, None)
    print(f"stream: stopped ({', '.join(f'{half} {code}' for half, code in codes.items())}); logs in {out}")
    return 0 if all(code == 0 for code in codes.values()) else 1  # a half failing on its way out fails

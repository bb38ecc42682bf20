"""``flowtrain stream score`` as a Python call: the scoring pipeline of a ``StreamScoreJob``.

``run_score(job, beam_args, should_stop=...)`` waits for the first authenticated model version on the
updates topic, then runs Beam ``RunInference`` over the raw topic until ``should_stop()``; predictions
and dead letters go to their topics, counters to ``<out>/score-status.json.*`` and the runner's Beam
metrics to ``<out>/score-metrics.json``. A bad option, key or dataset: ``FlowtrainError``.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from flowtrain.commands.kafka_options import kafka_config
from flowtrain.commands.stream import StreamJob, StreamScoreJob
from flowtrain.commands.stream_inputs import dataset_path, enrichment, raw_partitions, stream_manifest
from flowtrain.errors import FlowtrainError


def update_key_source(job, command: str):
    """``--update-key-file`` or ``$FLOWTRAIN_UPDATE_KEY`` (checked now: a bad key stops the command),
    else None with a loud warning: model versions are then not authenticated."""
    from connectors.model_updates import UPDATE_KEY_ENV, UpdateKeySource

    source = UpdateKeySource.from_options(job.update_key_file)
    if source is None:
        print(f"{command}: WARNING: model updates are NOT authenticated (no --update-key-file, no "
              f"${UPDATE_KEY_ENV}): any producer on the updates topic can make this scorer load its file",
              file=sys.stderr, flush=True)
        return None
    try:
        source.load()
    except ValueError as err:
        raise FlowtrainError(str(err)) from None
    return source


def scoring_config(job, *, beam_status: str | None = None, enrichment=None):
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
    dataset = dataset_path(job)
    data = TabularDataset(dataset)
    cfg = ScoreConfig(
        bootstrap=job.bootstrap, load_version=LoadPublishedVersion(dataset, max_bytes=job.max_model_bytes),
        spec=data.spec, stats=read_manifest(dataset)["stats"], enrichment=enrichment, id_column=job.id_column,
        raw_topic=job.raw_topic, predictions_topic=job.predictions_topic,
        dead_letter_topic=job.score_dead_letter_topic, updates_topic=job.updates_topic,
        group_id=job.score_group_id, batch_size=job.score_batch_size, max_delay_s=job.score_max_delay,
        swap_interval_s=job.swap_interval, kafka_config=kafka_config(job.kafka_config, job.kafka_config_file),
        status_path=beam_status,
        target_scale=target_scale(data) if data.spec.task == "regression" else (0.0, 1.0),
        classes=list(data.classes) if data.spec.task == "classification" else None,
        bounds=ParseBounds(max_event_bytes=job.max_event_bytes, max_depth=job.max_json_depth,
                           max_abs_number=job.max_abs_number),
        update_key=update_key_source(job, command), model_cache_dir=str(Path(job.out).resolve() / "models"),
        keep_models=job.keep_models, max_model_bytes=job.max_model_bytes)
    print(f"stream score: waiting for a valid model version on {job.updates_topic} "
          f"(up to {job.wait_model:.0f} s)", flush=True)
    try:
        first, tracker = wait_for_version(cfg, timeout_s=job.wait_model)
    except (TimeoutError, ValueError) as err:
        raise FlowtrainError(str(err)) from None
    for r in tracker.rejected:
        print(f"stream score: rejected version {r['version']} ({r['published_at']}): {r['reason']}", flush=True)
    print(f"stream score: starting with model version {first.version} of run {first.run_id or '(unnamed)'} "
          f"({first.path})", flush=True)
    cfg.initial_model = first.model_id()
    return cfg


def run_score(job: StreamScoreJob | StreamJob, beam_args: Sequence[str] = (), *,
              should_stop: Callable[[], bool]) -> int:
    """Run the scoring pipeline of ``job`` (a ``StreamScoreJob``, or a whole ``StreamJob``) until
    ``should_stop()`` (the command line passes its Ctrl-C / SIGTERM flag; install it before calling:
    the runner starts here) or the runner ends; returns the exit code (1: the runner failed, or a Flink
    job could not be cancelled)."""
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

    out = Path(job.out)
    out.mkdir(parents=True, exist_ok=True)
    kcfg = kafka_config(job.kafka_config, job.kafka_config_file)
    raw_parts = raw_partitions(job.bootstrap, job.raw_topic, kcfg)
    rf = {"replication_factor": job.replication_factor}
    for topic in (job.predictions_topic, job.score_dead_letter_topic):
        ensure_topic(job.bootstrap, topic, partitions=raw_parts, client_config=kcfg, **rf)
    ensure_topic(job.bootstrap, job.updates_topic, client_config=kcfg, **rf)
    clear_status(str(out / "score-status.json"))  # counters of an earlier run: the live line counts this run's
    scfg = scoring_config(job, beam_status=str(out / "score-status.json"),
                          enrichment=enrichment(job, stream_manifest(job)))
    p = beam.Pipeline(options=pipeline_options("streaming", list(beam_args)))
    build_scoring_pipeline(p, scfg)
    result = p.run()
    print(f"stream score: {job.raw_topic} -> RunInference -> {job.predictions_topic} "
          f"(+ {job.score_dead_letter_topic}), versions from {job.updates_topic} every "
          f"{job.swap_interval:g} s, group {job.score_group_id}; Ctrl-C stops", flush=True)
    from connectors.atomic import atomic_write
    from flowtrain.local.runners import beam_counters, watch_pipeline
    from pipelines.serving.predictions import METRICS_NAMESPACE

    def save_metrics() -> None:  # the runner's own counts (Beam Metrics) every 5 s, beside the status files
        counts = beam_counters(result, METRICS_NAMESPACE)
        atomic_write(out / "score-metrics.json", json.dumps({"namespace": METRICS_NAMESPACE, "counters": counts}))

    state, code = watch_pipeline(result, p.options, should_stop, what="stream score", every=save_metrics)
    if state not in ("CANCELLED", "RUNNING"):
        print(f"stream score: ended in state {state}", file=sys.stderr, flush=True)
    close_all_clients()
    print("stream score: stopped", flush=True)
    return code


# ---------------------------------------------------------------------------------------------

"""``flowtrain stream score`` as a Python call: the scoring pipeline of a ``StreamScoreJob``.

``run_score(job, beam_args, should_stop=...)`` waits for the first authenticated model version on the
updates topic, then runs Beam ``RunInference`` over the raw topic until ``should_stop()``; predictions
and dead letters go to their topics, counters to ``<out>/score-status.json.*`` and the runner's Beam
metrics to ``<out>/score-metrics.json``. A bad option, key or dataset: ``FlowtrainError``.
"""
from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from connectors.atomic import atomic_write
from connectors.dataset import read_manifest
from connectors.fields import options_of
from connectors.kafka import Topics, ensure_topic
from connectors.model_updates import UPDATE_KEY_ENV, UpdateKeySource
from flowtrain.commands.drift.job import load_reference
from flowtrain.commands.kafka_options import kafka_target
from flowtrain.commands.stream.driver import drive, not_committed, registry_ready
from flowtrain.commands.stream.inputs import dataset_path, enrichment, over_time, raw_partitions, stream_manifest
from flowtrain.commands.stream.options import StreamJob, StreamScoreJob, with_dataset_topics
from flowtrain.errors import FlowtrainError
from flowtrain.train.bundle import read_bundle
from flowtrain.train.loader import TabularDataset, target_scale
from flowtrain.train.published import LoadPublishedVersion
from flowtrain.train.rundir.files import RunFiles
from pipelines.drift.measures import parse_thresholds
from pipelines.drift.profile import check_profile, read_train_sample, reference_profile
from pipelines.serving.config import ScoreConfig
from pipelines.serving.drift import DRIFT_REFERENCE, DriftConfig
from pipelines.serving.predictions import METRICS_NAMESPACE
from pipelines.serving.scoring import build_scoring_pipeline
from pipelines.serving.updates import wait_for_version
from pipelines.stream.events import SOURCE_COLUMNS


def update_key_source(job, command: str):
    """``--update-key-file`` or ``$FLOWTRAIN_UPDATE_KEY`` (checked now: a bad key stops the command),
    else None with a loud warning: model versions are then not authenticated."""
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

    ``enrichment``: a picklable factory of the domain's enrichment step (its dataset preset's), else
    the events hold the dataset's own columns."""
    command = "flowtrain stream score"
    job = with_dataset_topics(job)  # topics left unset: named after the dataset
    if job.id_column in SOURCE_COLUMNS:  # the stream's own names for the event's position
        raise FlowtrainError(f"{command} --id-column {job.id_column}: the stream keeps each event's position in "
                             f"{', '.join(SOURCE_COLUMNS)}, so no event field can have that name; give the id "
                             f"another field name")
    dataset = dataset_path(job)
    data = TabularDataset(dataset)
    options = {o.name: getattr(job, o.name) for o in options_of(ScoreConfig)}  # the options, as given
    options["feature_state"] = options["feature_state"] or str(Path(job.out).resolve() / "feature-state")
    options = over_time(options, read_manifest(dataset), dataset)  # else the dataset's own declaration
    cfg = ScoreConfig(
        **options, kafka=kafka_target(job), feature_kinds=(read_manifest(dataset).get("features") or {}).get("kinds"),
        topics=Topics(raw=job.raw_topic, predictions=job.predictions_topic, dead_letters=job.score_dead_letter_topic,
                      updates=job.updates_topic, drift=getattr(job, "drift_topic", None)),
        load_version=LoadPublishedVersion(dataset, max_bytes=job.max_model_bytes), spec=data.spec,
        stats=read_manifest(dataset)["stats"], enrichment_factory=enrichment,
        status_path=beam_status, target_scale=target_scale(data) if data.spec.task == "regression" else (0.0, 1.0),
        classes=list(data.classes) if data.spec.task == "classification" else None,
        update_key=update_key_source(job, command), model_cache_dir=str(Path(job.out).resolve() / "models"),
        drift=drift_config(job, data, dataset, beam_status))
    print(f"stream score: waiting for a valid model version on {job.updates_topic} "
          f"(up to {job.wait_model:.0f} s)", flush=True)
    try:
        first, tracker = wait_for_version(cfg, timeout_s=job.wait_model)
    except (TimeoutError, ValueError) as err:
        raise FlowtrainError(str(err)) from None
    if tracker.rejected_count:  # each kind's first was logged with its reason
        kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(tracker.rejected_kinds.items()))
        print(f"stream score: {tracker.rejected_count} update record(s) rejected ({kinds})", flush=True)
    print(f"stream score: starting with model version {first.version} of run {first.run_id or '(unnamed)'} "
          f"({first.path})", flush=True)
    cfg.initial_model = first.model_id()
    return cfg


def drift_config(job, data, dataset: str, status_path: str | None):
    """The scorer's ``DriftConfig`` (None with ``--drift-window 0``): the reference of ``--drift-reference`` (a
    batch run or bundle: with its model's score distribution), else the dataset's training split; written
    beside the status files for the status page."""
    if not getattr(job, "drift_window", 0):
        return None

    if job.drift_reference:
        try:
            profile = load_reference(read_bundle(job.drift_reference, "--drift-reference"),
                                     f"--drift-reference {job.drift_reference}")
            check_profile(profile, data.spec, f"--drift-reference {job.drift_reference}")
        except ValueError as err:
            raise FlowtrainError(str(err)) from None
    else:
        profile = reference_profile(read_train_sample(dataset, data.spec), data.spec, data.stats, classes=data.classes)
    cfg = DriftConfig(profile=profile, window=job.drift_window, window_s=job.drift_window_seconds,
                      thresholds=parse_thresholds(job.drift_threshold))
    if status_path:
        atomic_write(Path(status_path).with_name(DRIFT_REFERENCE),
                     json.dumps({"profile": profile, "thresholds": cfg.thresholds, "window": cfg.window}))
    return cfg


def run_score(job: StreamScoreJob | StreamJob, beam_args: Sequence[str] = (), *,
              should_stop: Callable[[], bool]) -> int:
    """Run the scoring pipeline of ``job`` (a ``StreamScoreJob``, or a whole ``StreamJob``) until
    ``should_stop()`` (the command line passes its Ctrl-C / SIGTERM flag; install it before calling:
    the runner starts here) or the runner ends; returns the exit code (1: the runner failed, or a Flink
    job could not be cancelled)."""
    # Rejected versions and swaps are logged by the pipeline: show them (Beam set up the root logger).
    serving_log = logging.getLogger("pipelines.serving")
    serving_log.setLevel(logging.INFO)
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("stream score: %(levelname)s %(message)s"))
    serving_log.addHandler(handler)
    serving_log.propagate = False

    job = with_dataset_topics(job)  # topics left unset: named after the dataset
    out = Path(job.out)
    out.mkdir(parents=True, exist_ok=True)
    kcfg = kafka_target(job).config
    raw_parts = raw_partitions(job.bootstrap, job.raw_topic, kcfg)
    rf = {"replication_factor": job.replication_factor}
    for topic in (job.predictions_topic, job.score_dead_letter_topic):
        ensure_topic(job.bootstrap, topic, partitions=raw_parts, client_config=kcfg, **rf)
    ensure_topic(job.bootstrap, job.updates_topic, client_config=kcfg, **rf)
    if getattr(job, "drift_topic", None) and getattr(job, "drift_window", 0):
        ensure_topic(job.bootstrap, job.drift_topic, client_config=kcfg, **rf)
    if not registry_ready(job.schema_registry, what="stream score", should_stop=should_stop):
        return 0  # a registry that does not answer: the job waits for it, as for brokers

    def build(p) -> None:  # after the status files of an earlier run are gone: waits for the first model version
        build_scoring_pipeline(p, scoring_config(job, beam_status=str(RunFiles(out).score_status),
                                                 enrichment=enrichment(job, stream_manifest(job))))

    state, code = drive(build, what="stream score", out=out, part="score",
                        namespace=METRICS_NAMESPACE, beam_args=beam_args, should_stop=should_stop,
                        started=f"stream score: {job.raw_topic} -> RunInference -> {job.predictions_topic} "
                                f"(+ {job.score_dead_letter_topic}), versions from {job.updates_topic} every "
                                f"{job.swap_interval:g} s, group {job.score_group_id}; Ctrl-C stops")
    if state not in ("CANCELLED", "RUNNING"):
        print(f"stream score: ended in state {state}", file=sys.stderr, flush=True)
    if state == "CANCELLED":
        not_committed("stream score", job.bootstrap, kcfg, topic=job.raw_topic, group=job.score_group_id,
                      again="a restart scores those events again (at least once)")
    print("stream score: stopped", flush=True)
    return code


# ---------------------------------------------------------------------------------------------

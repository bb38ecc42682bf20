"""``flowtrain stream pipeline`` as a Python call: the feature pipeline of a ``StreamPipelineJob``.

``run_stream_pipeline(job, beam_args, should_stop=...)`` reads the raw topic with Beam, parses and
featurizes each event with the dataset's spec and statistics, and writes Arrow feature batches (and
dead letters) until ``should_stop()``; counters go to ``<out>/pipeline-status.json.*`` and the
runner's Beam metrics to ``<out>/pipeline-metrics.json``.
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from connectors.fields import options_of
from connectors.kafka import Topics, ensure_topic
from flowtrain.commands.kafka_options import kafka_target
from flowtrain.commands.stream.driver import drive, not_committed, registry_ready
from flowtrain.commands.stream.inputs import enrichment, over_time, raw_partitions, stream_manifest
from flowtrain.commands.stream.options import StreamJob, StreamPipelineJob, with_dataset_topics
from flowtrain.train.rundir.files import RunFiles
from pipelines.stream.pipeline import METRICS_NAMESPACE, StreamConfig, build_stream_pipeline
from pipelines.stream.status import read_status


def run_stream_pipeline(job: StreamPipelineJob | StreamJob, beam_args: Sequence[str] = (), *,
                        should_stop: Callable[[], bool]) -> int:
    """Run the feature pipeline of ``job`` (a ``StreamPipelineJob``, or a whole ``StreamJob``) until
    ``should_stop()`` (the command line passes its Ctrl-C / SIGTERM flag; install it before calling:
    the runner starts here) or the runner ends; returns the exit code (1: the runner failed, or a Flink
    job could not be cancelled)."""
    job = with_dataset_topics(job)  # topics left unset: named after the dataset
    kafka = kafka_target(job, group_id=job.group_id)
    cfg = kafka.config
    manifest = stream_manifest(job)
    out = Path(job.out)
    out.mkdir(parents=True, exist_ok=True)
    raw_parts = raw_partitions(job.bootstrap, job.raw_topic, cfg)
    for topic in (job.features_topic, job.dead_letter_topic):
        ensure_topic(job.bootstrap, topic, partitions=raw_parts, client_config=cfg,
                     replication_factor=job.replication_factor)
    options = {o.name: getattr(job, o.name) for o in options_of(StreamConfig)}  # the options, as given
    options["feature_state"] = options["feature_state"] or str(RunFiles(out).feature_state)  # --aggregate's states
    options = over_time(options, manifest, str(job.dataset))  # else the dataset's own declaration
    scfg = StreamConfig(**options, kafka=kafka, topics=Topics(raw=job.raw_topic, features=job.features_topic,
                                                              dead_letters=job.dead_letter_topic),
                        feature_kinds=(manifest.get("features") or {}).get("kinds"), spec=manifest["spec"],
                        stats=manifest["stats"], enrichment_factory=enrichment(job, manifest),
                        status_path=str(RunFiles(out).pipeline_status))
    if not registry_ready(job.schema_registry, what="stream pipeline", should_stop=should_stop):
        return 0  # a registry that does not answer: the job waits for it, as for brokers
    state, code = drive(lambda p: build_stream_pipeline(p, scfg), what="stream pipeline", out=out, part="pipeline",
                        namespace=METRICS_NAMESPACE, beam_args=beam_args, should_stop=should_stop,
                        started=f"stream pipeline: {job.raw_topic} -> {job.features_topic} (+ {job.dead_letter_topic}), "
                                f"group {job.group_id}; Ctrl-C stops")
    if state == "RUNNING":  # a Flink job that could not be cancelled: said already
        return code
    if state != "CANCELLED":  # ended by itself
        totals = pipeline_totals(out)
        for error in totals["errors"]:
            print(f"stream pipeline: stopped: {error}", file=sys.stderr)
        print(f"stream pipeline: ended in state {state}; {pipeline_summary(totals)}", file=sys.stderr)
        return code
    not_committed("stream pipeline", job.bootstrap, cfg, topic=job.raw_topic, group=job.group_id,
                  again="a restart reads those events again (at least once; the trainer skips rows it trained)")
    print(f"stream pipeline: stopped; {pipeline_summary(pipeline_totals(out))}", flush=True)
    return 0


def pipeline_totals(out: Path) -> dict:
    """The pipeline's counters (one status file per DoFn instance), counted only after Kafka
    acknowledged them, and the errors that stopped it."""
    totals = {"events": 0, "rows": 0, "unlabelled": 0, "dead_letters": 0, "errors": []}
    for data in read_status(str(RunFiles(out).pipeline_status)):
        for key in ("events", "rows", "unlabelled", "dead_letters", "late", "join_late_updates"):
            if key in data:
                totals[key] = totals.get(key, 0) + data[key]
        if "join_rejected" in data:  # every instance reads the whole joined topic: the same records
            totals["join_rejected"] = max(totals.get("join_rejected", 0), data["join_rejected"])
        if data.get("error"):
            totals["errors"].append(data["error"])
    return totals


def pipeline_summary(totals: dict) -> str:
    """``pipeline_totals`` as the line the pipeline half prints when it stops."""
    line = (f"{totals['events']:,} raw events -> {totals['rows']:,} training rows + {totals['unlabelled']:,} "
            f"unlabelled (not trained on) + {totals['dead_letters']:,} dead letters, acknowledged by Kafka and "
            f"committed")
    if "late" in totals:
        line += f"; {totals['late']:,} of the dead letters late (features over time)"
    if "join_rejected" in totals:
        line += (f"; joined topics: {totals['join_rejected']:,} record(s) rejected, "
                 f"{totals['join_late_updates']:,} version(s) late")
    return line

"""``flowtrain predictions``: a scorer's predictions topic read back as a table, in any of the scorer's formats
(``--predictions-format``: Arrow record batches, JSON, Avro, Protobuf; with a Schema Registry or the dataset's
columns), so no one writes a Kafka consumer to see results.

``run_predictions(job)`` reads the topic from its beginning to its end (``--follow``: then on, until Ctrl-C or
SIGTERM) and writes the rows to ``--out`` (Parquet, or CSV for ``.csv``) or as CSV to stdout; ``read_predictions``
(``flowtrain.predictions``) returns them as a pyarrow Table. The columns are the scorer's (``pred_*`` and the
event's id and label: ``pipelines.serving.predictions``). The reading itself is ``predictions_read``'s (Kafka,
pyarrow and the codecs are imported when a command runs, not for ``flowtrain --help``)."""
from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from connectors.fields import at_least, build, check, option, store_path
from flowtrain.commands.stream import KafkaOptions, dataset_topics
from flowtrain.errors import FlowtrainError
from pipelines.serving.options import PREDICTIONS_FORMATS

_READ = "what to read"


@dataclass
class PredictionsJob(KafkaOptions):
    """The options of ``flowtrain predictions``."""

    topic: str | None = option(None, "the predictions topic (the scorer's --predictions-topic; default with "
                               "--dataset: the dataset's, as the scorer names it)", group=_READ)
    out: str | None = option(None, "write the predictions to this file: Parquet, or CSV when it ends in .csv "
                             "(default: CSV on stdout)", parse=store_path("--out", remote=False), group=_READ)
    overwrite: bool = option(False, "replace an existing --out", group=_READ)
    follow: bool = option(False, "after the topic's end, keep reading new predictions as they come (each written "
                          "as it arrives) until Ctrl-C or SIGTERM", group=_READ)
    limit: int | None = option(None, "stop after this many predictions", parse=at_least(1), group=_READ)
    predictions_format: str = option("auto", "the scorer's --predictions-format: auto reads Arrow and JSON "
                                     "messages; avro and protobuf need --schema-registry (the scorer's) or "
                                     "--dataset", choices=("auto", *PREDICTIONS_FORMATS), group=_READ)
    schema_registry: str | None = option(None, "the Schema Registry the scorer registered its Avro/Protobuf "
                                         "predictions' schema with", metavar="URL", group=_READ)
    dataset: str | None = option(None, "the dataset the scorer served: names the default --topic and, for bare "
                                 "Avro/Protobuf predictions (no registry), the columns (its classes and label)",
                                 group=_READ, parse=store_path("--dataset", remote=False))
    id_column: str | None = option(None, "with --dataset: the scorer's --id-column", group=_READ)


def _with_topic(job: PredictionsJob) -> PredictionsJob:
    """``job`` with its topic: given, or the one the scorer names after ``--dataset``."""
    if job.topic:
        return job
    if not job.dataset:
        raise FlowtrainError("predictions needs --topic TOPIC (the scorer's --predictions-topic) or --dataset DIR")
    return dataclasses.replace(job, topic=dataset_topics(job.dataset)["predictions_topic"])


def read_predictions(topic: str | None = None, **options: Any):
    """``flowtrain.predictions(topic, bootstrap=..., ...)``: every prediction on the topic now (from its beginning
    to its end), as one pyarrow Table; options are ``PredictionsJob``'s (not ``out`` nor ``follow``)."""
    from flowtrain.commands.predictions_read import read_table

    job = _with_topic(check(build(PredictionsJob, {**options, "topic": topic})))
    if job.out or job.follow:
        raise FlowtrainError("flowtrain.predictions returns the table: leave out out= and follow= (the command "
                             "line's --out and --follow write a file)")
    return read_table(job)


def run_predictions(job: PredictionsJob) -> dict:
    """Read the topic and write its predictions (``--out``, or CSV on stdout); returns ``{"rows", "seconds"}``."""
    from flowtrain.commands.predictions_read import write_topic

    job = _with_topic(check(job))
    if job.out and Path(job.out).exists() and not job.overwrite:
        raise FlowtrainError(f"--out {job.out} exists; give a new path, or --overwrite to replace it")
    t0 = time.monotonic()
    rows = write_topic(job)
    took = time.monotonic() - t0
    if job.out:
        print(f"predictions: {rows:,} predictions from {job.topic} -> {job.out} ({took:.1f} s)", file=sys.stderr,
              flush=True)
    return {"rows": rows, "seconds": took}

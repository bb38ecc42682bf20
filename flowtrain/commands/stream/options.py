"""The options of ``flowtrain replay`` and ``flowtrain stream`` (each field is a flag, a ``--config`` key and a
``config.json`` key; ``connectors.fields``).

``flowtrain stream`` runs three parts: the feature pipeline (``stream pipeline``), the online trainer
(``stream train``) and the scorer (``stream score``, or ``stream --score`` with the other two). Each part's
options are one config dataclass (``StreamPipelineJob``, ``StreamTrainJob``, ``StreamScoreJob``), composed
from the option sets below; ``StreamJob`` (the whole job) is their union, and every part accepts the
whole job's options (a whole job's ``config.json`` is a valid ``--config`` of each part).

The online trainer's options are declared by its engine (``flowtrain.train.options.StreamTrainOptions``: its
``StreamTrainConfig`` is them), the feature pipeline's and the raw events' too (``pipelines.stream.options``:
``PipelineOptions``, ``EventOptions`` with the ``ParseBounds``; ``pipelines.stream.pipeline.StreamConfig`` is
them), and the scorer's (``pipelines.serving.options.ScorerOptions``: ``pipelines.serving.config.ScoreConfig``
is them). Stdlib only, so ``--help`` stays fast.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from connectors.dataset import read_manifest
from connectors.fields import GENERAL, above, at_least, fraction, narrow, option, store_path, tailor
from flowtrain.commands.dead_letter_bound import DeadLetterBound
from flowtrain.commands.drift.options import DriftThreshold
from flowtrain.commands.shared_options import Dataset, Input, LabelColumn, Limit, Out, RunnerOptions, TimeColumn
from flowtrain.commands.stream.inputs import DEMO_DATASET
from flowtrain.commands.tracking_options import TrackingOptions
from flowtrain.errors import FlowtrainError
from flowtrain.train.options import STREAM_TRAINER, SeedOptions, StreamTrainOptions, UpdateOptions, WorkerOptions
from pipelines.presets import default_preset, preset_for, presets
from pipelines.serving.options import SCORING, ScorerOptions
from pipelines.stream.options import (
    CLIENTS,
    EventFormat,
    EventOptions,
    MaxEventBytes,
    PipelineOptions,
    SchemaFile,
    SchemaRegistryOption,
)

TRAINER = STREAM_TRAINER
RUNNER = "where the Beam pipeline runs"


def kafka_pairs(value: Any) -> tuple[str, ...]:
    """``KEY=VALUE`` pairs (a list, or one text; a value may hold commas); each is checked in full when the clients
    are made."""
    pairs = tuple(str(v).strip() for v in (value if isinstance(value, (list, tuple)) else [value]))
    bad = [p for p in pairs if "=" not in p or not p.partition("=")[0].strip()]
    if bad:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE with a kafka-python option name, e.g. "
                                         f"security_protocol=SASL_SSL, got {bad[0]!r}")
    return tuple(pairs)


kafka_pairs.__name__ = "key-value pairs"


# --- option sets ------------------------------------------------------------------------------------------
@dataclass
class KafkaOptions:
    """The brokers and how every client reaches them."""

    SECTION: ClassVar[str] = "kafka"  # --config: kafka: {config_file: FILE} is kafka_config_file
    bootstrap: str = option("127.0.0.1:9092", "Kafka bootstrap servers")
    kafka_config: tuple[str, ...] = option(
        (), "kafka-python client option for every client, e.g. security_protocol=SASL_SSL, sasl_mechanism=PLAIN, "
            "sasl_plain_username=..., ssl_cafile=..., ssl_check_hostname=false (repeat); values are typed like the "
            "option's default: true/false, whole numbers, numbers, else text; ${env:NAME} is the environment "
            "variable's value", parse=kafka_pairs, repeat=True, metavar="KEY=VALUE")
    kafka_config_file: str | None = option(
        None, "Kafka client properties file, Java names as Kafka users write them (security.protocol, "
              "sasl.mechanism, sasl.jaas.config for PLAIN/SCRAM, ssl.* PEM locations; values may be ${env:NAME}); "
              "--kafka-config wins over it (default: $FLOWTRAIN_KAFKA_CONFIG_FILE). Keeps passwords off the "
              "command line: see docs/secrets.md", metavar="client.properties")
    connect_timeout: float = option(
        30.0, "seconds to wait for a first answer from the brokers; without one the command stops with a one-line "
              "error naming --bootstrap", parse=above(0))
    replication_factor: int | None = option(
        None, "replication factor of the topics this command creates (default: min(3, brokers))", parse=at_least(1))


@dataclass
class Topic:
    """``--topic``: the one Kafka topic a command works on: ``flowtrain replay`` produces its events to it, ``flowtrain
    predictions`` reads the scorer's predictions from it (a stream's topics are options of their own, one per
    topic)."""

    topic: str | None = option(None, "the Kafka topic")


@dataclass
class StreamTopics(KafkaOptions):
    """The streaming job's topics (and the brokers), its consumer group, the local broker."""

    raw_topic: str | None = option(None, "raw JSON events (default: NAME-raw, NAME the --dataset's name, or its "
                                         "preset's: the demo's without --dataset)")
    features_topic: str | None = option(None, "feature batches (default: NAME-features)")
    dead_letter_topic: str | None = option(
        None, "rejected events, and feature messages the trainer rejects, with their reason (default: "
              "NAME-dead-letters)")
    updates_topic: str | None = option(None, "published model versions (default: NAME-model-updates)")
    group_id: str = option("flowtrain-features",
                           "the pipeline's consumer group (its lag is on the live line and the status page)")
    local_kafka: bool = option(False, "start the project's broker on --bootstrap's port")


@dataclass
@tailor(dataset={"help": "the `flowtrain batch` dataset whose spec (event fields, label), statistics and vocabularies "
                         "the stream uses: events are JSON objects keyed by its column names (default "
                         "runs/demo/dataset, the demo's)"},
        # a stream's run directory is where it always was unless asked (the interface)
        out={"default": "runs/stream", "help": "run directory"})
# the stream's checkpoints, published versions and the dataset it reads: local (or mounted) paths only
@narrow(dataset={"parse": store_path("--dataset", remote=False)}, out={"parse": store_path("--out", remote=False)})
class StreamCommon(Out, Dataset, StreamTopics):
    """What every part of the streaming job reads: topics, the dataset, the run directory, the status page."""

    metrics_port: int = option(
        0, "serve Prometheus /metrics and a live status page (/) on 127.0.0.1:PORT while the job runs (one port "
           "for the whole job; 0: off)", parse=at_least(0))


@dataclass
@tailor(workers={"help": "data-parallel trainer replicas (feature partitions split across them)"},
        failure_timeout={"help": "with --workers N: seconds within which the job ends when a replica dies or stalls"})
class TrainerWorkers(WorkerOptions):
    """The online trainer's processes (``WorkerOptions``, the batch run's too)."""

    SECTION: ClassVar[str] = "trainer"
    GROUP: ClassVar[str] = TRAINER


@dataclass
class TrainerOptions(StreamTrainOptions, TrainerWorkers):
    """The online trainer: its processes, and its engine's options (``flowtrain.train.options``: replicas' grid,
    model, optimizer, checkpoints, published versions)."""


_DRIFT_THRESHOLD_HELP = ("drift measure thresholds, MEASURE=VALUE comma-separated (psi, js, linf, unseen, missing, "
                         "out_of_range, prediction, adwin; default: as `flowtrain drift`, docs/observability.md)")


@dataclass
@tailor(drift_threshold={"help": _DRIFT_THRESHOLD_HELP, "group": SCORING})
class ScoreOptions(DriftThreshold, ScorerOptions):
    """The scoring pipeline: RunInference with the newest published version; the engine's options
    (``pipelines.serving.options.ScorerOptions``), and what only the command reads: topics, the wait for a first
    model, drift monitoring."""

    SECTION: ClassVar[str] = "score"
    predictions_topic: str | None = option(None, "predictions, one Arrow record batch per message (default: "
                                                 "NAME-predictions)", group=SCORING)
    score_dead_letter_topic: str | None = option(None, "events the scorer rejects, with their reason (default: "
                                                       "NAME-scoring-dead-letters)", group=SCORING)
    wait_model: float = option(120.0, "seconds the scorer waits at start for a first valid version on the updates "
                                      "topic", parse=above(0), group=SCORING)
    drift_window: int = option(
        2000, "drift monitoring over the newest micro-batches holding at least this many scored events (per scorer "
              "instance), against the training data: /metrics, the status page, --drift-topic; 0: off",
        parse=at_least(0), group=SCORING)
    drift_window_seconds: float = option(
        0.0, "with this > 0, the drift window also drops micro-batches scored more than this many seconds ago "
             "(a window of events or of time, whichever is smaller)", parse=at_least(0.0, float), group=SCORING)
    drift_reference: str | None = option(
        None, "a `flowtrain batch` run or bundle whose drift reference (with its model's score distribution) the "
              "scorer compares with (default: the dataset's training split; the scores against the first window)",
        metavar="RUN_OR_BUNDLE", group=SCORING)
    drift_topic: str | None = option(None, "each drift window's measures and alarms as a JSON record on this topic, "
                                           "every few seconds and when its alarms change (default: none)", group=SCORING)


# --- the commands -----------------------------------------------------------------------------------------
@dataclass
@tailor(schema_file={"help": "the schema to write with, an .avsc or .proto file (default: the dataset's: "
                             "`flowtrain schema`)", "group": GENERAL},
        schema_registry={"help": "a Confluent-compatible Schema Registry URL (default: none)", "group": GENERAL},
        event_format={"help": "write events as json, avro or protobuf (the --dataset's schema, or "
                              "--schema-file's); with --schema-registry in its wire format, the schema registered "
                              "under TOPIC-value", "group": GENERAL},
        seed={"help": "seed of which events --malformed replaces", "group": GENERAL},
        max_dead_letter_fraction={"help": "with --input and --dataset: before sending, stop with exit status 3 "
                                          "when more than this fraction of the rows make events the stream would "
                                          "make dead letters (its own checks: fields, types, the feature checks); "
                                          "default: no check"},
        time_column={"help": "with --input: order events by this column (event time) and set it as each Kafka "
                             "record's timestamp (default: file order, stamped with the time of sending)"},
        label={"help": "with --input: the label column --unlabelled removes (default: the dataset's label)"},
        topic={"help": "topic to produce to (default: NAME-raw, NAME the --dataset's name, as `flowtrain stream "
                       "--dataset` reads; the demo's without --dataset)"},
        limit={"help": "produce at most this many events (default: all; --generate: 100000)"},
        input={"help": "files to replay (CSV, Parquet, JSON lines; globs and any Beam filesystem; repeat for more), "
                       "read with the batch ETL's readers (default: the demo's events)", "metavar": "FILES"},
        dataset={"help": "with --input: the `flowtrain batch` dataset the events are for; its spec gives the default "
                         "--label and the fields --malformed breaks (default: none)"},
        # none unless asked: the stream's default 1 MiB exceeds Kafka's message size
        max_event_bytes={"default": None, "help": "the stream pipeline's --max-event-bytes: with --malformed, events "
                                                  "'too large' are made just beyond it (left out without it: the "
                                                  "default 1 MiB exceeds Kafka's message size)", "group": GENERAL})
@narrow(input={"parse": store_path("--input", many=True)}, dataset={"parse": store_path("--dataset", remote=False)})
class ReplayJob(Limit, Topic, MaxEventBytes, Dataset, Input, SchemaFile, SchemaRegistryOption, EventFormat, SeedOptions, DeadLetterBound, TimeColumn,
                LabelColumn, KafkaOptions):
    """The options of ``flowtrain replay``."""

    key_column: str | None = option(None, "with --input: key each record by this column's value (default: no key, "
                                          "round robin)")
    unlabelled: float = option(
        0.0, "fraction of (valid) events sent without their label, as events a scorer sees before the outcome is "
             "known", parse=fraction(inclusive_high=True))
    partitions: int = option(3, "partitions if the topic is created", parse=at_least(1))
    rate: float = option(0.0, "events per second (0: as fast as possible)", parse=at_least(0, float))
    generate: str | None = option(
        None, "instead of --input, a synthetic stream: clicks (users and items with Zipf popularity and latent tastes, "
              "new users arriving all the time, tastes drifting; the true click probability kept aside; docs/ids.md) "
              "or transactions (card payments keyed by card, merchants' risk tiers that change over time, fraud in "
              "bursts; docs/features.md)", choices=("clicks", "transactions"))
    generate_out: str | None = option(None, "with --generate: keep the events (clicks.csv and their true click "
                                            "probabilities truth.csv; transactions.csv and merchants.csv, the table "
                                            "to --join) in this directory (default: a temporary one)",
                                      metavar="DIR")
    out_of_order: float = option(0.0, "with --generate transactions: deliver payments up to this many seconds after "
                                      "their event time, out of event-time order (0: in order)",
                                 parse=at_least(0, float), metavar="SECONDS")
    skip: int = option(0, "start after this many events", parse=at_least(0))
    malformed: float = option(
        0.0, "fraction of events replaced by bad ones, for demos and tests: the demo: its preset's kinds (broken "
             "JSON, missing field, wrong type, NaN, impossible value); --input: broken JSON, missing field(s), wrong "
             "type, NaN, infinite, too deeply nested JSON, not UTF-8 (and event too large with --max-event-bytes): "
             "the names of their dead letters' reasons", parse=fraction(inclusive_high=True))
    client: str = option(
        "kafka-python", "producer client: kafka-python (~10k events/s on one core here) or confluent (confluent-kafka "
                        "on librdkafka, the extra flowtrain[kafka-confluent]; several times faster: what `bench "
                        "stream` uses to offer more than 10k events/s). Both send with acks=all, idempotent, and "
                        "confirm every event before the count is printed", choices=CLIENTS)


@dataclass
class StreamPipelineJob(RunnerOptions, PipelineOptions, EventOptions, StreamCommon):
    """The options of ``flowtrain stream pipeline``: Kafka raw events -> Beam features -> Kafka."""


@dataclass
class StreamTrainJob(TrackingOptions, UpdateOptions, TrainerOptions, StreamCommon):
    """The options of ``flowtrain stream train``: the online trainer on the features topic."""


@dataclass
class StreamScoreJob(RunnerOptions, UpdateOptions, ScoreOptions, EventOptions, StreamCommon):
    """The options of ``flowtrain stream score``: the scoring pipeline."""


@dataclass
class StreamJob(TrackingOptions, RunnerOptions, UpdateOptions, ScoreOptions, TrainerOptions, PipelineOptions,
                EventOptions, StreamCommon):
    """The options of ``flowtrain stream``: the feature pipeline and the online trainer (and with ``--score`` the
    scorer) as one job; every part's options."""

    SECTION: ClassVar[str] = "score"  # its one option, --score, goes with the scorer's: score: {score: true}
    score: bool = option(False, "also run the scoring pipeline: Beam RunInference on the raw events with the newest "
                                "published model version, hot-swapped without a restart", group=SCORING)


#: ``flowtrain stream HALF``: the options of that part.
HALVES: dict[str, type] = {"pipeline": StreamPipelineJob, "train": StreamTrainJob, "score": StreamScoreJob}


# --- topics named after the dataset -----------------------------------------------------------------------
#: The Kafka topics of a stream on a dataset named NAME: NAME-raw, NAME-features, ... (by option). A preset's
#: dataset is named after its preset (``pipelines.presets``): the demo's topics follow from its preset's name.
TOPIC_SUFFIXES = {"raw_topic": "raw", "features_topic": "features", "dead_letter_topic": "dead-letters",
                  "updates_topic": "model-updates", "predictions_topic": "predictions",
                  "score_dead_letter_topic": "scoring-dead-letters"}
def dataset_name(dataset: str | None) -> str:
    """The name a stream's default topics start with: the name of the dataset's preset (``pipelines.presets``;
    without ``--dataset`` and no demo dataset made yet: the default preset's); else the manifest's ``name``, else
    the dataset directory's name, or its run directory's for a run's ``dataset/`` (``runs/sensors/dataset``:
    ``sensors``), in the characters a Kafka topic takes."""
    try:
        presets()  # the registry's sources: a module that cannot be loaded is one line, not a traceback
    except ValueError as err:
        raise FlowtrainError(str(err)) from None
    path = Path(dataset or DEMO_DATASET)
    try:
        manifest = read_manifest(str(path))
    except Exception:  # noqa: BLE001 - not (yet) a dataset: the stream says so when it starts
        manifest = None
    if manifest is None and not dataset:
        try:
            return default_preset().name
        except ValueError:  # no default preset registered: the directory's name below
            pass
    preset = preset_for(manifest)
    if preset is not None:
        return preset.name
    if manifest is not None and isinstance(manifest.get("name"), str) and manifest["name"].strip():
        name = manifest["name"].strip()
    else:
        path = path if "://" in str(dataset) else path.resolve()
        name = path.parent.name if path.name == "dataset" and path.parent.name else path.name
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "dataset"


def dataset_topics(dataset: str | None) -> dict[str, str]:
    """The default topic of each topic option for a stream on ``dataset`` (``TOPIC_SUFFIXES``)."""
    name = dataset_name(dataset)
    return {option_name: f"{name}-{suffix}" for option_name, suffix in TOPIC_SUFFIXES.items()}


def with_dataset_topics(job: Any) -> Any:
    """``job`` (a stream part's options, a whole ``StreamJob`` or a ``ReplayJob``) with every topic left unset
    named after its dataset (``dataset_topics``); topics given stay."""
    names = {"topic": "raw_topic"} if hasattr(job, "topic") else {k: k for k in TOPIC_SUFFIXES if hasattr(job, k)}
    unset = [k for k in names if getattr(job, k) is None]
    if not unset:
        return job
    topics = dataset_topics(job.dataset)
    return dataclasses.replace(job, **{k: topics[names[k]] for k in unset})

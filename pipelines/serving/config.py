"""The scorer's configuration and the micro-batch that flows from featurizing to the model."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

from connectors.dataset_spec import FeatureSpec
from connectors.fields import validate
from connectors.kafka import PRODUCER_DEFAULTS, KafkaTarget, Topics, topic_max_message_bytes
from connectors.model_updates import UpdateKeySource
from pipelines.serving.options import ScorerOptions
from pipelines.stream.options import EventOptions, ParseBounds, parse_bounds
from pipelines.stream.pipeline import KAFKA_DEFAULT_MAX_MESSAGE_BYTES

__all__ = ["ScoreConfig", "ScoringBatch", "topic_limits"]


@dataclass(kw_only=True)
class ScoreConfig(ScorerOptions, EventOptions):
    """The scorer's engine config: its options (``pipelines.serving.options.ScorerOptions``: micro-batches, consumer
    group, serving window, ids, predictions' format, model copies; the raw events' ``EventOptions``) plus what the
    command resolves (brokers, topics, the dataset's spec and statistics, the model loader, the enrichment's factory,
    Kafka client settings, the update key's source, drift monitoring)."""

    # the brokers and client settings, and the topics (raw events, predictions, dead letters, model updates, drift), as
    # the command resolved its options (connectors.kafka.target: not configuration; no defaults: a stream's topics are
    # named after its dataset, flowtrain.commands.stream.options.dataset_topics)
    kafka: KafkaTarget
    topics: Topics
    load_version: Callable[..., tuple[Any, int]]  # (path, sha256=None) -> (eval module, version)
    spec: FeatureSpec
    stats: dict = field(default_factory=dict)  # the batch dataset manifest's "stats"
    initial_model: str = ""  # ModelVersion.model_id() of the version to serve before the first tick
    # a picklable factory of the domain's enrichment step (a dataset preset's, e.g. the demo's weather/planes
    # join; the ``enrichment`` option resolved by the command), called in each worker; None: events hold the
    # dataset's own columns
    enrichment_factory: Callable[[], Any] | None = None
    max_read_s: float = 0.5  # the reader hands its output on at least this often
    max_inference_batches: int = 16  # micro-batches RunInference stacks into one forward
    # torch threads of the scorer's process: it shares the cores with the read, the featurizing and
    # the Kafka clients; with 2 threads on 2 busy cores a forward ran 27x slower than with 1 (measured)
    torch_threads: int = 1
    target_scale: tuple[float, float] = (0.0, 1.0)  # regression: (shift, scale) of the standardized target
    classes: list[str] | None = None  # classification: the manifest's class names, in label-code order
    status_path: str | None = None  # prefix of per-instance JSON counters (`flowtrain stream --score`)
    # model updates: the key's source (never the key: each worker reads it), the scorer's own copies of the
    # versions it serves (keep_models of them)
    update_key: UpdateKeySource | None = None
    model_cache_dir: str = ""
    # drift monitoring: a pipelines.serving.drift.DriftConfig (reference profile, window, thresholds, topic), or None
    drift: Any = None
    # features over time: the aggregated columns' kinds the dataset's backfill recorded (its manifest's "features")
    feature_kinds: dict | None = None

    def __post_init__(self):
        self.kafka, self.topics = KafkaTarget.of(self.kafka), Topics.of(self.topics)
        validate(self, ScorerOptions)  # the ranges, as the command line checks them (--score-batch-size, ...)
        super().__post_init__()  # the parse bounds

    @property
    def bounds(self) -> ParseBounds:
        """The limits on one raw event, as in the feature pipeline."""
        return parse_bounds(self)

    @property
    def n_classes(self) -> int:
        return len(self.classes or ["0", "1"]) if self.spec.task == "classification" else 0


class ScoringBatch(NamedTuple):
    """One micro-batch of one raw partition: its features and the offsets it covers."""

    topic: str
    partition: int
    first_offset: int
    last_offset: int  # every offset in [first, last] read from the partition is in this batch
    features: pa.RecordBatch | None  # featurized valid events (+ src_partition, src_offset); None if none
    event_ms: np.ndarray  # Kafka timestamp of each feature row
    dead_letters: int  # events of the range rejected (already on the dead-letter topic)
    featurized_ms: int = 0  # when the micro-batch closed (for the latency breakdown in the status)


def topic_limits(cfg: ScoreConfig, topics: Sequence[str]) -> dict[str, int]:
    """Each topic's max.message.bytes as the broker applies it, capped by the producer's request size."""
    max_request = int(cfg.kafka.config.get("max_request_size", PRODUCER_DEFAULTS["max_request_size"]))
    return {t: min(topic_max_message_bytes(cfg.kafka.bootstrap, t, client_config=cfg.kafka.config)
                   or KAFKA_DEFAULT_MAX_MESSAGE_BYTES, max_request) for t in topics}

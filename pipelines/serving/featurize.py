"""Raw events -> micro-batches of features for the model, with the stream pipeline's featurizer.

Fused with the Kafka read: a partition's events in a bundle become micro-batches
(``MicroBatcher``: closed at ``batch_size`` events, ``max_delay_s`` after the first one, or at the
end of the bundle), featurized by ``pipelines.stream.featurize.StreamFeaturizer`` (the batch ETL's
feature code, vectorized over the micro-batch, the same as the stream pipeline that feeds the
trainer). An event is scored whether or not it carries its label, and an event whose class the
training split never saw is scored too; only invalid events are dead letters (raw = predictions +
dead letters), produced and confirmed before the micro-batch goes on to the model.
"""
from __future__ import annotations

import time

import apache_beam as beam
import numpy as np
from apache_beam.transforms import window
from apache_beam.utils.timestamp import Timestamp
from apache_beam.utils.windowed_value import WindowedValue

from connectors.deadletter import DeadLetter, dead_letter_record
from connectors.kafka import KafkaDelivery, KafkaRecord, close_client, new_producer
from pipelines.flights.status import write_status
from pipelines.serving.config import ScoreConfig, ScoringBatch, topic_limits
from pipelines.stream.events import DEFAULT_BOUNDS, ParseBounds
from pipelines.stream.featurize import StreamFeaturizer
from pipelines.stream.pipeline import MicroBatcher

__all__ = ["scoring_featurizer", "featurize_records", "FeaturizeForScoring"]


def scoring_featurizer(cfg: ScoreConfig) -> StreamFeaturizer:
    """The featurizer of ``cfg``'s dataset (with its enrichment, carrying the id column)."""
    return StreamFeaturizer(cfg.spec, cfg.stats, cfg.enrichment() if cfg.enrichment is not None else None,
                            keep=[cfg.id_column] if cfg.id_column else [])


def featurize_records(items: list[KafkaRecord], featurizer: StreamFeaturizer,
                      bounds: ParseBounds = DEFAULT_BOUNDS) -> tuple[ScoringBatch, list[DeadLetter]]:
    """Raw records of one partition (in offset order) -> a ``ScoringBatch`` and its dead letters."""
    out = featurizer.featurize_payloads([r.value for r in items], [(r.topic, r.partition, r.offset) for r in items],
                                        bounds)
    features, event_ms = out.features, np.zeros(0, dtype=np.int64)
    if features is not None and features.num_rows:
        offsets = np.array([r.offset for r in items], dtype=np.int64)
        stamps = np.array([r.timestamp for r in items], dtype=np.int64)
        event_ms = stamps[np.searchsorted(offsets, features.column("src_offset").to_numpy())]
    else:
        features = None
    first, last = items[0], items[-1]
    return ScoringBatch(first.topic, first.partition, first.offset, last.offset, features, event_ms,
                        len(out.dead_letters)), out.dead_letters


class _FeaturizeForScoringFn(beam.DoFn):
    def __init__(self, cfg: ScoreConfig):
        self.cfg = cfg

    def setup(self):
        cfg = self.cfg
        self.featurizer = scoring_featurizer(cfg)
        self.limits = topic_limits(cfg, [cfg.dead_letter_topic])
        self.producer = new_producer(cfg.bootstrap, cfg.kafka_config, max_message_bytes=min(self.limits.values()))
        self.delivery = KafkaDelivery(self.producer, what="scorer", max_message_bytes=self.limits)
        self.totals = {"events": 0, "dead_letters": 0}

    def teardown(self):
        if getattr(self, "producer", None) is not None:
            close_client(self.producer)
            self.producer = None

    def start_bundle(self):
        self.batcher = MicroBatcher(self.cfg.batch_size, self.cfg.max_delay_s)

    def process(self, element: KafkaRecord | list[KafkaRecord]):
        for record in element if isinstance(element, list) else (element,):  # a list: ReadFromKafka(batch_records=N)
            closed = self.batcher.add((record.topic, record.partition), record)
            if closed:
                yield self._flush(closed)

    def finish_bundle(self):
        for _, items in self.batcher.drain():
            yield self._flush(items)

    def _flush(self, items: list[KafkaRecord]) -> WindowedValue:
        """One partition's micro-batch as a ScoringBatch, stamped with its newest Kafka time."""
        batch, letters = featurize_records(items, self.featurizer, self.cfg.bounds)
        for letter in letters:
            key, value, headers = dead_letter_record(letter, max_bytes=self.limits[self.cfg.dead_letter_topic])
            self.delivery.send(self.cfg.dead_letter_topic, value, key=key, headers=headers)
        self.delivery.confirm()  # acknowledged before the offsets can be committed downstream
        self.totals["events"] += len(items)
        self.totals["dead_letters"] += len(letters)
        write_status(self.cfg.status_path, self, self.totals, kind="featurize")
        newest = Timestamp(micros=max(r.timestamp for r in items) * 1000)
        return WindowedValue(batch._replace(featurized_ms=int(time.time() * 1000)), newest, [window.GlobalWindow()])


class FeaturizeForScoring(beam.PTransform):
    """Raw ``KafkaRecord``s -> ``ScoringBatch``es (dead letters go to the dead-letter topic)."""

    def __init__(self, cfg: ScoreConfig):
        super().__init__()
        self.cfg = cfg

    def expand(self, records):
        return records | "MicroBatchFeaturize" >> beam.ParDo(_FeaturizeForScoringFn(self.cfg))

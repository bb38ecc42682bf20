"""The flights streaming pipeline: raw JSON events on Kafka -> feature batches on Kafka.

    ReadFromKafka(raw, unbounded, from the group's committed offsets)
      -> MicroBatchFeaturize (fused with the read, per partition): buffer events; close the
         micro-batch at ``batch_size`` events, ``max_delay_s`` after its first one, or at the end
         of the reader's bundle (at most ~1 s);
         parse and validate, join weather and planes, featurize with the *batch* dataset's
         statistics and vocabularies (the same feature code as the batch ETL); produce one Arrow
         record batch to the features topic and each bad event to the dead-letter topic with its
         reason; flush (acks=all); then commit the raw offsets.

Delivery: offsets are committed only after the producer has acknowledged the micro-batch's
features and dead letters, and a partition's micro-batches are flushed in offset order, so a
crash at any point re-reads (never skips) raw events: at least once. Each feature row carries
its source (raw partition and offset); the trainer drops rows it has already trained, which
makes the whole job exactly once.

The reference tables are loaded by the DoFn itself (``setup``), from the same Parquet files the
batch ETL reads, instead of side inputs: Beam 2.77 could not translate the stateful version of
this DoFn with a side input ("with stateful DoFn must be key-value pairs"), and a side input
would also break the fusion with the read that keeps a partition's flushes in order.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import apache_beam as beam
import pyarrow.parquet as pq

from connectors.arrow import encode_batch
from connectors.deadletter import DeadLetter
from connectors.kafka import KafkaRecord, ReadFromKafka, close_client, new_consumer, retry_kafka, track_client
from pipelines.flights import features as FF
from pipelines.flights.events import events_table, parse_event

_log = logging.getLogger(__name__)


@dataclass
class StreamConfig:
    bootstrap: str
    raw_topic: str = "flights-raw"
    features_topic: str = "flights-features"
    dead_letter_topic: str = "flights-dead-letters"
    group_id: str = "flowtrain-features"
    batch_size: int = 500
    max_delay_s: float = 1.0
    stats: dict = field(default_factory=dict)  # the batch dataset manifest's "stats"
    weather_path: str = ""
    planes_path: str = ""
    kafka_config: dict[str, Any] = field(default_factory=dict)  # SASL/SSL etc., for every client
    status_path: str | None = None  # prefix of per-instance JSON counters for `flowtrain stream`'s live line


class _MicroBatchFeaturizeFn(beam.DoFn):
    """Fused with the reader: buffers each partition's events within a bundle and flushes a
    micro-batch at ``batch_size`` events, after ``max_delay_s``, and at the end of the bundle
    (the reader ends a bundle at least every second), then commits that partition's offsets.

    No Beam state: a partition's restriction is read by one bundle at a time, in offset order,
    so each flush covers the offsets right after the previous one and commits stay contiguous.
    (With Beam state and processing-time timers, Prism ran a key's timer callback and its
    elements in different bundles with different views of the state, which broke that order.)
    """

    def __init__(self, cfg: StreamConfig):
        self.cfg = cfg

    def setup(self):
        from kafka import KafkaProducer

        cfg = self.cfg
        self.weather = FF.prepare_weather(pq.read_table(cfg.weather_path))
        self.planes = FF.prepare_planes(pq.read_table(cfg.planes_path))
        self.producer = track_client(KafkaProducer(bootstrap_servers=cfg.bootstrap, acks="all", enable_idempotence=True,
                                             linger_ms=5, max_request_size=16 * 1024 * 1024,
                                             bootstrap_timeout_ms=120_000, **cfg.kafka_config))
        self.committer = new_consumer(cfg.bootstrap, cfg.kafka_config, group_id=cfg.group_id)
        self.totals = {"events": 0, "rows": 0, "dead_letters": 0, "batches": 0}

    def teardown(self):
        for client in ("producer", "committer"):
            if getattr(self, client, None) is not None:
                close_client(getattr(self, client))
                setattr(self, client, None)

    def start_bundle(self):
        self.buffers: dict[tuple[str, int], list] = {}
        self.first_at: dict[tuple[str, int], float] = {}

    def process(self, record: KafkaRecord):
        key = (record.topic, record.partition)
        buf = self.buffers.setdefault(key, [])
        if not buf:
            self.first_at[key] = time.monotonic()
        buf.append(record)
        if len(buf) >= self.cfg.batch_size or time.monotonic() - self.first_at[key] >= self.cfg.max_delay_s:
            yield self._flush(key)

    def finish_bundle(self):
        from apache_beam.transforms.window import GlobalWindow
        from apache_beam.utils.windowed_value import WindowedValue

        for key in [k for k, v in self.buffers.items() if v]:
            yield WindowedValue(self._flush(key), GlobalWindow().max_timestamp(), [GlobalWindow()])

    def _flush(self, key: tuple[str, int]) -> tuple[int, int, int, int]:
        items = self.buffers.pop(key)
        topic, partition = key
        parsed, sources, letters = [], [], []
        for r in items:
            out = parse_event(r.value, f"{r.topic}/{r.partition}/{r.offset}")
            if isinstance(out, DeadLetter):
                letters.append(out)
            else:
                parsed.append(out)
                sources.append((r.topic, r.partition, r.offset))
        rows = 0
        if parsed:
            features, bad = FF.featurize_raw(events_table(parsed, sources), self.weather, self.planes,
                                             self.cfg.stats, passthrough=("src_partition", "src_offset"))
            letters += bad
            if features is not None and features.num_rows:
                # keyed by raw partition: its rows stay in offset order on one feature partition
                self.producer.send(self.cfg.features_topic, key=str(partition).encode(), value=encode_batch(features))
                rows = features.num_rows
        for letter in letters:
            payload = letter.payload if isinstance(letter.payload, bytes) else json.dumps(
                letter.payload, default=str).encode()
            self.producer.send(self.cfg.dead_letter_topic, key=letter.source.encode(), value=payload,
                               headers=[("source", letter.source.encode()), ("reason", letter.reason.encode())])
        # Every record acknowledged before the commit; a broker restart is waited out.
        retry_kafka(lambda: self.producer.flush(timeout=60), "flush of a micro-batch")
        self._commit(topic, partition, items[-1].offset + 1)
        self.totals["events"] += len(items)
        self.totals["rows"] += rows
        self.totals["dead_letters"] += len(letters)
        self.totals["batches"] += 1
        self._write_status()
        return partition, len(items), rows, len(letters)

    def _commit(self, topic: str, partition: int, next_offset: int) -> None:
        from kafka import OffsetAndMetadata, TopicPartition

        offsets = {TopicPartition(topic, partition): OffsetAndMetadata(next_offset, "", -1)}
        retry_kafka(lambda: self.committer.commit(offsets), "offset commit")

    def _write_status(self) -> None:
        if self.cfg.status_path:  # one file per DoFn instance: instances run in parallel threads
            path = f"{self.cfg.status_path}.{os.getpid()}-{id(self)}"
            with open(f"{path}.tmp", "w") as fh:
                json.dump({**self.totals, "time": time.time()}, fh)
            os.replace(f"{path}.tmp", path)


class FeaturizeFlightEvents(beam.PTransform):
    """Raw ``KafkaRecord``s -> features and dead letters on Kafka (see the module doc)."""

    def __init__(self, cfg: StreamConfig):
        super().__init__()
        self.cfg = cfg

    def expand(self, records):
        return records | "MicroBatchFeaturize" >> beam.ParDo(_MicroBatchFeaturizeFn(self.cfg))


def build_stream_pipeline(pipeline: beam.Pipeline, cfg: StreamConfig):
    raw = pipeline | "ReadRaw" >> ReadFromKafka(cfg.bootstrap, cfg.raw_topic, start="committed",
                                                group_id=cfg.group_id, commit_offsets=False,
                                                consumer_config=cfg.kafka_config)
    return raw | "Featurize" >> FeaturizeFlightEvents(cfg)

"""Raw events -> micro-batches of features for the model, with the stream pipeline's featurizer.

Fused with the Kafka read: a partition's events in a bundle become micro-batches
(``MicroBatcher``: closed at ``score_batch_size`` events, ``score_max_delay`` after the first one, or at the
end of the bundle), featurized by ``pipelines.stream.featurize.StreamFeaturizer`` (the batch ETL's
feature code, vectorized over the micro-batch, the same as the stream pipeline that feeds the
trainer). An event is scored whether or not it carries its label, and an event whose class the
training split never saw is scored too; only invalid events are dead letters (raw = predictions +
dead letters), produced and confirmed before the micro-batch goes on to the model. An event whose
carried column (``--id-column``) holds more than ``max_id_bytes`` is one of them, before it is
scored: the value is copied into its prediction, which must fit a message of the predictions topic.
"""
from __future__ import annotations

import time

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from apache_beam.transforms import window
from apache_beam.utils.timestamp import Timestamp
from apache_beam.utils.windowed_value import WindowedValue

from connectors.dataset_spec import ID_PREFIX
from connectors.deadletter import DeadLetter
from connectors.id_keys import reason_counts
from connectors.kafka import KafkaDelivery, KafkaRecord, close_client, dead_letter_record, new_producer
from pipelines.serving.config import ScoreConfig, ScoringBatch, topic_limits
from pipelines.stream.aggregates import AggregateInputs, Aggregates
from pipelines.stream.events import DEFAULT_BOUNDS, ParseBounds, event_schema
from pipelines.stream.featurize import StreamFeaturizer
from pipelines.stream.status import write_status
from pipelines.stream.steps import MicroBatcher

__all__ = ["scoring_featurizer", "featurize_records", "FeaturizeForScoring", "id_fallback_counts"]


def id_fallback_counts(features: pa.RecordBatch | None, id_columns: list[str]) -> dict[str, int]:
    """{"<column>: <reason>": n}: the events of ``features`` whose ID value has no key, so are scored with the
    fallback vector (the reason is the row's reserved key: ``connectors.id_keys``)."""
    out: dict[str, int] = {}
    if features is None:
        return out
    for col in id_columns:
        for kind, n in reason_counts(features.column(ID_PREFIX + col).to_numpy()).items():
            out[f"{col}: {kind}"] = n
    return out


def scoring_aggregates(cfg: ScoreConfig) -> Aggregates | None:
    """Features over time (``--aggregate``/``--join``) of the scorer: the stream pipeline's code, with the scorer's
    own states (its consumer group's files under ``--feature-state``); None without any."""
    if not (cfg.aggregations or cfg.joins):
        return None
    if not cfg.feature_state:
        raise ValueError("--aggregate/--join in the scorer need --feature-state (where the states live)")
    return Aggregates(cfg, cfg.spec, group_id=cfg.score_group_id, state_dir=cfg.feature_state,
                      recorded_kinds=cfg.feature_kinds)


def scoring_featurizer(cfg: ScoreConfig, aggregates: Aggregates | None = None) -> StreamFeaturizer:
    """The featurizer of ``cfg``'s dataset (with its enrichment, carrying the id column; with ``aggregates`` the
    events carry the aggregations' inputs)."""
    enrichment = AggregateInputs(aggregates.event_fields(event_schema(cfg.spec))) if aggregates is not None else \
        cfg.enrichment_factory() if cfg.enrichment_factory is not None else None
    return StreamFeaturizer(cfg.spec, cfg.stats, enrichment,
                            keep=[cfg.id_column] if cfg.id_column else [], event_format=cfg.event_format,
                            schema_registry=cfg.schema_registry, schema_file=cfg.schema_file)


def featurize_records(items: list[KafkaRecord], featurizer: StreamFeaturizer,
                      bounds: ParseBounds = DEFAULT_BOUNDS, *,
                      max_id_bytes: int | None = None,
                      aggregates: Aggregates | None = None) -> tuple[ScoringBatch, list[DeadLetter]]:
    """Raw records of one partition (in offset order) -> a ``ScoringBatch`` and its dead letters.
    ``max_id_bytes``: the bound on each carried column (``featurizer.keep``: the id) of an event. ``aggregates``:
    features over time (the events whose aggregates are final go on, ``Aggregates.score_records``)."""
    stamps = None
    if aggregates is not None:
        out, stamps = aggregates.score_records(items, featurizer, bounds)
    else:
        out = featurizer.featurize_payloads([r.value for r in items],
                                            [(r.topic, r.partition, r.offset) for r in items], bounds)
    features, letters = out.features, list(out.dead_letters)
    if features is not None and features.num_rows and max_id_bytes is not None and featurizer.keep:
        features, over = _bound_carried(features, featurizer.keep, max_id_bytes, items)
        letters += over
    event_ms = np.zeros(0, dtype=np.int64)
    if features is not None and features.num_rows and stamps is not None:  # events read in earlier batches too
        event_ms = np.array([stamps[o] for o in features.column("src_offset").to_pylist()], dtype=np.int64)
    elif features is not None and features.num_rows:
        offsets = np.array([r.offset for r in items], dtype=np.int64)
        stamps = np.array([r.timestamp for r in items], dtype=np.int64)
        event_ms = stamps[np.searchsorted(offsets, features.column("src_offset").to_numpy())]
    else:
        features = None
    first, last = items[0], items[-1]
    return ScoringBatch(first.topic, first.partition, first.offset, last.offset, features, event_ms,
                        len(letters)), letters


def _bound_carried(features: pa.RecordBatch, names, max_bytes: int,
                   items: list[KafkaRecord]) -> tuple[pa.RecordBatch, list[DeadLetter]]:
    """Rows whose carried column is longer than ``max_bytes`` (UTF-8) -> dead letters (the raw event)."""
    over = np.zeros(features.num_rows, dtype=bool)
    why: dict[int, str] = {}
    for name in names:
        if name not in features.schema.names:
            continue
        lengths = pc.binary_length(features.column(name).cast(pa.string()))
        sizes = lengths.fill_null(0).to_numpy(zero_copy_only=False)
        for i in np.flatnonzero((sizes > max_bytes) & ~over):
            why[int(i)] = (f"--id-column {name!r}: a value of {int(sizes[i]):,} bytes, over --max-id-bytes "
                           f"{max_bytes:,} (it is copied into the event's prediction)")
        over |= sizes > max_bytes
    if not over.any():
        return features, []
    by_offset = {r.offset: r for r in items}
    offsets = features.column("src_offset").to_numpy()
    letters = []
    for i in np.flatnonzero(over):
        record = by_offset[int(offsets[i])]
        letters.append(DeadLetter(record.value, f"{record.topic}/{record.partition}/{record.offset}", why[int(i)]))
    return features.filter(pa.array(~over)), letters


class _FeaturizeForScoringFn(beam.DoFn):
    def __init__(self, cfg: ScoreConfig):
        self.cfg = cfg

    def setup(self):
        cfg = self.cfg
        self.aggregates = scoring_aggregates(cfg)
        self.featurizer = scoring_featurizer(cfg, self.aggregates)
        self.limits = topic_limits(cfg, [cfg.topics.dead_letters])
        self.producer = new_producer(cfg.kafka.bootstrap, cfg.kafka.config, max_message_bytes=min(self.limits.values()))
        self.delivery = KafkaDelivery(self.producer, what="scorer", max_message_bytes=self.limits)
        self.totals = {"events": 0, "dead_letters": 0}

    def teardown(self):
        if getattr(self, "aggregates", None) is not None:
            self.aggregates.close()
        if getattr(self, "producer", None) is not None:
            close_client(self.producer)
            self.producer = None

    def start_bundle(self):
        self.batcher = MicroBatcher(self.cfg.score_batch_size, self.cfg.score_max_delay)

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
        batch, letters = featurize_records(items, self.featurizer, self.cfg.bounds,
                                           max_id_bytes=self.cfg.max_id_bytes, aggregates=self.aggregates)
        for letter in letters:
            key, value, headers = dead_letter_record(letter, max_bytes=self.limits[self.cfg.topics.dead_letters])
            self.delivery.send(self.cfg.topics.dead_letters, value, key=key, headers=headers)
        self.delivery.confirm()  # acknowledged before the offsets can be committed downstream
        self.totals["events"] += len(items)
        self.totals["dead_letters"] += len(letters)
        for name, n in id_fallback_counts(batch.features, self.cfg.spec.id_columns).items():  # scored on the fallback
            fallbacks = self.totals.setdefault("id_fallbacks", {})
            fallbacks[name] = fallbacks.get(name, 0) + n
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

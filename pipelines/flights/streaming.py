"""The flights streaming pipeline: raw JSON events on Kafka -> feature batches on Kafka.

It is made of named public pieces, each a Beam transform over a plain step that is usable
(and tested) on its own:

    ReadFromKafka(raw, unbounded, from the group's committed offsets)
      -> ParseFlightEvents       parse and validate each event (``parse_records``; the fused
                                 step parses a whole micro-batch at once with ``parse_batch``,
                                 which gives the same rows and reasons); ``errs``
      -> MicroBatchEvents        per raw partition: close at ``batch_size`` events, ``max_delay_s``
                                 after the first, or at the end of the reader's bundle (<= ~1 s)
                                 (``MicroBatcher``)
      -> FeaturizeFlightBatches  the weather/planes join and the *batch* ETL's feature code with
                                 the batch dataset's statistics and vocabularies
                                 (``FlightFeaturizer``); ``errs``
      -> EncodeArrow             one Arrow IPC record batch per message, split to fit the
                                 features topic's ``max.message.bytes`` (``encode_batches``)
      -> WriteToKafka            every send confirmed (``KafkaDelivery``)
    errs -> WriteDeadLettersToKafka  (``dead_letter_record``: the one wire format)

``build_flight_features`` composes exactly these transforms (for a bounded backfill on a batch
runner, where ``ReadFromKafka``'s own commit branch commits after the bundle is done).

Why the streaming job runs them fused (``FeaturizeFlightEvents``): its delivery guarantee is
"a raw offset is committed only after Kafka has acknowledged every feature row and dead letter
made from the events before it", and the trainer's exactly-once filter needs a raw
partition's rows on the features topic in offset order with no gap. Both are properties of
one sequence per partition: produce, confirm every send, then commit. Split into separate
steps, the commit would depend on the runner fusing the read with the write (a runner that
puts a boundary after the read may commit offsets whose rows are still in flight), and
micro-batches spanning bundles need Beam state, for which Prism gave a key's timer callbacks
and its elements different views (so flushes left offset order). So ``_FusedFeaturizeFn``
calls the same steps in that order inside the reader's bundle: ``MicroBatcher`` ->
``parse_batch`` -> ``FlightFeaturizer`` -> ``encode_batches`` -> ``KafkaDelivery.send`` /
``confirm`` (feature messages one at a time, so a failure leaves no gap behind a later
message) -> commit. A send Kafka does not accept (after retries where retriable) stops the
job with the Kafka error, the topic and the size; the offsets stay before the undelivered
events, so a restart delivers them.

The fused step reads one list of up to ``StreamConfig.read_batch_records`` (``--read-batch-records``,
default 2000) records per fetched chunk (``ReadFromKafka(batch_records=N)``), or per-record
elements with ``read_batch_records=None``: the same records in the same order either way, the
lists with Beam's per-element cost paid once per chunk. Its per-flush counts leave the
stage through a Reshuffle to a no-op sink: Prism 2.77 spins a bundle's progress loop on a
closed channel when its stage has no outputs (~0.7 of a core for as long as the unbounded read
runs, i.e. always).

The reference tables are read through Beam's ``FileSystems`` (any registered filesystem:
``gs://``, ``s3://``, ...) in the DoFn's ``setup`` rather than as side inputs: Beam 2.77
could not translate this DoFn's stateful form with a side input, and a side input would break
the fusion with the read that keeps a partition's flushes in order.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, NamedTuple

import apache_beam as beam
import pyarrow as pa
import pyarrow.parquet as pq

from connectors.arrow import EncodeArrow, encode_batches
from connectors.deadletter import ERRS, DeadLetter, WriteDeadLettersToKafka, dead_letter_record
from connectors.kafka import (DEFAULT_CONNECT_TIMEOUT_S, KafkaDelivery, KafkaRecord, KafkaWriteError,
                              PRODUCER_DEFAULTS, ReadFromKafka, WriteToKafka, close_client, new_consumer,
                              new_producer, retry_kafka, topic_max_message_bytes, value_budget)
from pipelines.flights import features as FF
from pipelines.flights.events import DEFAULT_BOUNDS, ParseBounds, events_table, parse_batch, parse_event
from pipelines.flights.status import write_status

_log = logging.getLogger(__name__)

#: Kafka's own default max.message.bytes: assumed when the broker does not say.
KAFKA_DEFAULT_MAX_MESSAGE_BYTES = 1_048_588


@dataclass
class StreamConfig:
    bootstrap: str
    raw_topic: str = "flights-raw"
    features_topic: str = "flights-features"
    dead_letter_topic: str = "flights-dead-letters"
    group_id: str = "flowtrain-features"
    batch_size: int = 2000  # --batch-size; 500 cost 2x the CPU per event in parse + featurize + train (bench stream)
    max_delay_s: float = 1.0
    stats: dict = field(default_factory=dict)  # the batch dataset manifest's "stats"
    weather_path: str = ""  # any Beam filesystem path
    planes_path: str = ""
    kafka_config: dict[str, Any] = field(default_factory=dict)  # SASL/SSL etc., for every client
    status_path: str | None = None  # prefix of per-instance JSON counters for `flowtrain stream`'s live line
    bounds: ParseBounds = DEFAULT_BOUNDS  # limits on one raw event (size, nesting, numbers)
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S  # no broker: fail within this bound
    retry_s: float = 120.0  # a retriable Kafka failure is retried this long before the job stops
    # How the raw topic is read: N gives one list of up to N records per fetched chunk
    # (ReadFromKafka(batch_records=N): Beam's per-element cost once per chunk, needed for ~10k
    # events/s on 2 cores); None gives ReadFromKafka's per-record elements, which the fused step
    # takes alike. read_client: ReadFromKafka(client=...), "kafka-python" or "confluent".
    read_batch_records: int | None = 2000
    read_client: str = "kafka-python"

    def __post_init__(self):
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"StreamConfig(batch_size={self.batch_size!r}): must be an integer >= 1 (--batch-size)")
        if not self.max_delay_s > 0:
            raise ValueError(f"StreamConfig(max_delay_s={self.max_delay_s!r}): must be > 0 seconds (--max-delay)")
        if self.read_batch_records is not None and (isinstance(self.read_batch_records, bool)
                                                    or not isinstance(self.read_batch_records, int)
                                                    or self.read_batch_records < 1):
            raise ValueError(f"StreamConfig(read_batch_records={self.read_batch_records!r}): must be an integer "
                             f">= 1, or None for per-record elements (--read-batch-records)")


# ---------------------------------------------------------------------------------------------
# The steps
# ---------------------------------------------------------------------------------------------
class ParsedEvent(NamedTuple):
    """A raw event that parsed and validated, with where it came from."""

    topic: str
    partition: int
    offset: int
    event: dict


def parse_records(records: Iterable, bounds: ParseBounds = DEFAULT_BOUNDS) -> tuple[list[ParsedEvent], list[DeadLetter]]:
    """``KafkaRecord``s -> parsed events and dead letters (one of the two per record, never an error)."""
    parsed, letters = [], []
    for r in records:
        out = parse_event(r.value, f"{r.topic}/{r.partition}/{r.offset}", bounds)
        if isinstance(out, DeadLetter):
            letters.append(out)
        else:
            parsed.append(ParsedEvent(r.topic, r.partition, r.offset, out))
    return parsed, letters


def read_table(path: str) -> pa.Table:
    """A Parquet file through Beam's FileSystems (local, gs://, s3://, any registered scheme)."""
    from apache_beam.io.filesystem import CompressionTypes
    from apache_beam.io.filesystems import FileSystems

    try:
        with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as fh:
            data = fh.read()
    except Exception as err:  # noqa: BLE001 - BeamIOError, OSError, a filesystem's own errors
        raise FileNotFoundError(f"stream pipeline: cannot read reference table {path!r} "
                                f"({type(err).__name__}: {err})") from err
    return pq.read_table(pa.BufferReader(data))


def load_reference_tables(weather_path: str, planes_path: str) -> tuple[pa.Table, pa.Table]:
    """The prepared weather and planes tables the features join, read through FileSystems."""
    return FF.prepare_weather(read_table(weather_path)), FF.prepare_planes(read_table(planes_path))


def _row_payload(table: pa.Table, i: int) -> dict:
    return {k: v for k, v in table.slice(i, 1).to_pylist()[0].items() if k not in ("src_partition", "src_offset")}


def featurize_rows_apart(fn: Callable[[pa.Table], tuple], table: pa.Table, what: str) -> tuple[list, list]:
    """Run ``fn`` on each row of ``table`` alone: the rows it fails on become dead letters with the
    error as reason, the others keep their results. The fallback when ``fn`` fails on a batch."""
    results, letters = [], []
    sources = table.column("source").to_pylist()
    for i in range(table.num_rows):
        try:
            results.append(fn(table.slice(i, 1)))
        except Exception as err:  # noqa: BLE001 - one event's content must not stop the pipeline
            letters.append(DeadLetter(_row_payload(table, i), sources[i],
                                      f"{what} failed: {type(err).__name__}: {str(err)[:500]}"))
    return results, letters


class FlightFeaturizer:
    """Parsed events -> (feature batch or None, dead letters), with the batch ETL's feature code.

    A failure on a batch (an event no check foresaw) is retried row by row, so only the rows
    that fail become dead letters (reason: the error); the batch goes on.
    """

    def __init__(self, stats: dict, weather: pa.Table, planes: pa.Table):
        self.stats, self.weather, self.planes = stats, weather, planes

    @classmethod
    def load(cls, stats: dict, weather_path: str, planes_path: str) -> "FlightFeaturizer":
        return cls(stats, *load_reference_tables(weather_path, planes_path))

    def _featurize(self, table: pa.Table):
        return FF.featurize_raw(table, self.weather, self.planes, self.stats,
                                passthrough=("src_partition", "src_offset"))

    def featurize(self, events: list[ParsedEvent]) -> tuple[pa.RecordBatch | None, list[DeadLetter]]:
        if not events:
            return None, []
        sources = [(e.topic, e.partition, e.offset) for e in events]
        try:
            table = events_table([e.event for e in events], sources)
        except Exception:  # noqa: BLE001 - find the event(s) that cannot become a row
            tables, letters = [], []
            for e, src in zip(events, sources):
                try:
                    tables.append(events_table([e.event], [src]))
                except Exception as err:  # noqa: BLE001
                    letters.append(DeadLetter(e.event, f"{src[0]}/{src[1]}/{src[2]}",
                                              f"unparseable event: {type(err).__name__}: {str(err)[:500]}"))
            if not tables:
                return None, letters
            features, more = self.featurize_table(pa.concat_tables(tables))
            return features, letters + more
        return self.featurize_table(table)

    def featurize_table(self, table: pa.Table | None) -> tuple[pa.RecordBatch | None, list[DeadLetter]]:
        """An events table (``events_table`` / ``parse_batch``) -> (features or None, dead letters)."""
        if table is None or not table.num_rows:
            return None, []
        try:
            return self._featurize(table)
        except Exception:  # noqa: BLE001
            results, letters = featurize_rows_apart(self._featurize, table, "featurizing")
        batches = [f for f, _ in results if f is not None and f.num_rows]
        letters = [letter for _, bad in results for letter in bad] + letters
        if not batches:
            return None, letters
        joined = pa.Table.from_batches(batches).combine_chunks()
        return joined.to_batches()[0], letters


class MicroBatcher:
    """Buffers items per key; a key's batch closes at ``batch_size`` items or ``max_delay_s`` after
    its first item (checked when an item arrives), and ``drain`` closes every open batch."""

    def __init__(self, batch_size: int, max_delay_s: float):
        if batch_size < 1:
            raise ValueError(f"MicroBatcher(batch_size={batch_size}): must be >= 1")
        self.batch_size, self.max_delay_s = batch_size, max_delay_s
        self._buffers: dict[Any, list] = {}
        self._first_at: dict[Any, float] = {}

    def add(self, key, item) -> list | None:
        buf = self._buffers.setdefault(key, [])
        if not buf:
            self._first_at[key] = time.monotonic()
        buf.append(item)
        if len(buf) >= self.batch_size or time.monotonic() - self._first_at[key] >= self.max_delay_s:
            return self._buffers.pop(key)
        return None

    def drain(self) -> list[tuple[Any, list]]:
        out = [(k, v) for k, v in self._buffers.items() if v]
        self._buffers = {}
        return out


# ---------------------------------------------------------------------------------------------
# The transforms
# ---------------------------------------------------------------------------------------------
class _ParseFn(beam.DoFn):
    def __init__(self, bounds: ParseBounds):
        self._bounds = bounds

    def process(self, record: KafkaRecord):
        parsed, letters = parse_records([record], self._bounds)
        yield from parsed
        for letter in letters:
            yield beam.pvalue.TaggedOutput(ERRS, letter)


class ParseFlightEvents(beam.PTransform):
    """``KafkaRecord``s -> ``ParsedEvent``s; bad events to the ``errs`` output with their reason.

    ``events, errs = records | ParseFlightEvents(bounds)``
    """

    def __init__(self, bounds: ParseBounds = DEFAULT_BOUNDS):
        super().__init__()
        self._bounds = bounds

    def expand(self, records):
        return records | "Parse" >> beam.ParDo(_ParseFn(self._bounds)).with_outputs(ERRS, main="events")


class _MicroBatchFn(beam.DoFn):
    def __init__(self, batch_size: int, max_delay_s: float):
        self._args = (batch_size, max_delay_s)

    def start_bundle(self):
        self._batcher = MicroBatcher(*self._args)

    def process(self, event: ParsedEvent):
        closed = self._batcher.add((event.topic, event.partition), event)
        if closed:
            yield closed

    def finish_bundle(self):
        from apache_beam.transforms.window import GlobalWindow
        from apache_beam.utils.windowed_value import WindowedValue

        for _, batch in self._batcher.drain():
            yield WindowedValue(batch, GlobalWindow().max_timestamp(), [GlobalWindow()])


class MicroBatchEvents(beam.PTransform):
    """``ParsedEvent``s -> lists of them per raw partition, closed by size, delay or bundle end."""

    def __init__(self, batch_size: int, max_delay_s: float):
        super().__init__()
        self._fn = _MicroBatchFn(batch_size, max_delay_s)

    def expand(self, events):
        return events | "MicroBatch" >> beam.ParDo(self._fn)


class _FeaturizeFn(beam.DoFn):
    def __init__(self, stats, weather_path, planes_path):
        self._args = (stats, weather_path, planes_path)

    def setup(self):
        self._featurizer = FlightFeaturizer.load(*self._args)

    def process(self, events: list[ParsedEvent]):
        features, letters = self._featurizer.featurize(events)
        if features is not None and features.num_rows:
            yield features
        for letter in letters:
            yield beam.pvalue.TaggedOutput(ERRS, letter)


class FeaturizeFlightBatches(beam.PTransform):
    """Lists of ``ParsedEvent``s -> feature RecordBatches (with ``src_partition``/``src_offset``);
    rows the feature code rejects to ``errs``."""

    def __init__(self, stats: dict, weather_path: str, planes_path: str):
        super().__init__()
        self._fn = _FeaturizeFn(stats, weather_path, planes_path)

    def expand(self, batches):
        return batches | "Featurize" >> beam.ParDo(self._fn).with_outputs(ERRS, main="features")


def _features_key(batch: pa.RecordBatch) -> bytes:
    """Keyed by raw partition: its rows stay in offset order on one feature partition."""
    return str(batch.column("src_partition")[0].as_py()).encode()


def build_flight_features(records, cfg: StreamConfig, *, max_message_bytes: int | None = None):
    """The pipeline as separate public transforms (see the module doc for why the streaming job
    runs them fused). Returns ``(features, dead_letters)`` PCollections after writing both.

    Feature messages are split to fit ``max_message_bytes`` (default: the features topic's
    ``max.message.bytes``, read from the broker now)."""
    if max_message_bytes is None:
        max_message_bytes = _message_limit(cfg, cfg.features_topic)
    events, parse_errs = records | "ParseEvents" >> ParseFlightEvents(cfg.bounds)
    batches = events | "MicroBatch" >> MicroBatchEvents(cfg.batch_size, cfg.max_delay_s)
    features, feature_errs = batches | "Featurize" >> FeaturizeFlightBatches(
        cfg.stats, cfg.weather_path, cfg.planes_path)
    budget = value_budget(max_message_bytes, b"0" * 20)  # keys are raw partition numbers
    _ = (features | "Encode" >> EncodeArrow(key_fn=_features_key, max_message_bytes=budget)
         | "WriteFeatures" >> WriteToKafka(cfg.bootstrap, cfg.features_topic, producer_config=cfg.kafka_config,
                                           retry_s=cfg.retry_s))
    letters = (parse_errs, feature_errs) | "AllDeadLetters" >> beam.Flatten()
    _ = letters | "WriteDeadLetters" >> WriteDeadLettersToKafka(
        cfg.bootstrap, cfg.dead_letter_topic, producer_config=cfg.kafka_config, retry_s=cfg.retry_s)
    return features, letters


def _message_limit(cfg: StreamConfig, topic: str) -> int:
    """The most bytes one record to ``topic`` may have: its max.message.bytes (read from the broker;
    Kafka's default if it does not say), at most the producer's max_request_size."""
    max_request = int(cfg.kafka_config.get("max_request_size", PRODUCER_DEFAULTS["max_request_size"]))
    limit = topic_max_message_bytes(cfg.bootstrap, topic, client_config=cfg.kafka_config)
    return min(limit or KAFKA_DEFAULT_MAX_MESSAGE_BYTES, max_request)


# ---------------------------------------------------------------------------------------------
# The fused step the streaming job runs
# ---------------------------------------------------------------------------------------------
class _FusedFeaturizeFn(beam.DoFn):
    """The steps above, in order, per raw partition inside the reader's bundle; commits the raw
    offsets only after every feature row and dead letter before them is acknowledged.

    No Beam state: a partition's restriction is read by one bundle at a time, in offset order,
    so each flush covers the offsets right after the previous one and commits stay contiguous.
    """

    def __init__(self, cfg: StreamConfig):
        self.cfg = cfg

    def setup(self):
        cfg = self.cfg
        self.featurizer = FlightFeaturizer.load(cfg.stats, cfg.weather_path, cfg.planes_path)
        self.limits = {topic: _message_limit(cfg, topic) for topic in (cfg.features_topic, cfg.dead_letter_topic)}
        self.producer = new_producer(cfg.bootstrap, cfg.kafka_config, max_message_bytes=min(self.limits.values()))
        self.delivery = KafkaDelivery(self.producer, what="", max_message_bytes=self.limits,
                                      retry_s=cfg.retry_s)
        self.committer = new_consumer(cfg.bootstrap, cfg.kafka_config, group_id=cfg.group_id)
        self.totals = {"events": 0, "rows": 0, "dead_letters": 0, "batches": 0, "messages": 0}

    def teardown(self):
        for client in ("producer", "committer"):
            if getattr(self, client, None) is not None:
                close_client(getattr(self, client))
                setattr(self, client, None)

    def start_bundle(self):
        self.batcher = MicroBatcher(self.cfg.batch_size, self.cfg.max_delay_s)

    def process(self, element):
        # A KafkaRecord, or a list of them: one fetched chunk of one partition, in offset order
        # (ReadFromKafka(batch_records=N), StreamConfig.read_batch_records).
        for record in (element if isinstance(element, list) else (element,)):
            closed = self.batcher.add((record.topic, record.partition), record)
            if closed:
                yield self._flush(record.topic, record.partition, closed)

    def finish_bundle(self):
        from apache_beam.transforms.window import GlobalWindow
        from apache_beam.utils.windowed_value import WindowedValue

        for (topic, partition), items in self.batcher.drain():
            yield WindowedValue(self._flush(topic, partition, items), GlobalWindow().max_timestamp(),
                                [GlobalWindow()])

    def _flush(self, topic: str, partition: int, items: list) -> tuple[int, int, int, int]:
        # The micro-batch parsed in one pyarrow call (parse_batch equals parse_records row by row).
        table, letters = parse_batch([r.value for r in items], [(r.topic, r.partition, r.offset) for r in items],
                                     self.cfg.bounds)
        features, bad = self.featurizer.featurize_table(table)
        letters += bad
        try:
            messages = self._deliver(partition, features, letters)
        except Exception as err:
            text = str(err) if isinstance(err, KafkaWriteError) else f"{type(err).__name__}: {err}"
            self._write_status(error=f"{text} (raw {topic}/{partition} offsets {items[0].offset}.."
                                     f"{items[-1].offset} not committed)")
            raise
        rows = features.num_rows if features is not None else 0
        self._commit(topic, partition, items[-1].offset + 1)
        self.totals["events"] += len(items)
        self.totals["rows"] += rows
        self.totals["dead_letters"] += len(letters)
        self.totals["batches"] += 1
        self.totals["messages"] += messages
        self._write_status()
        return partition, len(items), rows, len(letters)

    def _deliver(self, partition: int, features: pa.RecordBatch | None, letters: list[DeadLetter]) -> int:
        """Dead letters, then the feature messages one at a time, each confirmed; returns messages."""
        cfg, delivery = self.cfg, self.delivery
        for letter in letters:
            key, value, headers = dead_letter_record(letter, max_bytes=self.limits[cfg.dead_letter_topic])
            delivery.send(cfg.dead_letter_topic, value, key=key, headers=headers)
        sent = 0
        if features is not None and features.num_rows:
            key = str(partition).encode()
            for message in encode_batches(features, value_budget(self.limits[cfg.features_topic], key)):
                delivery.send(cfg.features_topic, message, key=key)
                delivery.confirm()  # in order, no gap: a later message never lands before a lost one
                sent += 1
        delivery.confirm()
        return sent

    def _commit(self, topic: str, partition: int, next_offset: int) -> None:
        from kafka import OffsetAndMetadata, TopicPartition

        offsets = {TopicPartition(topic, partition): OffsetAndMetadata(next_offset, "", -1)}
        retry_kafka(lambda: self.committer.commit(offsets), "offset commit", deadline_s=self.cfg.retry_s)

    def _write_status(self, error: str | None = None) -> None:
        write_status(self.cfg.status_path, self, {**self.totals, **({"error": error} if error else {})})


class FeaturizeFlightEvents(beam.PTransform):
    """Raw ``KafkaRecord``s -> features and dead letters on Kafka, offsets committed after the acks
    (the fused step; see the module doc). Outputs ``(partition, events, rows, dead letters)``."""

    def __init__(self, cfg: StreamConfig):
        super().__init__()
        self.cfg = cfg

    def expand(self, records):
        return records | "MicroBatchFeaturize" >> beam.ParDo(_FusedFeaturizeFn(self.cfg))


def build_stream_pipeline(pipeline: beam.Pipeline, cfg: StreamConfig):
    read = {}  # only what differs from ReadFromKafka's defaults
    if cfg.read_batch_records is not None:
        read["batch_records"] = cfg.read_batch_records
    if cfg.read_client != "kafka-python":
        read["client"] = cfg.read_client
    raw = pipeline | "ReadRaw" >> ReadFromKafka(cfg.bootstrap, cfg.raw_topic, start="committed",
                                                group_id=cfg.group_id, commit_offsets=False,
                                                consumer_config=cfg.kafka_config,
                                                connect_timeout_s=cfg.connect_timeout_s, **read)
    counts = raw | "Featurize" >> FeaturizeFlightEvents(cfg)
    # The per-flush counts leave the fused stage through a Reshuffle to a no-op sink: on Prism
    # 2.77 a stage with no outputs spins its bundle loop on a closed channel for as long as a
    # bundle runs (the unbounded read always has one), ~0.7 of a core; with an output, 0.06.
    _ = counts | "CountsOut" >> beam.Reshuffle() | "Drop" >> beam.Map(_drop)
    return counts


def _drop(_counts) -> None:
    return None

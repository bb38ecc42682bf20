"""Pure-Python Kafka I/O for Apache Beam: ``ReadFromKafka`` and ``WriteToKafka``.

The reader follows Java KafkaIO's ``ReadFromKafkaDoFn``: an ``Impulse`` resolves one
``PartitionRead`` per topic-partition, a ``Reshuffle`` spreads them over workers, and a
splittable DoFn reads each partition with its own assigned consumer. Its restriction is an
offset range that grows with the log (``[start, UNBOUNDED)``) or ends at a resolved stop
offset; it fetches chunks of records (``connectors.kafka.fetch``: kafka-python's batched
``poll`` or confluent-kafka's ``consume``), claims each chunk's last offset with ``try_claim``
once, emits the chunk's records (or, with ``batch_records``, the chunk as one list), defers the
remainder when caught up, and only checkpoints (never splits a partition), so records stay in
log order.

Why an SDF and not Beam 2.77's experimental ``unbounded_source``: that wrapper depends on
bundle finalization for its checkpoint marks, which Prism (the local streaming runner) does
not support, while an SDF with a commit branch works on Prism, the FnApiRunner, Flink and
Dataflow alike.

Delivery guarantee: records reach the pipeline exactly as the runner's SDF checkpointing
allows (exactly-once processing on runners with durable checkpoints). Group offsets are
committed by a separate branch (max offset per partition and window, after a GroupByKey), so
a commit happens only after the bundle that read the record has been durably committed by
the runner. A consumer group that restarts from its committed offsets therefore sees every
record at least once: records read but not yet committed are read again.
"""
from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import apache_beam as beam
from apache_beam.io.watermark_estimators import ManualWatermarkEstimator
from apache_beam.transforms import window
from apache_beam.transforms.core import RestrictionProvider, WatermarkEstimatorProvider
from apache_beam.utils.timestamp import MIN_TIMESTAMP, Duration, Timestamp
from apache_beam.utils.windowed_value import WindowedValue
from kafka import OffsetAndMetadata, TopicPartition
from kafka.errors import KafkaTimeoutError

from connectors.kafka import offsets
from connectors.kafka.admin import check_brokers
from connectors.kafka.clients import (
    DEFAULT_CONNECT_TIMEOUT_S,
    KafkaUnavailable,
    close_client,
    new_consumer,
    retry_kafka,
    topic_partitions,
    unavailable_message,
)
from connectors.kafka.fetch import check_client, confluent_config, open_fetcher
from connectors.kafka.offsets import UNBOUNDED, PartitionRead
from connectors.kafka.record import KafkaRecord
from connectors.kafka.restriction import EndOffsets, PartitionRange, PartitionTracker

__all__ = ["ReadFromKafka"]

_log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Resolving partitions and offsets (runs once, on a worker, when the pipeline starts)
# --------------------------------------------------------------------------------------------
class _ResolvePartitionsFn(beam.DoFn):
    """Impulse -> one ``PartitionRead`` per topic-partition, offsets resolved against the broker."""

    def __init__(self, bootstrap_servers, topics, start, stop, group_id, consumer_config,
                 connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S):
        self._cfg = (bootstrap_servers, consumer_config)
        self._topics, self._start, self._stop, self._group_id = topics, start, stop, group_id
        self._connect_timeout_s = connect_timeout_s

    def process(self, _impulse) -> Iterable[PartitionRead]:
        bootstrap, _ = self._cfg
        try:
            yield from self._resolve()
        except KafkaTimeoutError as err:
            raise KafkaUnavailable(unavailable_message(bootstrap, self._connect_timeout_s, str(err))) from None

    def _resolve(self) -> Iterable[PartitionRead]:
        bootstrap, extra = self._cfg
        timeout_ms = int(self._connect_timeout_s * 1000)
        consumer = new_consumer(bootstrap, extra, group_id=self._group_id, bootstrap_timeout_ms=timeout_ms)
        try:
            tps = []
            for topic in self._topics:
                parts = topic_partitions(consumer, topic, timeout_s=self._connect_timeout_s)
                if not parts:
                    raise ValueError(f"ReadFromKafka: topic {topic!r} does not exist on {bootstrap} "
                                     f"(or has no partitions); create it or fix `topics`")
                tps += [TopicPartition(topic, p) for p in sorted(parts)]
            beginning = consumer.beginning_offsets(tps)
            end = consumer.end_offsets(tps)
            start_times = stop_times = {}
            if offsets.is_time(self._start):
                ms = offsets.to_millis(self._start)
                start_times = consumer.offsets_for_times({tp: ms for tp in tps})
            stop_ms = offsets.to_millis(self._stop) if offsets.is_time(self._stop) else None
            if stop_ms is not None:
                stop_times = consumer.offsets_for_times({tp: stop_ms for tp in tps})
            for tp in tps:
                committed = consumer.committed(tp) if self._start == "committed" else None
                at_start = start_times.get(tp)
                first = offsets.start_offset(
                    self._start, topic=tp.topic, partition=tp.partition, beginning=beginning[tp],
                    end=end[tp], committed=committed, for_time=at_start.offset if at_start else None)
                at_stop = stop_times.get(tp)
                last = offsets.stop_offset(self._stop, start=first, end=end[tp],
                                           for_time=at_stop.offset if at_stop else None)
                yield PartitionRead(tp.topic, tp.partition, first, last, stop_ms)
        finally:
            close_client(consumer)


# --------------------------------------------------------------------------------------------
# The splittable DoFn
# --------------------------------------------------------------------------------------------
# The reader is a root transform (Impulse -> Reshuffle -> the SDF), so its input and output
# are in the global window. Emitting a WindowedValue with that window spares Beam re-assigning
# windows for every record, which a TimestampedValue costs (~15% of a bounded read's time).
_GLOBAL_WINDOWS = (window.GlobalWindow(),)


class _WatermarkProvider(WatermarkEstimatorProvider):
    def initial_estimator_state(self, element, restriction):
        return MIN_TIMESTAMP

    def create_watermark_estimator(self, estimator_state):
        return ManualWatermarkEstimator(estimator_state)


class _ReadPartitionFn(beam.DoFn, RestrictionProvider):
    """Reads one partition's offset range in chunks; emits ``KafkaRecord``s stamped with Kafka
    time, or with ``batch_records`` one list of records per chunk (stamped with its latest time).

    Each chunk (at most ``batch_records`` records, or the fetcher's poll size) is cut at the
    stop offset and the stop time, and claimed once, by its last offset, before any of it is
    emitted: a checkpoint lands between chunks, never inside one.

    The DoFn is its own restriction provider (Beam uses the DoFn when ``RestrictionParam``
    names none), so the backlog estimates can reach the broker this read was configured for.
    """

    #: Records per fetch of the per-record form (it emits them one by one).
    PER_RECORD_FETCH = 10_000

    def __init__(self, bootstrap_servers, consumer_config, *, poll_interval_s: float,
                 idle_watermark_lag_s: float, max_read_s: float, batch_records: int | None = None,
                 client: str = "kafka-python", live_read_s: float | None = None):
        self._cfg = (bootstrap_servers, consumer_config)
        self._poll_interval_s = poll_interval_s
        self._idle_lag_ms = int(idle_watermark_lag_s * 1000)
        self._max_read_s = max_read_s
        self._live_read_s = live_read_s
        self._batch_records = batch_records
        self._client = client
        self._ends = EndOffsets(bootstrap_servers, consumer_config)
        self._consumers: dict = {}

    # -- restriction provider ---------------------------------------------------------------
    def initial_restriction(self, element: PartitionRead) -> PartitionRange:
        return PartitionRange(element.topic, element.partition, element.start_offset, element.stop_offset)

    def create_tracker(self, restriction: PartitionRange) -> PartitionTracker:
        return PartitionTracker(restriction, self._ends)

    def split(self, element, restriction):
        yield restriction  # a partition is one unit of parallelism

    def restriction_size(self, element, restriction: PartitionRange) -> float:
        end = self._ends.get(restriction.topic, restriction.partition, restriction.start)
        return float(offsets.backlog(restriction.start, restriction.stop, end))

    def truncate(self, element, restriction: PartitionRange):
        # On drain an unbounded read stops where it stands; a bounded one finishes.
        return None if restriction.stop == UNBOUNDED else restriction

    # -- reading ------------------------------------------------------------------------------
    def setup(self):
        self._consumers = {}

    def teardown(self):
        for fetcher in self._consumers.values():
            fetcher.close()
        self._consumers = {}

    def _release(self, topic: str, partition: int) -> None:
        """A finished partition frees its consumer (bounded reads end with no teardown call)."""
        fetcher = self._consumers.pop((topic, partition), None)
        if fetcher is not None:
            fetcher.close()

    def _fetcher_at(self, topic: str, partition: int, position: int):
        """This worker's fetcher of the partition (``connectors.kafka.fetch``), at ``position``."""
        fetcher = self._consumers.get((topic, partition))
        if fetcher is None:
            fetcher = self._consumers[(topic, partition)] = open_fetcher(
                self._client, *self._cfg, topic, partition, position)
        else:
            fetcher.seek(position)
        return fetcher

    def process(self, element: PartitionRead,
                tracker=beam.DoFn.RestrictionParam(),
                watermark=beam.DoFn.WatermarkEstimatorParam(_WatermarkProvider())):
        stop = tracker.current_restriction().stop
        position = tracker.current_restriction().start
        if position >= stop:
            tracker.try_claim(stop)
            return
        topic, partition, stop_ms = element.topic, element.partition, element.stop_time_ms
        fetcher = self._fetcher_at(topic, partition, position)
        started = time.monotonic()
        deadline = started + self._max_read_s
        wm_ms = watermark.current_watermark().micros // 1000
        chunk_size = self._batch_records or self.PER_RECORD_FETCH
        batched = self._batch_records is not None
        poll_ms = int(self._poll_interval_s * 1000)
        stamp_ms, stamp = None, None
        while True:
            # Never fetch past the stop offset: records beyond it are neither decoded nor emitted.
            want = min(chunk_size, stop - position)
            records = fetcher.fetch(want, poll_ms)
            if self._live_read_s is not None and len(records) < want:
                # a short fetch: the partition is caught up, its next records are being written now; hand back
                # soon so that the partitions read after this one in the bundle are not kept waiting
                deadline = min(deadline, started + self._live_read_s)
            if records and records[0].offset < position:  # a stale fetch from before a seek
                records = [r for r in records if r.offset >= position]
            if records:
                cut, done = _cut(records, stop, stop_ms)
                if cut:
                    chunk = records[:cut] if cut < len(records) else records
                    if not tracker.try_claim(chunk[-1].offset):
                        # the runner checkpointed this read before the chunk (a bare return: Beam
                        # warns of 'yield and return' on a return followed by anything)
                        return
                    position = chunk[-1].offset + 1
                    if batched:
                        chunk_max_ms = max(r.timestamp for r in chunk)
                        yield WindowedValue(chunk, Timestamp(micros=chunk_max_ms * 1000), _GLOBAL_WINDOWS)
                    else:
                        chunk_max_ms = wm_ms
                        for rec in chunk:
                            if rec.timestamp != stamp_ms:  # neighbours share a millisecond: one Timestamp
                                stamp_ms = rec.timestamp
                                stamp = Timestamp(micros=stamp_ms * 1000)
                                if stamp_ms > chunk_max_ms:
                                    chunk_max_ms = stamp_ms
                            yield WindowedValue(rec, stamp, _GLOBAL_WINDOWS)
                    if chunk_max_ms > wm_ms:  # per partition, monotonic: the max timestamp read so far
                        wm_ms = chunk_max_ms
                        watermark.set_watermark(Timestamp(micros=wm_ms * 1000))
                if done or position >= stop:
                    tracker.try_claim(stop)  # the stop offset or the stop time is reached: done
                    self._release(topic, partition)
                    return
                if time.monotonic() >= deadline:
                    # Hand the bundle back so its output flows downstream; resume at once.
                    tracker.defer_remainder(Duration(0))
                    return
                continue
            # Nothing fetched: the partition is caught up or beyond its stop.
            log_position = fetcher.position()
            if stop != UNBOUNDED and log_position >= stop:
                tracker.try_claim(stop)  # only gaps (control records) were left
                self._release(topic, partition)
                return
            end = self._ends.get(topic, partition, log_position)
            if log_position >= end:
                idle = offsets.idle_watermark_ms(wm_ms, int(time.time() * 1000), self._idle_lag_ms)
                if idle > wm_ms:
                    wm_ms = idle
                    watermark.set_watermark(Timestamp(micros=wm_ms * 1000))
            tracker.defer_remainder(Duration(seconds=self._poll_interval_s))
            return


def _cut(records: list, stop: int, stop_ms: int | None) -> tuple[int, bool]:
    """How many of the fetched records belong to the range (before the stop offset and the first
    record at or after the stop time), and whether the range ends inside this fetch."""
    cut = len(records)
    if records[-1].offset >= stop:
        cut = bisect.bisect_left(records, stop, key=_offset_of)
    if stop_ms is not None:
        for i in range(cut):
            if records[i].timestamp >= stop_ms:
                return i, True
    return cut, cut < len(records)


def _offset_of(record) -> int:
    return record.offset


class _ReadBoundedPartitionFn(_ReadPartitionFn):
    pass


@beam.DoFn.unbounded_per_element()
class _ReadUnboundedPartitionFn(_ReadPartitionFn):
    pass


# --------------------------------------------------------------------------------------------
# Committing group offsets after the reading bundle is durable
# --------------------------------------------------------------------------------------------
class _CommitOffsetsFn(beam.DoFn):
    """((topic, partition), max offset) -> commit offset + 1 for the group, never backwards."""

    def __init__(self, bootstrap_servers, group_id, consumer_config):
        self._cfg = (bootstrap_servers, consumer_config)
        self._group_id = group_id
        self._consumer = None
        self._committed: dict = {}

    def setup(self):
        self._consumer = new_consumer(*self._cfg, group_id=self._group_id)
        self._committed = {}

    def teardown(self):
        if self._consumer is not None:
            close_client(self._consumer)
            self._consumer = None

    def process(self, element):
        (topic, partition), offset = element
        if self._committed.get((topic, partition), -1) >= offset + 1:
            return
        offsets_ = {TopicPartition(topic, partition): OffsetAndMetadata(offset + 1, "", -1)}
        retry_kafka(lambda: self._consumer.commit(offsets_), "offset commit")
        self._committed[(topic, partition)] = offset + 1
        yield (topic, partition, offset + 1)


class ReadFromKafka(beam.PTransform):
    """Reads Kafka topics as ``KafkaRecord``s, one parallel reader per topic-partition.

    Args:
      bootstrap_servers: ``"host:port"`` or a list of them.
      topics: a topic name or a list of names.
      start: ``"earliest"`` (default), ``"latest"``, ``"committed"`` (the group's offsets;
        partitions without a commit start at the earliest offset), a ``{(topic, partition):
        offset}`` dict (partitions not in it start at the earliest offset), or a ``datetime`` /
        ``Timestamp`` (the first record at or after it).
      stop: ``None`` (unbounded, a streaming read), ``"end"`` (the end offsets seen when the read
        starts: a bounded backfill), an ``int`` N (the next N offsets of each partition), or a
        ``datetime`` / ``Timestamp`` (records before it). Bounded reads finish on batch runners.
      group_id: consumer group whose offsets ``start="committed"`` reads and, with
        ``commit_offsets``, that the read commits after its bundles are durable.
      consumer_config: extra kafka-python consumer settings (SASL/SSL options pass through).
      commit_offsets: commit the group's offsets (default: when ``group_id`` is given).
      commit_window_s: event-time window over which the max offset per partition is committed.
      poll_interval_s: how long a poll waits and how long a caught-up partition defers.
      idle_watermark_lag_s: a caught-up partition's watermark advances to now minus this lag.
      max_read_s: longest time one ``process`` call reads before handing its output downstream
        (default 1 s for unbounded reads, for latency; 30 s for bounded ones, for throughput).
      live_read_s: once a fetch comes back short of what it asked for (the partition has caught up:
        its next records are being written now), the call hands back ``live_read_s`` after it
        started instead (default None: ``max_read_s`` always). A runner that reads a bundle's
        partitions one after another (Prism does) keeps the others' events waiting while one reads:
        short reads when caught up keep their latency down, long ones under a backlog keep the
        per-bundle cost low.
      batch_records: emit one element per fetched chunk of at most this many records of one
        partition: a ``list`` of the same ``KafkaRecord``s the per-record form emits, in offset
        order, stamped with the chunk's latest record timestamp (default None: one element per
        record). A chunk never crosses the stop offset or time; with ``stop=N`` chunks of a
        partition cover exactly its first N offsets. Group offsets are committed per chunk
        (its last offset). Saves Beam's per-element cost when the next step handles records
        in bulk (decodes, counts, writes); see ``flowtrain bench kafka``.
      client: ``"kafka-python"`` (default) or ``"confluent"`` (confluent-kafka on librdkafka,
        the extra ``flowtrain[kafka-confluent]``): the client of the reading consumers. Both give
        the same records; resolving offsets and commits use kafka-python either way, and
        ``consumer_config`` keeps kafka-python's option names (dotted librdkafka properties pass
        through to the confluent consumers).
      connect_timeout_s: with no broker answering, the read fails within this bound with
        ``KafkaUnavailable`` naming the bootstrap servers (default 30 s). The pipeline's
        construction checks the brokers once within the same bound, unless
        ``check_brokers_at_build=False`` (for a launcher that cannot reach the brokers its
        workers reach).
    """

    def __init__(self, bootstrap_servers: str | Sequence[str], topics: str | Sequence[str], *,
                 start: offsets.StartSpec = "earliest", stop: offsets.StopSpec = None,
                 group_id: str | None = None, consumer_config: Mapping[str, Any] | None = None,
                 commit_offsets: bool | None = None, commit_window_s: float = 5.0,
                 poll_interval_s: float = 0.2, idle_watermark_lag_s: float = 0.0,
                 max_read_s: float | None = None, connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
                 check_brokers_at_build: bool = True, batch_records: int | None = None,
                 client: str = "kafka-python", live_read_s: float | None = None):
        super().__init__()
        if batch_records is not None and (isinstance(batch_records, bool) or not isinstance(batch_records, int)
                                          or batch_records < 1):
            raise ValueError(f"ReadFromKafka(batch_records={batch_records!r}): must be a positive int (records "
                             f"per emitted list), or None for one element per record")
        self._client = check_client(client)
        if client == "confluent":
            confluent_config(bootstrap_servers, consumer_config)  # an untranslatable option fails here
        self._batch_records = batch_records
        if not connect_timeout_s or connect_timeout_s <= 0:
            raise ValueError(f"ReadFromKafka(connect_timeout_s={connect_timeout_s!r}): must be > 0 seconds")
        self._connect_timeout_s = connect_timeout_s
        self._check_at_build = check_brokers_at_build
        offsets.validate_start(start)
        offsets.validate_stop(stop)
        if start == "committed" and not group_id:
            raise ValueError("ReadFromKafka(start='committed') needs group_id: the committed offsets "
                             "belong to a consumer group")
        self._bootstrap = bootstrap_servers
        self._topics = [topics] if isinstance(topics, str) else list(topics)
        self._start, self._stop = start, stop
        self._group_id = group_id
        self._consumer_config = dict(consumer_config or {})
        self._commit = bool(group_id) if commit_offsets is None else commit_offsets
        if self._commit and not group_id:
            raise ValueError("ReadFromKafka(commit_offsets=True) needs group_id")
        self._commit_window_s = commit_window_s
        self._read_opts = {"poll_interval_s": poll_interval_s,
                           "idle_watermark_lag_s": idle_watermark_lag_s,
                           "max_read_s": max_read_s if max_read_s is not None else (1.0 if stop is None else 30.0),
                           "batch_records": batch_records, "client": self._client}
        if live_read_s is not None:
            if live_read_s < 0:
                raise ValueError(f"ReadFromKafka(live_read_s={live_read_s!r}): must be >= 0 seconds")
            self._read_opts["live_read_s"] = live_read_s

    def expand(self, pbegin):
        if self._check_at_build:
            check_brokers(self._bootstrap, timeout_s=self._connect_timeout_s, client_config=self._consumer_config)
        read_fn = (_ReadBoundedPartitionFn if self._stop is not None else _ReadUnboundedPartitionFn)(
            self._bootstrap, self._consumer_config, **self._read_opts)
        records = (
            pbegin
            | "Impulse" >> beam.Impulse()
            | "ResolvePartitions" >> beam.ParDo(_ResolvePartitionsFn(
                self._bootstrap, self._topics, self._start, self._stop, self._group_id,
                self._consumer_config, self._connect_timeout_s))
            | "SpreadPartitions" >> beam.Reshuffle()
            | "ReadPartitions" >> beam.ParDo(read_fn).with_input_types(PartitionRead)
            .with_output_types(KafkaRecord if self._batch_records is None else list[KafkaRecord])
        )
        if self._commit:
            last = (lambda r: ((r.topic, r.partition), r.offset)) if self._batch_records is None else (
                lambda chunk: ((chunk[-1].topic, chunk[-1].partition), chunk[-1].offset))
            _ = (
                records
                | "OffsetPerPartition" >> beam.Map(last)
                | "CommitWindow" >> beam.WindowInto(window.FixedWindows(self._commit_window_s))
                | "MaxOffset" >> beam.CombinePerKey(max)
                | "CommitOffsets" >> beam.ParDo(_CommitOffsetsFn(self._bootstrap, self._group_id,
                                                                 self._consumer_config))
            )
        return records

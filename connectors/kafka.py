"""Pure-Python Kafka I/O for Apache Beam: ``ReadFromKafka`` and ``WriteToKafka``.

The reader follows Java KafkaIO's ``ReadFromKafkaDoFn``: an ``Impulse`` resolves one
``PartitionRead`` per topic-partition, a ``Reshuffle`` spreads them over workers, and a
splittable DoFn reads each partition with its own assigned consumer. Its restriction is an
offset range that grows with the log (``[start, UNBOUNDED)``) or ends at a resolved stop
offset; it fetches chunks of records (``connectors.kafka_fetch``: kafka-python's batched
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

import atexit
import bisect
import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Iterable, List, Mapping, Sequence

import apache_beam as beam
from apache_beam.io.iobase import RestrictionProgress
from apache_beam.io.iobase import RestrictionTracker
from apache_beam.io.watermark_estimators import ManualWatermarkEstimator
from apache_beam.transforms import window
from apache_beam.transforms.core import RestrictionProvider, WatermarkEstimatorProvider
from apache_beam.utils.timestamp import MIN_TIMESTAMP, Duration, Timestamp
from apache_beam.utils.windowed_value import WindowedValue

from connectors import kafka_offsets as offsets
from connectors.kafka_record import KafkaRecord
from connectors.kafka_offsets import UNBOUNDED, PartitionRead

__all__ = ["KafkaRecord", "ReadFromKafka", "WriteToKafka", "KafkaWriteError", "KafkaUnavailable",
           "KafkaDelivery", "PartitionRead", "PartitionRange", "close_all_clients", "ensure_topic",
           "retry_kafka", "check_brokers", "topic_max_message_bytes", "record_size", "value_budget",
           "new_producer", "new_consumer", "track_client", "close_client", "DEFAULT_CONNECT_TIMEOUT_S",
           "PRODUCER_DEFAULTS", "unavailable_message"]

_log = logging.getLogger(__name__)

# Every client this module opened and has not closed, held strongly: kafka-python 3 runs all
# clients' sockets on one shared IO thread, so a client dropped without ``close()`` (a DoFn the
# runner discards without teardown, a cancelled streaming job's in-process workers) would keep
# its connections and metadata refreshes alive for the life of the process. These are closed
# by ``close_all_clients`` and at exit.
_LIVE_CLIENTS: set = set()
_LIVE_LOCK = threading.Lock()


def track_client(client):
    """Register a Kafka client so that close_all_clients() closes it; returns the client."""
    with _LIVE_LOCK:
        _LIVE_CLIENTS.add(client)
    return client


def close_client(client, **close_kwargs) -> None:
    """Close a client registered with track_client() and forget it."""
    with _LIVE_LOCK:
        _LIVE_CLIENTS.discard(client)
    try:
        client.close(**close_kwargs)
    except Exception as err:  # noqa: BLE001 - a producer's close flushes; its records were confirmed or given up
        _log.debug("closing %s: %s", type(client).__name__, err)


def close_all_clients() -> int:
    """Close every Kafka client the connectors opened in this process; returns how many."""
    with _LIVE_LOCK:
        clients = list(_LIVE_CLIENTS)
        _LIVE_CLIENTS.clear()
        _SHARED_END_OFFSETS.clear()
    for client in clients:
        try:
            client.close()
        except Exception:  # noqa: BLE001 - closing is best effort
            pass
    return len(clients)


atexit.register(close_all_clients)


class KafkaWriteError(RuntimeError):
    """Kafka did not accept a record; the message names the Kafka error, the topic and the size."""


class KafkaUnavailable(ConnectionError):
    """No broker answered at the bootstrap servers within the bound; the message says what to check."""


#: How long a command or a read waits for a first answer from the brokers before it gives up.
DEFAULT_CONNECT_TIMEOUT_S = 30.0


@contextmanager
def _quiet_kafka_logs():
    """kafka-python logs a warning per failed connection attempt; a probe reports once instead."""
    kafka_log = logging.getLogger("kafka")
    before = kafka_log.level
    kafka_log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        kafka_log.setLevel(before)


def _servers(bootstrap_servers: str | Sequence[str]) -> str:
    return bootstrap_servers if isinstance(bootstrap_servers, str) else ",".join(bootstrap_servers)


def unavailable_message(bootstrap_servers: str | Sequence[str], timeout_s: float, detail: str = "") -> str:
    """The one line a user sees when no broker answers."""
    return (f"no Kafka broker answered at {_servers(bootstrap_servers)} within {timeout_s:g} s"
            f"{f' ({detail})' if detail else ''}: check that the broker runs (`flowtrain kafka status`, "
            f"or `flowtrain kafka start`), that the bootstrap servers are its host:port, and that the "
            f"client security settings (--kafka-config) match its listener")


# Brokers that answered a check in this process, and when: a pipeline that builds several reads
# of the same cluster checks it once a minute, not once per read.
_ANSWERED: dict[str, tuple[float, int]] = {}
_ANSWER_TTL_S = 60.0


def check_brokers(bootstrap_servers: str | Sequence[str], *, timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
                  client_config: Mapping[str, Any] | None = None) -> int:
    """Fail within ``timeout_s`` with ``KafkaUnavailable`` (one line) unless a broker answers.

    Returns the number of brokers in the cluster. Meant to run before any work starts, so that
    a wrong address or a stopped broker is a clear error instead of a client retrying for minutes.
    """
    from kafka import KafkaAdminClient
    from kafka.errors import KafkaError

    key = repr((_servers(bootstrap_servers), sorted(dict(client_config or {}).items(), key=str)))
    with _LIVE_LOCK:
        answered = _ANSWERED.get(key)
    if answered and time.monotonic() - answered[0] < _ANSWER_TTL_S:
        return answered[1]
    cfg = {k: v for k, v in dict(client_config or {}).items()
           if k in KafkaAdminClient.DEFAULT_CONFIG}
    cfg.update(bootstrap_servers=bootstrap_servers, bootstrap_timeout_ms=int(timeout_s * 1000),
               request_timeout_ms=max(1000, int(timeout_s * 1000)))
    with _quiet_kafka_logs():
        try:
            admin = KafkaAdminClient(**cfg)
        except KafkaError as err:
            raise KafkaUnavailable(unavailable_message(bootstrap_servers, timeout_s, type(err).__name__)) from None
        except (OSError, ValueError) as err:
            raise KafkaUnavailable(unavailable_message(bootstrap_servers, timeout_s, str(err))) from None
        try:
            brokers = max(1, len(admin.describe_cluster().get("brokers") or ()))
            with _LIVE_LOCK:
                _ANSWERED[key] = (time.monotonic(), brokers)
            return brokers
        except KafkaError as err:
            raise KafkaUnavailable(unavailable_message(bootstrap_servers, timeout_s, type(err).__name__)) from None
        finally:
            admin.close()


def record_size(key: bytes | None, value: bytes | None, headers=None) -> int:
    """Upper bound of one record's size on the wire, as a record batch of its own (what the
    producer checks against ``max_request_size`` and the broker against ``max.message.bytes``)."""
    from kafka.record.default_records import DefaultRecordBatchBuilder

    return DefaultRecordBatchBuilder.estimate_size_in_bytes(key, value, list(headers or ()))


def value_budget(max_bytes: int, key: bytes | None = None, headers=None) -> int:
    """How many bytes a value may have so that its record fits ``max_bytes``."""
    return max_bytes - record_size(key, b"", headers) - 4  # the value's length varint grows to 5 bytes


def topic_max_message_bytes(bootstrap_servers: str | Sequence[str], topic: str, *,
                            client_config: Mapping[str, Any] | None = None) -> int | None:
    """The topic's ``max.message.bytes`` as the broker applies it (its own or the broker default);
    None when the topic does not exist or the broker does not say."""
    from kafka import KafkaAdminClient
    from kafka.admin import ConfigResource, ConfigResourceType

    cfg = {k: v for k, v in dict(client_config or {}).items() if k in KafkaAdminClient.DEFAULT_CONFIG}
    admin = track_client(KafkaAdminClient(bootstrap_servers=bootstrap_servers, **cfg))
    try:
        found = admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, topic, {"max.message.bytes": None})], config_filter="all")
    except Exception as err:  # noqa: BLE001 - an absent topic or an old broker: no limit known
        _log.debug("max.message.bytes of %s unavailable: %s", topic, err)
        return None
    finally:
        close_client(admin)
    entry = (found.get("topic", {}).get(topic) or {}).get("max.message.bytes") or {}
    try:
        return int(entry.get("value"))
    except (TypeError, ValueError):
        return None


# Broker API versions already probed in this process, per bootstrap list. kafka-python probes
# the broker before a new client's first request (~100 ms against a local broker); one read
# opens several clients (partitions, end offsets, one per partition, commits), so later ones
# reuse the first probe's answer. A user's own ``api_version`` always wins.
_API_VERSIONS: dict[str, tuple] = {}


def new_consumer(bootstrap_servers: str | Sequence[str], extra: Mapping[str, Any] | None,
                  **overrides):
    """A tracked kafka-python consumer with our shared settings and the cached API version."""
    from kafka import KafkaConsumer

    cfg = _client_config(bootstrap_servers, extra)
    cfg.update(overrides)
    key = _servers(bootstrap_servers)
    if cfg.get("api_version") is None and key in _API_VERSIONS:
        cfg["api_version"] = _API_VERSIONS[key]
    consumer = KafkaConsumer(**cfg)
    if consumer.config.get("api_version"):
        _API_VERSIONS.setdefault(key, consumer.config["api_version"])
    return track_client(consumer)


def _client_config(bootstrap_servers: str | Sequence[str], extra: Mapping[str, Any] | None) -> dict:
    """kafka-python settings shared by our consumers; ``extra`` passes security options through."""
    # A generous bootstrap timeout: a client that probes the broker while it restarts waits for
    # it instead of failing the bundle (Prism fails the whole job on a DoFn error). Clients made
    # with a cached API version do not probe; their calls go through retry_kafka instead.
    cfg = {"bootstrap_servers": bootstrap_servers, "enable_auto_commit": False,
           "request_timeout_ms": 30_000, "bootstrap_timeout_ms": 120_000}
    # Dotted names are librdkafka properties for client="confluent" readers, not kafka-python's.
    cfg.update((k, v) for k, v in (extra or {}).items() if "." not in k)
    return cfg


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
        from kafka.errors import KafkaTimeoutError

        bootstrap, _ = self._cfg
        try:
            yield from self._resolve()
        except KafkaTimeoutError as err:
            raise KafkaUnavailable(unavailable_message(bootstrap, self._connect_timeout_s, str(err))) from None

    def _resolve(self) -> Iterable[PartitionRead]:
        from kafka import TopicPartition

        bootstrap, extra = self._cfg
        timeout_ms = int(self._connect_timeout_s * 1000)
        consumer = new_consumer(bootstrap, extra, group_id=self._group_id, bootstrap_timeout_ms=timeout_ms)
        try:
            tps = []
            for topic in self._topics:
                parts = consumer.partitions_for_topic(topic)
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
@dataclass(frozen=True)
class PartitionRange:
    """The restriction: offsets ``[start, stop)`` of one partition (``stop`` may be UNBOUNDED)."""

    topic: str
    partition: int
    start: int
    stop: int


class _PartitionTracker(RestrictionTracker):
    """Claims offsets of one partition in order; checkpoints, never splits a partition.

    Claiming ``stop`` (an offset outside the range) marks the range done, which is how the
    reader ends at a stop time or over trailing gaps, as Java's ``tryClaim(Long.MAX_VALUE)``.
    """

    def __init__(self, restriction: PartitionRange, end_offsets: "_EndOffsets"):
        self._range = restriction
        self._ends = end_offsets
        self._last_attempt: int | None = None
        self._checkpointed = False

    def current_restriction(self) -> PartitionRange:
        return self._range

    def try_claim(self, offset: int) -> bool:
        if self._last_attempt is not None and offset <= self._last_attempt:
            raise ValueError(f"offsets must be claimed in increasing order: {offset} after "
                             f"{self._last_attempt} in {self._range}")
        self._last_attempt = offset
        return self._range.start <= offset < self._range.stop

    def try_split(self, fraction_of_remainder):
        if fraction_of_remainder != 0 or self._checkpointed:
            return None  # one consumer per partition keeps log order, as Java KafkaIO does
        split_at = self._range.start if self._last_attempt is None else self._last_attempt + 1
        if split_at >= self._range.stop:
            return None
        self._checkpointed = True
        primary = replace(self._range, stop=split_at)
        residual = replace(self._range, start=split_at)
        self._range = primary
        return primary, residual

    def check_done(self):
        if self._range.start < self._range.stop and (
                self._last_attempt is None or self._last_attempt < self._range.stop - 1):
            raise ValueError(f"offsets [{self._next_position()}, {self._range.stop}) of "
                             f"{self._range.topic}-{self._range.partition} were not claimed")

    def _next_position(self) -> int:
        return self._range.start if self._last_attempt is None else self._last_attempt + 1

    def current_progress(self) -> RestrictionProgress:
        position = min(self._next_position(), self._range.stop)
        end = self._ends.get(self._range.topic, self._range.partition, position)
        completed = float(position - self._range.start)
        remaining = float(offsets.backlog(position, self._range.stop, max(end, position)))
        if completed + remaining == 0:  # never 0/0 (the runner divides): done, or waiting for more
            completed, remaining = (1.0, 0.0) if self.is_bounded() else (0.0, 1.0)
        return RestrictionProgress(completed=completed, remaining=remaining)

    def is_bounded(self) -> bool:
        return self._range.stop != UNBOUNDED


# One end-offsets consumer per process and (bootstrap, config), shared by every reader
# instance: Beam sizes restrictions in DoFn instances it may drop without teardown, and a
# consumer per instance would pile up. Guarded by its lock (kafka-python clients are not
# thread-safe); closed by close_all_clients.
_SHARED_END_OFFSETS: dict[str, tuple[Any, threading.Lock]] = {}


def _end_offsets_consumer(bootstrap_servers, consumer_config) -> tuple[Any, threading.Lock]:
    key = repr((bootstrap_servers, sorted((consumer_config or {}).items())))
    with _LIVE_LOCK:
        shared = _SHARED_END_OFFSETS.get(key)
    if shared is None:
        consumer = new_consumer(bootstrap_servers, consumer_config)
        with _LIVE_LOCK:
            shared = _SHARED_END_OFFSETS.setdefault(key, (consumer, threading.Lock()))
        if shared[0] is not consumer:
            close_client(consumer)
    return shared


class _EndOffsets:
    """Cached log-end offsets for backlog estimates (a few seconds old at most)."""

    def __init__(self, bootstrap_servers, consumer_config, ttl_s: float = 2.0):
        self._cfg = (bootstrap_servers, consumer_config)
        self._ttl = ttl_s
        self._cache: dict[tuple[str, int], tuple[float, int]] = {}
        self._lock = threading.Lock()

    def __getstate__(self):
        return {"_cfg": self._cfg, "_ttl": self._ttl}

    def __setstate__(self, state):
        self.__init__(*state["_cfg"], ttl_s=state["_ttl"])

    def get(self, topic: str, partition: int, fallback: int) -> int:
        key = (topic, partition)
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(key)
            if hit and now - hit[0] < self._ttl:
                return hit[1]
        try:
            from kafka import TopicPartition

            consumer, lock = _end_offsets_consumer(*self._cfg)
            tp = TopicPartition(topic, partition)
            with lock:
                end = consumer.end_offsets([tp], timeout_ms=5000)[tp]
        except Exception as err:  # noqa: BLE001 - an estimate must never fail the read
            _log.debug("end offset of %s-%s unavailable: %s", topic, partition, err)
            return hit[1] if hit else fallback
        with self._lock:
            self._cache[key] = (now, end)
        return end


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
                 client: str = "kafka-python"):
        self._cfg = (bootstrap_servers, consumer_config)
        self._poll_interval_s = poll_interval_s
        self._idle_lag_ms = int(idle_watermark_lag_s * 1000)
        self._max_read_s = max_read_s
        self._batch_records = batch_records
        self._client = client
        self._ends = _EndOffsets(bootstrap_servers, consumer_config)
        self._consumers: dict = {}

    # -- restriction provider ---------------------------------------------------------------
    def initial_restriction(self, element: PartitionRead) -> PartitionRange:
        return PartitionRange(element.topic, element.partition, element.start_offset, element.stop_offset)

    def create_tracker(self, restriction: PartitionRange) -> _PartitionTracker:
        return _PartitionTracker(restriction, self._ends)

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
        """This worker's fetcher of the partition (``connectors.kafka_fetch``), at ``position``."""
        from connectors.kafka_fetch import open_fetcher

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
        deadline = time.monotonic() + self._max_read_s
        wm_ms = watermark.current_watermark().micros // 1000
        chunk_size = self._batch_records or self.PER_RECORD_FETCH
        batched = self._batch_records is not None
        poll_ms = int(self._poll_interval_s * 1000)
        stamp_ms, stamp = None, None
        while True:
            # Never fetch past the stop offset: records beyond it are neither decoded nor emitted.
            records = fetcher.fetch(min(chunk_size, stop - position), poll_ms)
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
        from kafka import OffsetAndMetadata, TopicPartition

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
                 client: str = "kafka-python"):
        super().__init__()
        if batch_records is not None and (isinstance(batch_records, bool) or not isinstance(batch_records, int)
                                          or batch_records < 1):
            raise ValueError(f"ReadFromKafka(batch_records={batch_records!r}): must be a positive int (records "
                             f"per emitted list), or None for one element per record")
        from connectors.kafka_fetch import check_client, confluent_config

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
            .with_output_types(KafkaRecord if self._batch_records is None else List[KafkaRecord])
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

def retry_kafka(action, what: str, *, deadline_s: float = 120.0, pause_s: float = 1.0):
    """Run ``action()`` again while Kafka answers with a retriable error (the broker restarts,
    the group coordinator moves), for up to ``deadline_s``; then let the error out."""
    from kafka.errors import KafkaError

    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return action()
        except KafkaError as err:
            if not _is_retriable(err) or time.monotonic() >= deadline:
                raise
            _log.warning("%s: %s; retrying", what, err)
            time.sleep(pause_s)


def ensure_topic(bootstrap_servers: str | Sequence[str], topic: str, *, partitions: int = 1,
                 replication_factor: int | None = None, config: Mapping[str, str] | None = None,
                 client_config: Mapping[str, Any] | None = None) -> None:
    """Create ``topic`` unless it exists (producers do not create topics and would block).

    ``replication_factor`` defaults to min(3, number of brokers): 1 on a local broker, 3 on a
    real cluster. ``config`` sets topic configs (e.g. ``{"max.message.bytes": "4194304"}``) of a
    topic this call creates; an existing topic is left as it is.
    """
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic
    from kafka.errors import InvalidReplicationFactorError, TopicAlreadyExistsError

    if replication_factor is not None and (isinstance(replication_factor, bool) or replication_factor < 1):
        raise ValueError(f"ensure_topic(replication_factor={replication_factor!r}): must be >= 1 "
                         f"(or None for min(3, number of brokers))")
    cfg = {k: v for k, v in dict(client_config or {}).items() if k in KafkaAdminClient.DEFAULT_CONFIG}
    admin = KafkaAdminClient(bootstrap_servers=bootstrap_servers, **cfg)
    try:
        if topic in admin.list_topics():
            return
        brokers = len(admin.describe_cluster().get("brokers") or ()) or 1
        factor = min(3, brokers) if replication_factor is None else replication_factor
        try:
            admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=factor,
                                          topic_configs=dict(config or {}))])
        except InvalidReplicationFactorError:
            raise ValueError(f"topic {topic!r}: replication factor {factor} cannot be reached, the cluster at "
                             f"{_servers(bootstrap_servers)} has {brokers} broker(s); pass a replication "
                             f"factor <= {brokers} (--replication-factor)") from None
    except TopicAlreadyExistsError:
        pass
    finally:
        admin.close()


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------
def _as_message(element) -> tuple:
    """KafkaRecord or (key, value) -> (key, value, headers, timestamp_ms)."""
    if isinstance(element, KafkaRecord):
        return element.key, element.value, list(element.headers) or None, element.timestamp
    if isinstance(element, tuple) and len(element) == 2:
        key, value = element
        return key, value, None, None
    raise TypeError(f"WriteToKafka takes KafkaRecord or (key, value) elements, got {type(element).__name__}")


#: Producer settings of every producer the connectors make (a user's ``producer_config`` wins).
PRODUCER_DEFAULTS = {"acks": "all", "enable_idempotence": True, "linger_ms": 5, "batch_size": 256 * 1024,
                     "max_request_size": 16 * 1024 * 1024, "max_block_ms": 15_000}


def new_producer(bootstrap_servers: str | Sequence[str], producer_config: Mapping[str, Any] | None = None, *,
                 max_message_bytes: int | None = None, bootstrap_timeout_s: float = 120.0):
    """A tracked, idempotent ``acks=all`` producer.

    With ``max_message_bytes`` (the smallest ``max.message.bytes`` of the topics it writes),
    the producer never puts more than that into one record batch: several small records sent
    together would otherwise make a batch the broker rejects although each record fits.
    """
    from kafka import KafkaProducer

    cfg = {"bootstrap_servers": bootstrap_servers, **PRODUCER_DEFAULTS,
           "bootstrap_timeout_ms": int(bootstrap_timeout_s * 1000)}
    cfg.update(producer_config or {})
    if max_message_bytes:
        cfg["batch_size"] = max(1024, min(cfg["batch_size"], max_message_bytes - 1024))
    return track_client(KafkaProducer(**cfg))


def _is_retriable(err: BaseException) -> bool:
    return bool(getattr(err, "retriable", False)) or type(err).__name__ in (
        "KafkaTimeoutError", "KafkaConnectionError", "NoBrokersAvailable", "NodeNotReadyError")


def _describe_error(err: BaseException) -> str:
    text = str(err)
    description = getattr(err, "description", "") or ""
    if text in ("", "None") or text.endswith(": None"):
        text = description
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


@dataclass
class _Sent:
    topic: str
    key: bytes | None
    value: bytes | None
    headers: list | None
    timestamp_ms: int | None
    partition: int | None
    size: int
    future: Any = None
    error: BaseException | None = None  # raised by send() itself


class KafkaDelivery:
    """Sends records and confirms every one of them: the check no caller can forget.

    ``send`` queues a record (and fails at once, naming the topic and both sizes, when it
    cannot fit the topic's ``max.message.bytes`` given in ``max_message_bytes``); ``confirm``
    flushes and then inspects the result of *every* send since the last confirm. A retriable
    failure (a broker restart, a leader move, a timeout) is sent again until ``retry_s`` has
    passed; any other failure raises ``KafkaWriteError`` with the Kafka error, the topic and
    the record's size. Only after ``confirm`` returns may a caller treat the records as
    delivered (commit offsets, count them). Records resent after a retriable failure may land
    after later records of the same partition: a caller that needs log order confirms one
    record at a time.
    """

    def __init__(self, producer, *, what: str = "WriteToKafka", max_message_bytes: Mapping[str, int] | None = None,
                 retry_s: float = 120.0, flush_timeout_s: float = 60.0):
        self._producer = producer
        self._what = what
        self._limits = dict(max_message_bytes or {})
        self._retry_s, self._flush_timeout_s = retry_s, flush_timeout_s
        self._pending: list[_Sent] = []

    @property
    def pending(self) -> int:
        return len(self._pending)

    def send(self, topic: str, value: bytes | None, *, key: bytes | None = None, headers=None,
             timestamp_ms: int | None = None, partition: int | None = None) -> None:
        headers = list(headers) if headers else None
        size = record_size(key, value, headers)
        limit = self._limits.get(topic)
        if limit is not None and size > limit:
            raise KafkaWriteError(
                f"{self._what + ': ' if self._what else ''}a record of {size:,} bytes does not fit topic {topic!r} "
                f"(max.message.bytes {limit:,}); split the value (EncodeArrow(max_message_bytes=...)), "
                f"truncate it, or raise the topic's max.message.bytes")
        entry = _Sent(topic, key, value, headers, timestamp_ms, partition, size)
        self._submit(entry)
        self._pending.append(entry)

    def _submit(self, entry: _Sent) -> None:
        from kafka.errors import KafkaError

        entry.future, entry.error = None, None
        try:
            entry.future = self._producer.send(entry.topic, key=entry.key, value=entry.value, headers=entry.headers,
                                               timestamp_ms=entry.timestamp_ms, partition=entry.partition)
        except KafkaError as err:  # metadata timeout, a record over max_request_size
            entry.error = err

    @staticmethod
    def _failure(entry: _Sent) -> BaseException | None:
        if entry.error is not None:
            return entry.error
        future = entry.future
        return future.exception if future.is_done and future.failed() else None

    def confirm(self) -> int:
        """Block until every record sent since the last confirm is acknowledged; returns how many."""
        from kafka.errors import KafkaError, KafkaTimeoutError

        deadline = time.monotonic() + self._retry_s
        while True:
            live = [e for e in self._pending if e.error is None]
            if live:
                try:
                    self._producer.flush(timeout=max(0.1, min(self._flush_timeout_s,
                                                              deadline - time.monotonic())))
                except KafkaError:
                    pass  # each record's own future says what happened (flush trips over split batches)
                for e in live:
                    left = deadline - time.monotonic()
                    if left <= 0:  # a stuck record each would otherwise wait its own full timeout
                        break
                    if not e.future.is_done:
                        try:
                            e.future.get(timeout=max(0.1, min(self._flush_timeout_s, left)))
                        except Exception:  # noqa: BLE001 - inspected below
                            pass
            failed = [(e, err) for e in self._pending if (err := self._failure(e)) is not None]
            waiting = [e for e in self._pending if e.error is None and not e.future.is_done]
            if not failed and not waiting:
                done = len(self._pending)
                self._pending = []
                return done
            out_of_time = time.monotonic() >= deadline
            fatal = [(e, err) for e, err in failed if not _is_retriable(err)]
            if fatal or out_of_time:
                bad = fatal or failed or [(waiting[0], KafkaTimeoutError(
                    f"not acknowledged within {self._retry_s:g} s"))]
                entry, err = bad[0]
                total, bad = len(self._pending), len(fatal) if fatal else len(failed) + len(waiting)
                self._pending = []
                raise KafkaWriteError(
                    f"{self._what + ': ' if self._what else ''}Kafka did not accept a record of {entry.size:,} "
                    f"bytes for topic {entry.topic!r} ({bad} of {total} records not delivered): "
                    f"{_describe_error(err)}"
                    + (f" (the topic's max.message.bytes was {self._limits[entry.topic]:,} when this producer "
                       f"started)" if entry.topic in self._limits else ""))
            if failed:
                _log.warning("%s: %d record(s) for %r failed with %s; sending them again", self._what,
                             len(failed), failed[0][0].topic, _describe_error(failed[0][1]))
                time.sleep(0.5)
                for entry, _ in failed:
                    self._submit(entry)

    def discard(self) -> None:
        """Forget unconfirmed records (after a failure the caller gives up on them)."""
        self._pending = []


class _WriteFn(beam.DoFn):
    def __init__(self, bootstrap_servers, topic, producer_config, flush_timeout_s, retry_s=120.0):
        self._bootstrap, self._topic = bootstrap_servers, topic
        self._producer_config = dict(producer_config or {})
        self._flush_timeout_s = flush_timeout_s
        self._retry_s = retry_s
        self._producer = None

    def setup(self):
        from kafka.errors import KafkaTimeoutError

        security = {k: v for k, v in self._producer_config.items() if k.startswith(("security_", "ssl_", "sasl_"))}
        limit = topic_max_message_bytes(self._bootstrap, self._topic, client_config=security)
        self._producer = new_producer(self._bootstrap, self._producer_config, max_message_bytes=limit,
                                      bootstrap_timeout_s=15.0)
        try:
            # A metadata request for the topic: with auto-creation off, an absent topic times out.
            self._producer.partitions_for(self._topic)
        except KafkaTimeoutError as err:
            close_client(self._producer, timeout=1)
            self._producer = None
            raise KafkaWriteError(
                f"WriteToKafka: topic {self._topic!r} does not exist on {self._bootstrap} and the broker "
                f"did not create it (auto.create.topics.enable=false?). Create the topic first "
                f"(kafka-topics.sh --create or KafkaAdminClient.create_topics).") from err
        limits = {self._topic: limit} if limit else {}
        self._delivery = KafkaDelivery(self._producer, what="WriteToKafka", max_message_bytes=limits,
                                       retry_s=self._retry_s, flush_timeout_s=self._flush_timeout_s)

    def start_bundle(self):
        self._delivery.discard()

    def process(self, element):
        key, value, headers, ts = _as_message(element)
        self._delivery.send(self._topic, value, key=key, headers=headers, timestamp_ms=ts)

    def finish_bundle(self):
        # Every record of a finished bundle is acknowledged (acks=all), or the bundle fails.
        self._delivery.confirm()

    def teardown(self):
        if self._producer is not None:
            close_client(self._producer, timeout=10)
            self._producer = None


class WriteToKafka(beam.PTransform):
    """Writes ``KafkaRecord``s or ``(key, value)`` pairs to one topic.

    The producer batches (``linger_ms``), waits for all in-sync replicas (``acks="all"``) and is
    idempotent, so broker-side retries add no duplicates. Every bundle confirms each of its
    sends (``KafkaDelivery``) before it completes: a finished bundle's records are
    acknowledged; a retriable failure is sent again for up to ``retry_s``; any other failure
    fails the bundle with the Kafka error, the topic and the record's size instead of
    vanishing. A record that cannot fit the topic's ``max.message.bytes`` (read from the
    broker) fails at once, and the producer's batches never exceed it. ``producer_config``
    passes kafka-python producer settings through (SASL/SSL among them).
    """

    def __init__(self, bootstrap_servers: str | Sequence[str], topic: str, *,
                 producer_config: Mapping[str, Any] | None = None, flush_timeout_s: float = 60.0,
                 retry_s: float = 120.0):
        super().__init__()
        self._fn = _WriteFn(bootstrap_servers, topic, producer_config, flush_timeout_s, retry_s)

    def expand(self, pcoll):
        return pcoll | "Produce" >> beam.ParDo(self._fn)

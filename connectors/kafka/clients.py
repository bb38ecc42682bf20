"""Kafka clients the connectors open: settings, tracking, closing, retrying.

Every consumer and producer the package (and its users: the stream pipeline, the online
trainer, the scorer) opens is made here, so they share one set of defaults, the cached broker
API version, and one registry that ``close_all_clients`` empties (at exit too).
"""
from __future__ import annotations

import atexit
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.errors import KafkaError

__all__ = ["KafkaUnavailable", "DEFAULT_CONNECT_TIMEOUT_S", "PRODUCER_DEFAULTS", "track_client", "close_client",
           "close_all_clients", "shared_consumer", "new_consumer", "new_producer", "consumer_settings",
           "retry_kafka", "is_retriable", "describe_error", "servers_string", "unavailable_message",
           "quiet_kafka_logs", "ReconnectSummary", "summarize_reconnects", "topic_partitions"]

_log = logging.getLogger(__name__)

# Every client this package opened and has not closed, held strongly: kafka-python 3 runs all
# clients' sockets on one shared IO thread, so a client dropped without ``close()`` (a DoFn the
# runner discards without teardown, a cancelled streaming job's in-process workers) would keep
# its connections and metadata refreshes alive for the life of the process. These are closed
# by ``close_all_clients`` and at exit.
_LIVE_CLIENTS: set = set()
_LIVE_LOCK = threading.Lock()

# Consumers shared by every instance of a DoFn in a process, per (bootstrap, config): Beam sizes
# restrictions in DoFn instances it may drop without teardown, and a consumer per instance would
# pile up. Each is guarded by its lock (kafka-python clients are not thread-safe).
_SHARED: dict[str, tuple[Any, threading.Lock]] = {}


def track_client(client):
    """Register a Kafka client so that close_all_clients() closes it; returns the client."""
    with _LIVE_LOCK:
        _LIVE_CLIENTS.add(client)
    return client


#: Seconds a producer's close waits for records not yet sent unless the caller says otherwise: brokers
#: that do not answer never hold a process that is stopping (a caller confirms what it needs delivered).
PRODUCER_CLOSE_S = 10.0


def close_client(client, **close_kwargs) -> None:
    """Close a client registered with track_client() and forget it (a producer within
    ``PRODUCER_CLOSE_S`` unless ``timeout`` is given)."""
    with _LIVE_LOCK:
        _LIVE_CLIENTS.discard(client)
    if type(client).__name__ == "KafkaProducer":
        close_kwargs.setdefault("timeout", PRODUCER_CLOSE_S)
    try:
        client.close(**close_kwargs)
    except Exception as err:  # noqa: BLE001 - a producer's close flushes; its records were confirmed or given up
        _log.debug("closing %s: %s", type(client).__name__, err)


def close_all_clients() -> int:
    """Close every Kafka client the connectors opened in this process; returns how many."""
    with _LIVE_LOCK:
        clients = list(_LIVE_CLIENTS)
        _LIVE_CLIENTS.clear()
        _SHARED.clear()
    closing = []
    for client in clients:
        if type(client).__name__ == "KafkaProducer":  # each waits for its unsent records: side by side
            thread = threading.Thread(target=_close_quietly, args=(client, {"timeout": PRODUCER_CLOSE_S}),
                                      name="close-kafka-producer", daemon=True)
            try:
                thread.start()
                closing.append(thread)
            except RuntimeError:  # no new threads at interpreter shutdown (atexit): one at a time
                _close_quietly(client, {"timeout": PRODUCER_CLOSE_S})
        else:
            _close_quietly(client, {})
    deadline = time.monotonic() + PRODUCER_CLOSE_S + 1.0
    for thread in closing:
        thread.join(max(0.0, deadline - time.monotonic()))
    return len(clients)


def _close_quietly(client, kwargs: dict) -> None:
    try:
        client.close(**kwargs)
    except Exception:  # noqa: BLE001 - closing is best effort
        pass


atexit.register(close_all_clients)


class KafkaUnavailable(ConnectionError):
    """No broker answered at the bootstrap servers within the bound; the message says what to check."""


#: How long a command or a read waits for a first answer from the brokers before it gives up.
DEFAULT_CONNECT_TIMEOUT_S = 30.0


@contextmanager
def quiet_kafka_logs():
    """kafka-python logs a warning per failed connection attempt; a probe reports once instead."""
    kafka_log = logging.getLogger("kafka")
    before = kafka_log.level
    kafka_log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        kafka_log.setLevel(before)


class ReconnectSummary(logging.Filter):
    """kafka-python's reconnect warnings summarised: one line when an outage starts, one when it ends.

    While no broker answers, every client logs a warning or error per connection attempt and per
    metadata refresh (dozens a minute per client, from each process of a job). Attached to
    kafka-python's loggers (:func:`summarize_reconnects`), this filter lets the first such record of
    an outage through (once a broker has answered in this process: before that, the command's own
    "no Kafka broker answered" line speaks), rewritten as "Kafka brokers unreachable: <what failed>; retrying", drops the
    rest (counting them), and turns the first successful connection afterwards into "Kafka brokers
    answer again after N s (M reconnect messages summarised)". Other records pass as before. The
    state is per process: several clients failing together are one outage.
    """

    #: what kafka-python (3.x: kafka.net.*, kafka.cluster; 2.x: kafka.conn, kafka.client_async) logs
    #: about a connection attempt that failed or a connection lost
    TROUBLE = re.compile(
        r"ECONNREFUSED|ECONNRESET|EHOSTUNREACH|ETIMEDOUT|KafkaConnectionError|NodeNotReady|NoBrokersAvailable"
        r"|Connection (failed|lost|refused|reset)|connect attempt|Unable to connect|No node available"
        r"|Metadata refresh: failed|Bootstrap (connection|attempt) to \S+ failed|Bootstrap \S+ not ready"
        r"|socket disconnected|Abort \(|Request timed out|Broken pipe|Closing connection|Fetch to node \S+ failed"
        r"|not available to send|Node \S+ not ready|Bootstrap failed|Unable to bootstrap"
        r"|Error (receiving|sending) (network|request) data|Marking the coordinator dead")
    #: what it logs (at INFO) when a connection to a broker succeeds
    UP = re.compile(r": Connected$|Connection complete|Bootstrap complete")
    #: the loggers the filter is attached to (a logger's filters do not apply to its children's records)
    LOGGERS = ("kafka.net.manager", "kafka.net.connection", "kafka.net.transport", "kafka.net.selector",
               "kafka.cluster", "kafka.consumer.fetcher", "kafka.consumer.group", "kafka.coordinator.base",
               "kafka.coordinator.consumer", "kafka.producer.sender", "kafka.producer.kafka",
               "kafka.producer.record_accumulator", "kafka.admin.client", "kafka.conn", "kafka.client_async",
               "kafka.coordinator", "kafka.coordinator.heartbeat", "kafka.protocol",
               # the connectors' own retries (retry_kafka, KafkaDelivery) say the same per attempt
               "connectors.kafka.clients", "connectors.kafka.delivery")
    #: the loggers whose INFO "connected" records end an outage (lowered to INFO; what the original
    #: level would have dropped is still dropped)
    UP_LOGGERS = ("kafka.net.connection", "kafka.net.manager", "kafka.conn")

    def __init__(self, clock=time.monotonic):
        super().__init__()
        self._clock = clock
        self._lock = threading.Lock()
        self._since: float | None = None  # when the outage started (None: none now)
        self._reached = False  # a broker answered once in this process: before that, no outage to announce
        self.summarised = 0  # records dropped in the current outage
        self.outages = 0
        self._levels: dict[str, int] = {}  # logger name -> the effective level it had before install
        self._own: dict[str, int] = {}  # logger name -> its own level before install

    def install(self) -> ReconnectSummary:
        """Attach to kafka-python's loggers (created here if kafka-python has not made them yet)."""
        names = set(self.LOGGERS) | {n for n in list(logging.root.manager.loggerDict) if n.startswith("kafka.")}
        for name in sorted(names):
            logger = logging.getLogger(name)
            if self in logger.filters:
                continue
            self._levels[name], self._own[name] = logger.getEffectiveLevel(), logger.level
            if name in self.UP_LOGGERS and logger.getEffectiveLevel() > logging.INFO:
                logger.setLevel(logging.INFO)
            logger.addFilter(self)
        return self

    def uninstall(self) -> None:
        for name, level in self._own.items():
            logger = logging.getLogger(name)
            logger.removeFilter(self)
            logger.setLevel(level)
        self._levels, self._own = {}, {}

    @property
    def in_outage(self) -> bool:
        return self._since is not None

    def filter(self, record: logging.LogRecord) -> bool:
        shown = record.levelno >= self._levels.get(record.name, logging.NOTSET)
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a record that cannot format: left as it is
            return shown
        with self._lock:
            if record.levelno >= logging.WARNING and self.TROUBLE.search(text):
                if not self._reached:  # no broker yet: the command's own line says so (fail fast, or waiting)
                    self.summarised += 1
                    return False
                if self._since is not None:
                    self.summarised += 1
                    return False
                self._since, self.summarised, self.outages = self._clock(), 0, self.outages + 1
                record.msg, record.args = ("Kafka brokers unreachable: %s; retrying (reconnect messages are "
                                           "summarised: one line when a broker answers again)", (text[:300],))
                record.exc_info = record.exc_text = record.stack_info = None  # the one line, not a traceback
                return True
            if record.levelno <= logging.INFO and self.UP.search(text):
                self._reached = True
                if self._since is None:
                    return shown
                took, dropped = self._clock() - self._since, self.summarised
                self._since, self.summarised = None, 0
                record.msg, record.args = ("Kafka brokers answer again after %.0f s (%d reconnect messages "
                                           "summarised)", (took, dropped))
                record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
                return True
        return shown


_SUMMARY: ReconnectSummary | None = None


def summarize_reconnects() -> ReconnectSummary:
    """Install this process's :class:`ReconnectSummary` on kafka-python's loggers (once; returns it).
    flowtrain's commands call it; a pipeline of your own may too."""
    global _SUMMARY
    with _LIVE_LOCK:
        if _SUMMARY is None:
            _SUMMARY = ReconnectSummary()
        return _SUMMARY.install()


def servers_string(bootstrap_servers: str | Sequence[str]) -> str:
    """``"host:port,host:port"`` from a string or a list of them."""
    return bootstrap_servers if isinstance(bootstrap_servers, str) else ",".join(bootstrap_servers)


def unavailable_message(bootstrap_servers: str | Sequence[str], timeout_s: float, detail: str = "") -> str:
    """The one line a user sees when no broker answers."""
    return (f"no Kafka broker answered at {servers_string(bootstrap_servers)} within {timeout_s:g} s"
            f"{f' ({detail})' if detail else ''}: check that the broker runs (`flowtrain kafka status`, "
            f"or `flowtrain kafka start`), that the bootstrap servers are its host:port, and that the "
            f"client security settings (--kafka-config) match its listener")


# Broker API versions already probed in this process, per bootstrap list. kafka-python probes
# the broker before a new client's first request (~100 ms against a local broker); one read
# opens several clients (partitions, end offsets, one per partition, commits), so later ones
# reuse the first probe's answer. A user's own ``api_version`` always wins.
_API_VERSIONS: dict[str, tuple] = {}


def new_consumer(bootstrap_servers: str | Sequence[str], extra: Mapping[str, Any] | None,
                 **overrides):
    """A tracked kafka-python consumer with our shared settings and the cached API version."""
    cfg = consumer_settings(bootstrap_servers, extra)
    cfg.update(overrides)
    key = servers_string(bootstrap_servers)
    if cfg.get("api_version") is None and key in _API_VERSIONS:
        cfg["api_version"] = _API_VERSIONS[key]
    consumer = KafkaConsumer(**cfg)
    if consumer.config.get("api_version"):
        _API_VERSIONS.setdefault(key, consumer.config["api_version"])
    return track_client(consumer)


def consumer_settings(bootstrap_servers: str | Sequence[str], extra: Mapping[str, Any] | None) -> dict:
    """kafka-python settings shared by our consumers; ``extra`` passes security options through."""
    # A generous bootstrap timeout: a client that probes the broker while it restarts waits for
    # it instead of failing the bundle (Prism fails the whole job on a DoFn error). Clients made
    # with a cached API version do not probe; their calls go through retry_kafka instead.
    cfg = {"bootstrap_servers": bootstrap_servers, "enable_auto_commit": False,
           "request_timeout_ms": 30_000, "bootstrap_timeout_ms": 120_000}
    # Dotted names are librdkafka properties for client="confluent" readers, not kafka-python's.
    cfg.update((k, v) for k, v in (extra or {}).items() if "." not in k)
    return cfg


def shared_consumer(bootstrap_servers, consumer_config) -> tuple[Any, threading.Lock]:
    """This process's one consumer for (bootstrap, config) and the lock its users hold while using it."""
    key = repr((bootstrap_servers, sorted((consumer_config or {}).items())))
    with _LIVE_LOCK:
        shared = _SHARED.get(key)
    if shared is None:
        consumer = new_consumer(bootstrap_servers, consumer_config)
        with _LIVE_LOCK:
            shared = _SHARED.setdefault(key, (consumer, threading.Lock()))
        if shared[0] is not consumer:
            close_client(consumer)
    return shared


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
    cfg = {"bootstrap_servers": bootstrap_servers, **PRODUCER_DEFAULTS,
           "bootstrap_timeout_ms": int(bootstrap_timeout_s * 1000)}
    cfg.update(producer_config or {})
    if max_message_bytes:
        cfg["batch_size"] = max(1024, min(cfg["batch_size"], max_message_bytes - 1024))
    return track_client(KafkaProducer(**cfg))


def topic_partitions(consumer, topic: str, *, timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
                     refresh: bool = False) -> set[int]:
    """The partition ids of ``topic`` (empty: no such topic), asked of ``consumer`` within ``timeout_s``.

    kafka-python's ``partitions_for_topic`` (and ``topics``, for ``refresh``: fresh metadata, so a partition
    added since is seen) waits for the brokers' metadata without any bound: with the brokers gone it never
    returns. Here the question runs on a helper thread and a ``KafkaUnavailable`` naming the brokers and the
    topic ends the wait; the caller closes (or drops) the consumer, which ends the helper's wait too."""
    answer: list = []

    def ask() -> None:
        try:
            if refresh:
                consumer.topics()
            answer.append(set(consumer.partitions_for_topic(topic) or ()))
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
            answer.append(err)

    helper = threading.Thread(target=ask, name=f"kafka-partitions-{topic}", daemon=True)
    helper.start()
    helper.join(timeout_s)
    if not answer:
        servers = consumer.config.get("bootstrap_servers", "?") if hasattr(consumer, "config") else "?"
        raise KafkaUnavailable(unavailable_message(servers, timeout_s, f"no metadata for topic {topic!r}"))
    if isinstance(answer[0], BaseException):
        raise answer[0]
    return answer[0]


def topic_end_offsets(consumer, topic: str, *, timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S) -> dict:
    """``{TopicPartition: end offset}`` of every partition of ``topic`` now (empty: no such topic), asked of
    ``consumer`` within ``timeout_s`` for the partitions (``topic_partitions``) and again for the offsets: a
    ``KafkaUnavailable`` naming the brokers and the topic when either goes unanswered."""
    tps = [TopicPartition(topic, p) for p in sorted(topic_partitions(consumer, topic, timeout_s=timeout_s))]
    if not tps:
        return {}
    try:
        return consumer.end_offsets(tps, timeout_ms=int(timeout_s * 1000))
    except KafkaError as err:  # KafkaTimeoutError: the brokers did not answer within the bound
        servers = consumer.config.get("bootstrap_servers", "?") if hasattr(consumer, "config") else "?"
        raise KafkaUnavailable(unavailable_message(servers, timeout_s, f"no end offsets of topic {topic!r}: "
                                                   f"{describe_error(err)}")) from err


def wait_for_partitions(consumer, topic: str, *, wait_s: float, reconnect: Callable[[], Any],
                        ask_s: float = 5.0, should_stop: Callable[[], bool] | None = None,
                        on_try: Callable[[], None] | None = None) -> tuple[Any, list[int], KafkaUnavailable | None]:
    """Ask ``consumer`` for ``topic``'s partitions until they exist, ``wait_s`` passed, or (brokers not answering)
    ``should_stop()``: each question bounded by ``ask_s`` (``topic_partitions``). A consumer whose question went
    unanswered is closed (that ends its own wait) and ``reconnect()`` makes the next one. Returns the consumer to
    use (None: the last was closed), the sorted partitions (empty: none appeared) and the last ``KafkaUnavailable``
    (None: the brokers answered); the caller words the error, naming its topic's role."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            parts, unavailable = sorted(topic_partitions(consumer, topic, timeout_s=ask_s)), None
        except KafkaUnavailable as err:
            parts, unavailable = [], err
            close_client(consumer)
            consumer = None
        if on_try is not None:
            on_try()
        if parts or time.monotonic() >= deadline or (
                unavailable is not None and should_stop is not None and should_stop()):
            return consumer, parts, unavailable
        time.sleep(0.5)
        if consumer is None:
            consumer = reconnect()


def is_retriable(err: BaseException) -> bool:
    """Whether a Kafka error may go away by itself (a broker restart, a leader move, a timeout)."""
    return bool(getattr(err, "retriable", False)) or type(err).__name__ in (
        "KafkaTimeoutError", "KafkaConnectionError", "NoBrokersAvailable", "NodeNotReadyError")


def describe_error(err: BaseException) -> str:
    """``ErrorName: what it means`` (kafka-python's errors often print as ``None``)."""
    text = str(err)
    description = getattr(err, "description", "") or ""
    if text in ("", "None") or text.endswith(": None"):
        text = description
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def retry_kafka(action, what: str, *, deadline_s: float = 120.0, pause_s: float = 1.0):
    """Run ``action()`` again while Kafka answers with a retriable error (the broker restarts,
    the group coordinator moves), for up to ``deadline_s``; then let the error out."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return action()
        except KafkaError as err:
            if not is_retriable(err) or time.monotonic() >= deadline:
                raise
            _log.warning("%s: %s; retrying", what, err)
            time.sleep(pause_s)

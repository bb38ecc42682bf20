"""Kafka clients the connectors open: settings, tracking, closing, retrying.

Every consumer and producer the package (and its users: the stream pipeline, the online
trainer, the scorer) opens is made here, so they share one set of defaults, the cached broker
API version, and one registry that ``close_all_clients`` empties (at exit too).
"""
from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from typing import Any

__all__ = ["KafkaUnavailable", "DEFAULT_CONNECT_TIMEOUT_S", "PRODUCER_DEFAULTS", "track_client", "close_client",
           "close_all_clients", "shared_consumer", "new_consumer", "new_producer", "consumer_settings",
           "retry_kafka", "is_retriable", "describe_error", "servers_string", "unavailable_message",
           "quiet_kafka_logs"]

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
        _SHARED.clear()
    for client in clients:
        try:
            client.close()
        except Exception:  # noqa: BLE001 - closing is best effort
            pass
    return len(clients)


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
    from kafka import KafkaConsumer

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
    from kafka import KafkaProducer

    cfg = {"bootstrap_servers": bootstrap_servers, **PRODUCER_DEFAULTS,
           "bootstrap_timeout_ms": int(bootstrap_timeout_s * 1000)}
    cfg.update(producer_config or {})
    if max_message_bytes:
        cfg["batch_size"] = max(1024, min(cfg["batch_size"], max_message_bytes - 1024))
    return track_client(KafkaProducer(**cfg))


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
    from kafka.errors import KafkaError

    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return action()
        except KafkaError as err:
            if not is_retriable(err) or time.monotonic() >= deadline:
                raise
            _log.warning("%s: %s; retrying", what, err)
            time.sleep(pause_s)

"""One partition's fetcher for ``ReadFromKafka``: chunks of ``KafkaRecord``s from a Kafka client.

``ReadFromKafka`` reads every partition in chunks: it asks its fetcher for up to N records,
claims the chunk's last offset once, and emits the chunk (``batch_records=N``) or its records
one by one. Two clients sit behind the same interface and give the pipeline the same
``KafkaRecord``s:

- ``"kafka-python"`` (the default, pure Python): ``KafkaConsumer.poll(max_records=N)``, the
  batched form of its fetcher, instead of its per-record iterator.
- ``"confluent"`` (``pip install flowtrain[kafka-confluent]``): confluent-kafka's
  ``Consumer.consume(N)`` on librdkafka, which decodes records in C.

Only the reading consumers change with the client: resolving partitions and offsets, backlog
estimates and offset commits stay on kafka-python (a required dependency), so
``consumer_config`` is always written with kafka-python's option names; the confluent fetcher
translates the ones that concern it (see ``confluent_config``).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from kafka import TopicPartition

from connectors.kafka.clients import (
    close_client,
    new_consumer,
    retry_kafka,
    servers_string,
    topic_partitions,
    track_client,
)
from connectors.kafka.record import KafkaRecord

__all__ = ["CLIENTS", "KafkaReadError", "PythonFetcher", "ConfluentFetcher", "confluent_config", "open_fetcher",
           "check_client"]

_log = logging.getLogger(__name__)

#: The clients ``ReadFromKafka(client=...)`` takes; the first is the default.
CLIENTS = ("kafka-python", "confluent")

#: kafka-python consumer settings of the reading consumers (a user's ``consumer_config`` wins).
PYTHON_READ_DEFAULTS = {"fetch_max_wait_ms": 100, "max_poll_records": 10_000,
                        "max_partition_fetch_bytes": 8 * 1024 * 1024}

# kafka-python option -> librdkafka property, for the options a reading consumer uses.
_CONFLUENT_NAMES = {
    "client_id": "client.id", "security_protocol": "security.protocol", "sasl_mechanism": "sasl.mechanism",
    "sasl_plain_username": "sasl.username", "sasl_plain_password": "sasl.password",
    "sasl_kerberos_service_name": "sasl.kerberos.service.name", "ssl_cafile": "ssl.ca.location",
    "ssl_certfile": "ssl.certificate.location", "ssl_keyfile": "ssl.key.location",
    "ssl_password": "ssl.key.password", "ssl_crlfile": "ssl.crl.location",
    "fetch_max_wait_ms": "fetch.wait.max.ms", "fetch_min_bytes": "fetch.min.bytes",
    "fetch_max_bytes": "fetch.max.bytes", "max_partition_fetch_bytes": "max.partition.fetch.bytes",
    "request_timeout_ms": "socket.timeout.ms", "receive_buffer_bytes": "socket.receive.buffer.bytes",
    "isolation_level": "isolation.level", "check_crcs": "check.crcs",
}
# kafka-python options that mean nothing to a librdkafka reading consumer (or are set by the reader).
_CONFLUENT_IGNORED = {"bootstrap_timeout_ms", "max_poll_records", "enable_auto_commit", "api_version",
                      "auto_offset_reset", "group_id", "consumer_timeout_ms", "retry_backoff_ms",
                      "reconnect_backoff_ms", "reconnect_backoff_max_ms", "metadata_max_age_ms",
                      "connections_max_idle_ms", "session_timeout_ms", "heartbeat_interval_ms",
                      "max_poll_interval_ms", "key_deserializer", "value_deserializer"}


class KafkaReadError(RuntimeError):
    """The client reported a non-retriable error for a partition it reads; the message names it."""


def check_client(client: str) -> str:
    if client not in CLIENTS:
        raise ValueError(f"ReadFromKafka(client={client!r}): use one of {', '.join(map(repr, CLIENTS))}")
    if client == "confluent":
        try:
            import confluent_kafka  # noqa: F401
        except ImportError:
            raise ValueError("ReadFromKafka(client='confluent') needs confluent-kafka: "
                             "pip install 'flowtrain[kafka-confluent]' (or confluent-kafka>=2.3), "
                             "or use the default client='kafka-python'") from None
    return client


def confluent_config(bootstrap_servers: str | Sequence[str], consumer_config: Mapping[str, Any] | None) -> dict:
    """librdkafka settings of a reading consumer from kafka-python style ``consumer_config``.

    Keys with a dot are librdkafka properties and pass through as they are; known kafka-python
    options are translated; any other option is an error naming it (never silently dropped).
    """
    servers = servers_string(bootstrap_servers)
    # fetch.queue.backoff.ms: librdkafka pauses a partition's fetches for this long once its local
    # queue is full (default 1000 ms): a bulk read then stalls ~1 s per refill; 10 ms does not.
    cfg = {"bootstrap.servers": servers, "group.id": "flowtrain-reader", "enable.auto.commit": False,
           "enable.auto.offset.store": False, "enable.partition.eof": True, "fetch.wait.max.ms": 100,
           "max.partition.fetch.bytes": 8 * 1024 * 1024, "fetch.queue.backoff.ms": 10}
    for key, value in dict(consumer_config or {}).items():
        if "." in key:
            cfg[key] = value
        elif key in _CONFLUENT_NAMES:
            cfg[_CONFLUENT_NAMES[key]] = value.lower() if key == "isolation_level" else value
        elif key not in _CONFLUENT_IGNORED:
            raise ValueError(f"ReadFromKafka(client='confluent'): consumer_config option {key!r} has no "
                             f"librdkafka equivalent known to flowtrain; pass the librdkafka property "
                             f"(a name with dots, e.g. 'socket.keepalive.enable') or use client='kafka-python'")
    cfg["group.id"] = cfg.get("group.id") or "flowtrain-reader"
    return cfg


# Records are built with tuple.__new__: KafkaRecord's generated __new__ is a Python frame per
# record (0.5 us of the 1 us a record costs here).


class PythonFetcher:
    """kafka-python: one assigned consumer per partition, batched ``poll(max_records=n)``."""

    def __init__(self, bootstrap_servers, consumer_config, topic: str, partition: int, position: int):
        self.topic, self.partition = topic, partition
        self._tp = TopicPartition(topic, partition)
        self._consumer = new_consumer(bootstrap_servers, {**PYTHON_READ_DEFAULTS, **dict(consumer_config or {})},
                                      group_id=None)
        try:
            self._consumer.assign([self._tp])
            # A new consumer seeks straight to ``position``: asking a fresh consumer for its position
            # would first look up a reset offset on the broker, only to seek away from it.
            self._consumer.seek(self._tp, position)
            # The leader's metadata now, not on the first poll: a first poll without it finds nothing
            # fetchable and sleeps retry_backoff_ms (100 ms per partition per worker).
            # bounded as the bootstrap is (120 s: a broker that restarts meanwhile is waited for), then an error
            retry_kafka(lambda: topic_partitions(self._consumer, topic, timeout_s=120.0), "topic metadata")
        except BaseException:
            self._consumer.close()  # a retried bundle makes a new one: never leak this one (and its sockets)
            raise

    def position(self) -> int:
        """The next offset the log holds for this reader (past gaps such as control records)."""
        return retry_kafka(lambda: self._consumer.position(self._tp), "consumer position")

    def seek(self, position: int) -> None:
        if self.position() != position:
            self._consumer.seek(self._tp, position)

    def fetch(self, max_records: int, timeout_ms: int) -> list:
        """Up to ``max_records`` records in offset order (any stale ones from before a seek included)."""
        got = self._consumer.poll(timeout_ms=timeout_ms, max_records=max_records).get(self._tp)
        if not got:
            return []
        topic, partition, new = self.topic, self.partition, tuple.__new__
        return [new(KafkaRecord, (topic, partition, r.offset, r.timestamp, r.key, r.value,
                                  tuple(r.headers) if r.headers else ())) for r in got]

    def close(self) -> None:
        close_client(self._consumer)


class ConfluentFetcher:
    """confluent-kafka (librdkafka): one assigned consumer per partition, ``consume(n)``."""

    def __init__(self, bootstrap_servers, consumer_config, topic: str, partition: int, position: int):
        from confluent_kafka import Consumer, KafkaError, TopicPartition

        self.topic, self.partition = topic, partition
        self._TopicPartition = TopicPartition
        self._eof_code = KafkaError._PARTITION_EOF
        self._transient = (KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN, KafkaError._TIMED_OUT)
        # librdkafka's own log lines go through Python logging (this module's logger), not stderr.
        self._consumer = track_client(Consumer({**confluent_config(bootstrap_servers, consumer_config),
                                                "logger": _log}))
        self._next = position
        self._consumer.assign([TopicPartition(topic, partition, position)])

    def position(self) -> int:
        return self._next

    def seek(self, position: int) -> None:
        if position != self._next:
            self._consumer.assign([self._TopicPartition(self.topic, self.partition, position)])
            self._next = position

    def _consume(self, n: int, timeout_s: float) -> list:
        # What librdkafka already holds, at once; otherwise wait for a first message and take the
        # rest of what arrived with it (consume(n, timeout) would wait for all n or the timeout).
        msgs = self._consumer.consume(n, 0)
        if not msgs and timeout_s > 0:
            msgs = self._consumer.consume(1, timeout_s)
            if msgs and n > 1:
                msgs += self._consumer.consume(n - 1, 0)
        return msgs

    def fetch(self, max_records: int, timeout_ms: int) -> list:
        msgs = self._consume(max_records, timeout_ms / 1000)
        if not msgs:
            return []
        topic, partition, new = self.topic, self.partition, tuple.__new__
        out = [new(KafkaRecord, (topic, partition, m.offset(), m.timestamp()[1], m.key(), m.value(),
                                 tuple(h) if (h := m.headers()) else ()))
               for m in msgs if m.error() is None]
        if out:
            self._next = out[-1].offset + 1
        if len(out) < len(msgs):
            for m in msgs:
                if (err := m.error()) is not None:
                    self._on_error(err, m)
        return out

    def _on_error(self, err, msg) -> None:
        if err.code() == self._eof_code:
            # At the log end: the next offset the log holds, past any control records or gaps.
            if msg.offset() is not None and msg.offset() > self._next:
                self._next = msg.offset()
            return
        if err.retriable() or err.code() in self._transient:
            _log.warning("ReadFromKafka(client='confluent') %s-%s: %s; retrying", self.topic, self.partition, err)
            return
        raise KafkaReadError(f"ReadFromKafka(client='confluent'): reading {self.topic}-{self.partition} failed: "
                             f"{err.name()}: {err.str()}")

    def close(self) -> None:
        close_client(self._consumer)


def open_fetcher(client: str, bootstrap_servers, consumer_config, topic: str, partition: int, position: int):
    cls = ConfluentFetcher if client == "confluent" else PythonFetcher
    return cls(bootstrap_servers, consumer_config, topic, partition, position)

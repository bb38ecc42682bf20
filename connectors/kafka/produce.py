"""Producing many records, every one confirmed: what ``flowtrain replay`` sends events with.

``new_sender(client, bootstrap, cfg)`` gives a sender for one of ``CLIENTS``:

- ``PythonSender``: kafka-python through ``KafkaDelivery`` (acks=all, idempotent; every send confirmed);
- ``ConfluentSender``: confluent-kafka (librdkafka), acks=all and idempotent like ``new_producer``;
  librdkafka retries retriable failures itself (for ``delivery.timeout.ms``); every record's delivery
  report is checked.

Each has ``send(topic, value, key, timestamp_ms=, partition=)``, ``confirm()`` (returns only when no
record is outstanding and none failed; else ``ProduceError`` naming the error and the topic) and
``close()``.
"""
from __future__ import annotations

import time

from connectors.kafka.clients import close_client, new_producer
from connectors.kafka.delivery import KafkaDelivery, KafkaWriteError
from connectors.kafka.fetch import confluent_config


class ProduceError(RuntimeError):
    """Kafka did not acknowledge a record: the message names the error and the topic."""


class PythonSender:
    """kafka-python through ``KafkaDelivery`` (every send confirmed; at most ``pending`` unconfirmed)."""

    def __init__(self, bootstrap: str, cfg: dict, *, what: str = "flowtrain replay", pending: int = 10_000):
        self.producer = new_producer(bootstrap, {"linger_ms": 10, **cfg})
        self.delivery = KafkaDelivery(self.producer, what=what)
        self.pending = pending

    def send(self, topic: str, value: bytes, key: bytes | None, *, timestamp_ms: int | None = None,
             partition: int | None = None) -> None:
        self.delivery.send(topic, value, key=key, timestamp_ms=timestamp_ms, partition=partition)
        if self.delivery.pending >= self.pending:
            self.confirm()

    def confirm(self) -> None:
        try:
            self.delivery.confirm()
        except KafkaWriteError as err:
            raise ProduceError(str(err)) from None

    def close(self) -> None:
        close_client(self.producer)


class ConfluentSender:
    """confluent-kafka (librdkafka); see the module's doc. ``SystemExit`` with a one-line message when
    confluent-kafka is missing or ``cfg`` has no librdkafka equivalent (``what`` names the command)."""

    #: librdkafka properties of the reading consumers that mean nothing to a producer.
    CONSUMER_ONLY = ("group.id", "enable.auto.commit", "enable.auto.offset.store", "enable.partition.eof",
                     "fetch.wait.max.ms", "max.partition.fetch.bytes", "fetch.queue.backoff.ms", "fetch.min.bytes",
                     "fetch.max.bytes", "queued.min.messages", "queued.max.messages.kbytes", "isolation.level",
                     "auto.offset.reset", "check.crcs")

    def __init__(self, bootstrap: str, cfg: dict, *, what: str = "flowtrain replay", confirm_s: float = 180.0):
        try:
            from confluent_kafka import Producer
        except ImportError:
            raise SystemExit(f"{what} --client confluent needs confluent-kafka: pip install "
                             "'flowtrain[kafka-confluent]' (or confluent-kafka>=2.3), or use --client kafka-python") \
                from None
        try:
            conf = confluent_config(bootstrap, {k: v for k, v in cfg.items() if k not in ("linger_ms",)})
        except ValueError as err:
            raise SystemExit(f"{what} --client confluent: {err}") from None
        for key in self.CONSUMER_ONLY:
            conf.pop(key, None)
        conf.update({"acks": "all", "enable.idempotence": True, "partitioner": "murmur2_random", "linger.ms": 10,
                     "batch.size": 1_000_000,
                     "queue.buffering.max.messages": 200_000, "delivery.timeout.ms": 120_000})
        self.producer = Producer(conf)
        self.confirm_s = confirm_s
        self.outstanding, self.failures, self.topic = 0, [], None

    def _report(self, err, msg) -> None:
        self.outstanding -= 1
        if err is not None:
            self.failures.append((err, len(msg.value() or b"")))

    def send(self, topic: str, value: bytes, key: bytes | None, *, timestamp_ms: int | None = None,
             partition: int | None = None) -> None:
        self.topic = topic
        extra = {k: v for k, v in (("timestamp", timestamp_ms), ("partition", partition)) if v is not None}
        while True:
            try:
                self.producer.produce(topic, value, key, on_delivery=self._report, **extra)
                break
            except BufferError:  # the local queue is full: let deliveries drain it
                self.producer.poll(0.05)
        self.outstanding += 1
        self.producer.poll(0)  # delivery reports of what is done
        if self.failures:
            self._raise()

    def confirm(self) -> None:
        deadline = time.monotonic() + self.confirm_s
        while self.outstanding > 0 and time.monotonic() < deadline:
            self.producer.flush(1.0)
        if self.failures:
            self._raise()
        if self.outstanding > 0:
            raise ProduceError(f"{self.outstanding:,} events to topic {self.topic!r} not acknowledged within "
                               f"{self.confirm_s:g} s")

    def _raise(self) -> None:
        err, size = self.failures[0]
        raise ProduceError(f"Kafka did not accept a record of {size:,} bytes for topic {self.topic!r} "
                           f"({len(self.failures):,} not delivered): {err.name()}: {err.str()}")

    def close(self) -> None:
        self.producer.flush(5.0)


def new_sender(client: str, bootstrap: str, cfg: dict, *, what: str = "flowtrain replay"):
    """A sender for ``client`` (``"kafka-python"`` or ``"confluent"``, ``connectors.kafka.CLIENTS``)."""
    return (ConfluentSender if client == "confluent" else PythonSender)(bootstrap, cfg, what=what)

"""``WriteToKafka``: a Beam sink whose every finished bundle is acknowledged by Kafka."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import apache_beam as beam
from kafka.errors import KafkaTimeoutError

from connectors.kafka.admin import topic_max_message_bytes
from connectors.kafka.clients import close_client, new_producer
from connectors.kafka.delivery import KafkaDelivery, KafkaWriteError
from connectors.kafka.record import KafkaRecord

__all__ = ["WriteToKafka"]


def _as_message(element) -> tuple:
    """KafkaRecord or (key, value) -> (key, value, headers, timestamp_ms)."""
    if isinstance(element, KafkaRecord):
        return element.key, element.value, list(element.headers) or None, element.timestamp
    if isinstance(element, tuple) and len(element) == 2:
        key, value = element
        return key, value, None, None
    raise TypeError(f"WriteToKafka takes KafkaRecord or (key, value) elements, got {type(element).__name__}")


class _WriteFn(beam.DoFn):
    def __init__(self, bootstrap_servers, topic, producer_config, flush_timeout_s, retry_s=120.0):
        self._bootstrap, self._topic = bootstrap_servers, topic
        self._producer_config = dict(producer_config or {})
        self._flush_timeout_s = flush_timeout_s
        self._retry_s = retry_s
        self._producer = None

    def setup(self):
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

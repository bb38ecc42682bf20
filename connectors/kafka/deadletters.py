"""The one Kafka wire format of a dead letter (``connectors.deadletter.DeadLetter``): ``dead_letter_record`` writes
it, ``dead_letter_from_record`` reads it back, ``WriteDeadLettersToKafka`` sends a PCollection of them to a topic.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import apache_beam as beam

from connectors.kafka.admin import topic_max_message_bytes
from connectors.kafka.delivery import record_size, value_budget
from connectors.kafka.record import KafkaRecord
from connectors.kafka.write import WriteToKafka
from connectors.rows import DeadLetter

__all__ = ["MAX_REASON_CHARS", "WriteDeadLettersToKafka", "dead_letter_from_record", "dead_letter_record"]

#: A reason (or source) longer than this is cut: a reason is words for a user, not a payload.
MAX_REASON_CHARS = 4096


def _payload_bytes(payload) -> tuple[bytes, str]:
    """(bytes, format): bytes as they are, text as UTF-8, anything else as JSON."""
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return bytes(payload), "bytes"
    if payload is None:
        return b"", "none"
    if isinstance(payload, str):
        return payload.encode("utf-8", errors="surrogateescape"), "text"
    return json.dumps(payload, default=str, allow_nan=True).encode("utf-8"), "json"


def _cut(text: str, limit: int = MAX_REASON_CHARS) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def dead_letter_record(letter: DeadLetter, *, max_bytes: int | None = None) -> tuple[bytes, bytes, list]:
    """``(key, value, headers)`` of a dead letter on Kafka (what ``WriteDeadLettersToKafka`` and the
    stream pipeline produce; ``dead_letter_from_record`` reads it back).

    key = source; value = the payload (bytes as they are, text as UTF-8, anything else as JSON);
    headers ``source``, ``reason``, ``payload_format`` (bytes | text | json | none). A record
    that would not fit ``max_bytes`` (the topic's ``max.message.bytes``) keeps its source and
    reason and the start of its payload, with headers ``payload_truncated`` = ``true``,
    ``payload_size`` (the original size in bytes) and ``payload_sha256`` (of the original).
    """
    source, reason = _cut(str(letter.source), 1024), _cut(str(letter.reason))
    value, fmt = _payload_bytes(letter.payload)
    key = source.encode("utf-8", errors="replace")
    headers = [("source", key), ("reason", reason.encode("utf-8", errors="replace")),
               ("payload_format", fmt.encode())]
    if max_bytes is not None and record_size(key, value, headers) > max_bytes:
        extra = [("payload_truncated", b"true"), ("payload_size", str(len(value)).encode()),
                 ("payload_sha256", hashlib.sha256(value).hexdigest().encode())]
        headers += extra
        keep = value_budget(max_bytes, key, headers)
        if keep < 0:
            raise ValueError(f"a dead letter's source and reason alone do not fit {max_bytes:,} bytes")
        value = value[:keep]
    return key, value, headers


def dead_letter_from_record(value: bytes | None, headers) -> tuple[DeadLetter, dict]:
    """A dead letter read back from its Kafka record, and its truncation facts (``{}`` when whole:
    else ``{"truncated": True, "size": original bytes, "sha256": hex}``)."""
    h = {k: v for k, v in (headers or ())}
    fmt = h.get("payload_format", b"bytes").decode()
    value = value or b""
    info = {}
    if h.get("payload_truncated") == b"true":
        info = {"truncated": True, "size": int(h["payload_size"]), "sha256": h["payload_sha256"].decode()}
    payload: Any = value
    if not info:
        if fmt == "text":
            payload = value.decode("utf-8", errors="surrogateescape")
        elif fmt == "json":
            payload = json.loads(value)
        elif fmt == "none":
            payload = None
    return DeadLetter(payload, h.get("source", b"").decode("utf-8", errors="replace"),
                      h.get("reason", b"").decode("utf-8", errors="replace")), info


class _DeadLetterRecordFn(beam.DoFn):
    """DeadLetter -> KafkaRecord in the one wire format, fitted to the topic's max.message.bytes."""

    def __init__(self, bootstrap_servers, topic, client_config):
        self._bootstrap, self._topic, self._client_config = bootstrap_servers, topic, client_config
        self._max = None

    def setup(self):
        self._max = topic_max_message_bytes(self._bootstrap, self._topic, client_config=self._client_config)

    def process(self, letter: DeadLetter):
        key, value, headers = dead_letter_record(letter, max_bytes=self._max)
        yield KafkaRecord(self._topic, -1, -1, None, key, value, tuple(headers))


class WriteDeadLettersToKafka(beam.PTransform):
    """To a dead-letter topic in the one wire format of ``dead_letter_record``: the raw payload as
    value, ``source``, ``reason`` and ``payload_format`` as headers; a payload too large for the
    topic is truncated (its original size and SHA-256 in headers), never lost with its reason.
    Every record is confirmed by Kafka before the bundle completes (``WriteToKafka``)."""

    def __init__(self, bootstrap_servers: str | Sequence[str], topic: str, **write_kwargs):
        super().__init__()
        self._bootstrap, self._topic, self._kwargs = bootstrap_servers, topic, write_kwargs

    def expand(self, letters):
        security = {k: v for k, v in (self._kwargs.get("producer_config") or {}).items()
                    if k.startswith(("security_", "ssl_", "sasl_"))}
        return (letters
                | "ToRecord" >> beam.ParDo(_DeadLetterRecordFn(self._bootstrap, self._topic, security))
                | "Produce" >> WriteToKafka(self._bootstrap, self._topic, **self._kwargs))

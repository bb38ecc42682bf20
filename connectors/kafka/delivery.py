"""Sending records and confirming every one: ``KafkaDelivery``, and the size arithmetic it checks."""
from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kafka.errors import KafkaError, KafkaTimeoutError
from kafka.record.default_records import DefaultRecordBatchBuilder

from connectors.kafka.clients import describe_error, is_retriable

__all__ = ["KafkaDelivery", "KafkaWriteError", "record_size", "value_budget"]

_log = logging.getLogger(__name__)


class KafkaWriteError(RuntimeError):
    """Kafka did not accept a record; the message names the Kafka error, the topic and the size."""


def record_size(key: bytes | None, value: bytes | None, headers=None) -> int:
    """Upper bound of one record's size on the wire, as a record batch of its own (what the
    producer checks against ``max_request_size`` and the broker against ``max.message.bytes``)."""
    return DefaultRecordBatchBuilder.estimate_size_in_bytes(key, value, list(headers or ()))


def value_budget(max_bytes: int, key: bytes | None = None, headers=None) -> int:
    """How many bytes a value may have so that its record fits ``max_bytes``."""
    return max_bytes - record_size(key, b"", headers) - 4  # the value's length varint grows to 5 bytes


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

    def confirm(self, *, within_s: float | None = None) -> int:
        """Block until every record sent since the last confirm is acknowledged; returns how many.
        ``within_s`` shortens the wait (a job that is stopping): what is not acknowledged by then is a
        ``KafkaWriteError`` as after ``retry_s``."""
        retry_s = self._retry_s if within_s is None else min(self._retry_s, within_s)
        deadline = time.monotonic() + retry_s
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
            fatal = [(e, err) for e, err in failed if not is_retriable(err)]
            if fatal or out_of_time:
                bad = fatal or failed or [(waiting[0], KafkaTimeoutError(
                    f"not acknowledged within {retry_s:g} s"))]
                entry, err = bad[0]
                total, bad = len(self._pending), len(fatal) if fatal else len(failed) + len(waiting)
                self._pending = []
                raise KafkaWriteError(
                    f"{self._what + ': ' if self._what else ''}Kafka did not accept a record of {entry.size:,} "
                    f"bytes for topic {entry.topic!r} ({bad} of {total} records not delivered): "
                    f"{describe_error(err)}"
                    + (f" (the topic's max.message.bytes was {self._limits[entry.topic]:,} when this producer "
                       f"started)" if entry.topic in self._limits else ""))
            if failed:
                _log.warning("%s: %d record(s) for %r failed with %s; sending them again", self._what,
                             len(failed), failed[0][0].topic, describe_error(failed[0][1]))
                time.sleep(0.5)
                for entry, _ in failed:
                    self._submit(entry)

    def discard(self) -> None:
        """Forget unconfirmed records (after a failure the caller gives up on them)."""
        self._pending = []


"""The restriction of ``ReadFromKafka``'s splittable DoFn: an offset range of one partition (``PartitionRange``),
claimed in order by ``PartitionTracker`` (checkpoints, never splits a partition: log order), its progress
estimated from cached log-end offsets (``EndOffsets``)."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace

from apache_beam.io.iobase import RestrictionProgress, RestrictionTracker
from kafka import TopicPartition

from connectors.kafka import offsets
from connectors.kafka.clients import shared_consumer
from connectors.kafka.offsets import UNBOUNDED

__all__ = ["PartitionRange", "PartitionTracker", "EndOffsets"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PartitionRange:
    """The restriction: offsets ``[start, stop)`` of one partition (``stop`` may be UNBOUNDED)."""

    topic: str
    partition: int
    start: int
    stop: int


class PartitionTracker(RestrictionTracker):
    """Claims offsets of one partition in order; checkpoints, never splits a partition.

    Claiming ``stop`` (an offset outside the range) marks the range done, which is how the
    reader ends at a stop time or over trailing gaps, as Java's ``tryClaim(Long.MAX_VALUE)``.
    """

    def __init__(self, restriction: PartitionRange, end_offsets: EndOffsets):
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


class EndOffsets:
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
            consumer, lock = shared_consumer(*self._cfg)
            tp = TopicPartition(topic, partition)
            with lock:
                end = consumer.end_offsets([tp], timeout_ms=5000)[tp]
        except Exception as err:  # noqa: BLE001 - an estimate must never fail the read
            _log.debug("end offset of %s-%s unavailable: %s", topic, partition, err)
            return hit[1] if hit else fallback
        with self._lock:
            self._cache[key] = (now, end)
        return end

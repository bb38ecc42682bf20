"""Pure arithmetic behind ``ReadFromKafka``: how ``start``/``stop`` become offset ranges.

No Kafka client and no Beam runner here, so every rule has a plain unit test. The reader
resolves the broker facts (beginning, end, committed offsets, offsets for a time) and passes
them in.
"""
from __future__ import annotations

import datetime as _dt
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from apache_beam.utils.timestamp import Timestamp

#: Stop offset of an unbounded partition read: the range grows with the log.
UNBOUNDED = sys.maxsize

StartSpec = str | Mapping | _dt.datetime | Timestamp
StopSpec = None | str | int | _dt.datetime | Timestamp


@dataclass(frozen=True)
class PartitionRead:
    """One topic-partition to read: the element of the splittable DoFn (Java's descriptor)."""

    topic: str
    partition: int
    start_offset: int
    stop_offset: int = UNBOUNDED
    #: Stop at the first record whose timestamp is at or after this (ms since epoch).
    stop_time_ms: int | None = None

    @property
    def bounded(self) -> bool:
        return self.stop_offset != UNBOUNDED


def to_millis(when: _dt.datetime | Timestamp | int | float) -> int:
    """Milliseconds since the epoch; a naive datetime is read as UTC."""
    if isinstance(when, Timestamp):
        return when.micros // 1000
    if isinstance(when, _dt.datetime):
        if when.tzinfo is None:
            when = when.replace(tzinfo=_dt.timezone.utc)
        return int(when.timestamp() * 1000)
    raise TypeError(f"expected a datetime or apache_beam Timestamp, got {type(when).__name__}")


def is_time(spec) -> bool:
    return isinstance(spec, (_dt.datetime, Timestamp))


def validate_start(start: StartSpec) -> None:
    if isinstance(start, str) and start in ("earliest", "latest", "committed"):
        return
    if isinstance(start, Mapping) or is_time(start):
        return
    raise ValueError(f"ReadFromKafka(start={start!r}): use 'earliest', 'latest', 'committed', "
                     "a {(topic, partition): offset} dict, or a datetime / Timestamp")


def validate_stop(stop: StopSpec) -> None:
    if stop is None or stop == "end" or is_time(stop):
        return
    if isinstance(stop, int) and not isinstance(stop, bool) and stop >= 0:
        return
    raise ValueError(f"ReadFromKafka(stop={stop!r}): use None (unbounded), 'end' (the end offsets seen "
                     "at start), a record count >= 0 per partition, or a datetime / Timestamp")


def start_offset(start: StartSpec, *, topic: str, partition: int, beginning: int, end: int,
                 committed: int | None = None, for_time: int | None = None) -> int:
    """Where a partition's read begins; an offset the log no longer holds moves to the beginning."""
    if start == "earliest":
        offset = beginning
    elif start == "latest":
        offset = end
    elif start == "committed":
        # A group with no commit for this partition starts at the beginning (auto.offset.reset=earliest).
        offset = beginning if committed is None else committed
    elif isinstance(start, Mapping):
        offset = start.get((topic, partition), beginning)
    else:  # a time: first offset whose timestamp >= time, or the end when there is none yet
        offset = end if for_time is None else for_time
    return max(offset, beginning)


def stop_offset(stop: StopSpec, *, start: int, end: int, for_time: int | None = None) -> int:
    """Exclusive stop offset of a partition's range; ``UNBOUNDED`` when it grows with the log."""
    if stop is None:
        return UNBOUNDED
    if stop == "end":
        return max(start, end)
    if isinstance(stop, int):
        return start + stop
    # A time: bounded when a record at or after it already exists, else open until one arrives.
    return max(start, for_time) if for_time is not None else UNBOUNDED


def backlog(position: int, stop: int, end_estimate: int) -> int:
    """Records left to read: up to the log end for unbounded reads, up to stop for bounded."""
    limit = end_estimate if stop == UNBOUNDED else min(stop, end_estimate)
    return max(0, limit - position)


def idle_watermark_ms(current_ms: int, now_ms: int, lag_ms: int) -> int:
    """Watermark of a caught-up partition: moves to now - lag, never backwards."""
    return max(current_ms, now_ms - lag_ms)

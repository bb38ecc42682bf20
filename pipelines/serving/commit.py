"""Raw offsets -> committed, only once every event below them has its prediction or dead letter.

``CommitScored`` (keyed by raw partition, Beam state) commits the contiguous prefix of scored
offset ranges per partition: micro-batches finish out of order (bundles run in parallel), and a
crash re-reads, never skips: **at least once**. After a restart from committed offsets an event
may be scored twice, only if its offset is at or after the offset committed when the scorer
stopped; each prediction carries its source, which identifies such a duplicate.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import apache_beam as beam
from apache_beam.transforms import window
from apache_beam.transforms.userstate import ReadModifyWriteStateSpec

from connectors.kafka import close_client, new_consumer, retry_kafka

__all__ = ["ScoredRanges", "CommitScored"]


class ScoredRanges:
    """Per raw partition: the offset below which every event is scored, from ranges in any order.

    ``add(first, last, first_record_at)`` records the scored range ``[first, last]`` and moves
    ``next`` over every contiguous range. A gap before the lowest pending range is either a range
    still being scored or offsets that hold no record (compaction, transaction markers);
    ``first_record_at(offset)`` (the offset of the first record at or after ``offset``, None if
    unknown yet) tells them apart, asked once per position, so the commit never stalls on a hole.
    """

    def __init__(self, next_offset: int):
        self.next = next_offset
        self.pending: dict[int, int] = {}
        self._probed: tuple[int, int | None] | None = None

    def add(self, first: int, last: int, first_record_at: Callable[[int], int | None]) -> bool:
        """True if ``next`` moved."""
        if last >= self.next:
            self.pending[first] = max(last, self.pending.get(first, last))
        before = self.next
        while self.pending:
            lowest = min(self.pending)
            if lowest > self.next:
                if self._probed is None or self._probed[0] != self.next or self._probed[1] is None:
                    self._probed = (self.next, first_record_at(self.next))
                found = self._probed[1]
                if found is None or found < lowest:
                    break  # events before the lowest range are still being scored
            self.next = max(self.next, self.pending.pop(lowest) + 1)
        return self.next > before


class _CommitScoredFn(beam.DoFn):
    """Per raw partition (the key), Beam state: commit the group's offset once everything below it
    has its prediction or dead letter acknowledged (``ScoredRanges``)."""

    PROGRESS = ReadModifyWriteStateSpec("progress", beam.coders.PickleCoder())

    def __init__(self, cfg):
        self.cfg = cfg

    def setup(self):
        self.consumer = new_consumer(self.cfg.kafka.bootstrap, self.cfg.kafka.config, group_id=self.cfg.score_group_id)
        self.probe = new_consumer(self.cfg.kafka.bootstrap, {"fetch_max_wait_ms": 100, **self.cfg.kafka.config},
                                  group_id=None)

    def teardown(self):
        for name in ("consumer", "probe"):
            if getattr(self, name, None) is not None:
                close_client(getattr(self, name))
                setattr(self, name, None)

    def process(self, element, progress=beam.DoFn.StateParam(PROGRESS)):
        from kafka import OffsetAndMetadata, TopicPartition

        key, (first, last) = element
        topic, partition = key.rsplit("/", 1)
        tp = TopicPartition(topic, int(partition))
        ranges = progress.read()
        if ranges is None:  # where this run's read started: the committed offset, else the log start
            committed = retry_kafka(lambda: self.consumer.committed(tp), "committed offset")
            ranges = ScoredRanges(committed if committed is not None else retry_kafka(
                lambda: self.consumer.beginning_offsets([tp]), "beginning offset")[tp])
        if ranges.add(first, last, lambda offset: self._first_record_at(tp, offset)):
            offsets = {tp: OffsetAndMetadata(ranges.next, "", -1)}
            retry_kafka(lambda: self.consumer.commit(offsets), "offset commit")
            yield key, ranges.next
        progress.write(ranges)

    def _first_record_at(self, tp, offset: int) -> int | None:
        self.probe.assign([tp])
        self.probe.seek(tp, offset)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            records = self.probe.poll(timeout_ms=200).get(tp, [])
            if records:
                return records[0].offset
        return None


class CommitScored(beam.PTransform):
    """``(partition key, (first, last))`` scored ranges -> the group's committed raw offsets."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg

    def expand(self, ranges):
        return (ranges
                | "GlobalWindow" >> beam.WindowInto(window.GlobalWindows())
                | "CommitContiguous" >> beam.ParDo(_CommitScoredFn(self.cfg)))

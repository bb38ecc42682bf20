"""The reader's offset arithmetic, without a broker."""
import datetime as dt

import pytest

from connectors.kafka import offsets as ko
from connectors.kafka.offsets import UNBOUNDED


def test_start_offsets():
    facts = dict(topic="t", partition=1, beginning=10, end=50)
    assert ko.start_offset("earliest", **facts) == 10
    assert ko.start_offset("latest", **facts) == 50
    assert ko.start_offset("committed", committed=42, **facts) == 42
    assert ko.start_offset("committed", committed=None, **facts) == 10
    assert ko.start_offset("committed", committed=3, **facts) == 10  # retention removed offset 3
    assert ko.start_offset({("t", 1): 20}, **facts) == 20
    assert ko.start_offset({("t", 0): 20}, **facts) == 10
    when = dt.datetime(2024, 1, 1)
    assert ko.start_offset(when, for_time=33, **facts) == 33
    assert ko.start_offset(when, for_time=None, **facts) == 50


def test_stop_offsets():
    assert ko.stop_offset(None, start=5, end=9) == UNBOUNDED
    assert ko.stop_offset("end", start=5, end=9) == 9
    assert ko.stop_offset("end", start=12, end=9) == 12  # started beyond the end: empty range
    assert ko.stop_offset(100, start=5, end=9) == 105
    assert ko.stop_offset(dt.datetime(2024, 1, 1), start=5, end=9, for_time=7) == 7
    assert ko.stop_offset(dt.datetime(2024, 1, 1), start=5, end=9, for_time=None) == UNBOUNDED


def test_backlog_and_idle_watermark():
    assert ko.backlog(5, UNBOUNDED, 9) == 4
    assert ko.backlog(5, 7, 9) == 2
    assert ko.backlog(9, UNBOUNDED, 9) == 0
    assert ko.idle_watermark_ms(1000, 5000, 1000) == 4000
    assert ko.idle_watermark_ms(6000, 5000, 0) == 6000  # never backwards


def test_millis_and_validation():
    assert ko.to_millis(dt.datetime(1970, 1, 1, 0, 0, 1)) == 1000
    with pytest.raises(ValueError, match="start="):
        ko.validate_start("beginning")
    with pytest.raises(ValueError, match="stop="):
        ko.validate_stop(-1)
    with pytest.raises(ValueError, match="stop="):
        ko.validate_stop(True)


def test_tracker_claims_checkpoints_and_ends_by_claiming_stop():
    from connectors.kafka.restriction import PartitionRange, PartitionTracker

    class NoEnds:
        def get(self, topic, partition, fallback):
            return 20

    t = PartitionTracker(PartitionRange("t", 0, 5, UNBOUNDED), NoEnds())
    assert not t.is_bounded()
    assert t.try_claim(5) and t.try_claim(7)
    assert t.current_progress().remaining_work == 12  # 20 - 8
    assert t.try_split(0.5) is None  # never splits a partition
    primary, residual = t.try_split(0)
    assert (primary.start, primary.stop, residual.start, residual.stop) == (5, 8, 8, UNBOUNDED)
    assert not t.try_claim(8)  # beyond the checkpoint
    t.check_done()

    b = PartitionTracker(PartitionRange("t", 0, 0, 10), NoEnds())
    assert b.try_claim(3)
    with pytest.raises(ValueError, match="not claimed"):
        b.check_done()
    assert not b.try_claim(10)  # claiming stop marks the range done (trailing gaps, stop time)
    b.check_done()
    with pytest.raises(ValueError, match="increasing"):
        b.try_claim(2)

"""The streaming job's pure pieces: event parsing, bad-event kinds, the seen-source filter."""
import json
import random

import numpy as np

from connectors.deadletter import DeadLetter
from flowtrain.train.stream import _unseen
from pipelines.flights.events import MALFORMED_KINDS, events_table, malform, parse_event

EVENT = {"year": 2013, "month": 1, "day": 1, "hour": 5, "minute": 15, "sched_dep_time": 515, "sched_arr_time": 819,
         "carrier": "UA", "flight": 1545, "tailnum": "N14228", "origin": "EWR", "dest": "IAH", "distance": 1400.0,
         "time_hour": "2013-01-01T10:00:00Z", "arr_delay": 11.0}


def test_parse_event_accepts_a_good_event_and_builds_a_table():
    assert parse_event(json.dumps(EVENT).encode(), "raw/0/0") == EVENT
    table = events_table([EVENT], [("raw", 0, 7)])
    assert table["source"].to_pylist() == ["raw/0/7"] and table["src_offset"].to_pylist() == [7]
    assert str(table.schema.field("time_hour").type) == "timestamp[s, tz=UTC]"


def test_each_malformed_kind_gets_its_reason():
    rng = random.Random(0)
    expected = {"broken JSON": "broken JSON", "missing field": "missing field(s)", "wrong type": "wrong type",
                "NaN": "NaN"}
    for kind in MALFORMED_KINDS:
        out = parse_event(malform(EVENT, kind, rng), "raw/1/2")
        if kind == "impossible value":  # well-formed: the feature code's impossible-value check rejects it
            assert out["distance"] < 0
        else:
            assert isinstance(out, DeadLetter) and out.reason.startswith(expected[kind]) and out.source == "raw/1/2"


def test_unseen_filters_by_highest_offset_per_raw_partition():
    fresh = _unseen(np.array([0, 0, 1, 1, 2]), np.array([5, 6, 3, 9, 0]), {0: 5, 1: 8})
    assert fresh.tolist() == [False, True, False, True, True]

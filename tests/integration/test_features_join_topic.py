"""``--join kafka://TOPIC:KEY[:VALID_FROM]`` (``pipelines.stream.join_topic.TopicTable``) on the session's real broker:
a compacted topic of a table's rows joins as the same table from a file does; versions published while it runs are
joined from then on (one that comes after events at its time were joined is counted late); a tombstone deletes its
key's row; bad records are rejected, counted and named, the table going on without them; an empty or missing topic
is refused in one line. The stream's end-to-end use (the scorer joining a topic, skew zero against the backfill) is
in test_features_stream."""
from __future__ import annotations

import json
import time
import uuid

import numpy as np
import pyarrow as pa
import pytest
from kafka import KafkaProducer
from kafka.admin import KafkaAdminClient, NewTopic

from pipelines.features.asof import AsOfTable
from pipelines.features.declare import parse_join
from pipelines.stream.join_topic import TopicTable

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(120)]

ROWS = [{"merchant": "m0", "valid_from": 100, "risk": 0}, {"merchant": "m0", "valid_from": 200, "risk": 2},
        {"merchant": "m1", "valid_from": 50, "risk": 1}]


def _topic(bootstrap: str, rows: list, *, keyed: bool = True) -> str:
    name = f"jt-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(name, 2, 1, topic_configs={"cleanup.policy": "compact"})])
    admin.close()
    _send(bootstrap, name, rows, keyed=keyed)
    return name


def _send(bootstrap: str, topic: str, rows: list, *, keyed: bool = True) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap)
    for row in rows:
        key, value = (row if isinstance(row, tuple) else
                      (f"{row['merchant']}@{row['valid_from']}".encode() if keyed else None,
                       json.dumps(row).encode()))
        producer.send(topic, value, key=key).get(timeout=30)
    producer.close()


def _refreshed(table: TopicTable, done, timeout_s: float = 30) -> None:
    """``table.refresh()`` (as each micro-batch's join does) until ``done()``: the records published have come."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "the records published did not reach the table"
        table.refresh()
        time.sleep(0.1)


def _joined(table, keys: list, times: list) -> list:
    rows = table.lookup(pa.array(keys), np.array(times, dtype=np.int64) * 1_000_000)
    return table.take(rows)["merchant_risk"].to_pylist()


def test_a_topic_joins_as_its_rows_from_a_file_and_follows_updates_late_ones_counted(kafka_broker, capsys):
    join = parse_join(f"kafka://{_topic(kafka_broker.bootstrap, ROWS)}:merchant:valid_from")
    table = TopicTable(join, kafka_broker.bootstrap, time_format="s")
    try:
        keys, times = ["m0", "m0", "m0", "m1", "m1", "m2", None], [99, 100, 250, 49, 60, 300, 300]
        from_file = AsOfTable(parse_join("rows.csv:merchant:valid_from"), pa.Table.from_pylist(ROWS),
                              time_format="s")
        assert _joined(table, keys, times) == _joined(from_file, keys, times) == [None, 0, 2, None, 1, None, None]
        assert list(table.columns) == ["merchant_risk"] and table.columns["merchant_risk"].type == pa.int64()
        # a new version of m1 from 400 (after every time joined: on time) and of m0 from 150 (late: 300 was joined)
        _send(kafka_broker.bootstrap, join.table[len("kafka://"):],
              [{"merchant": "m1", "valid_from": 400, "risk": 5}, {"merchant": "m0", "valid_from": 150, "risk": 7}])
        _refreshed(table, lambda: len(table.rows) == 5)
        assert _joined(table, ["m1", "m1", "m0"], [399, 400, 160]) == [1, 5, 7]
        assert table.late_updates == 1 and table.rejected == 0
        assert "a version of m0 valid from 150 came after events at or after that time were joined" in \
            capsys.readouterr().err
    finally:
        table.close()


def test_a_tombstone_deletes_its_row_and_bad_records_are_rejected_by_name(kafka_broker, capsys):
    bad = [(b"x1", b"not json"), (b"x2", json.dumps([1, 2]).encode()),
           (b"x3", json.dumps({"merchant": "m9", "risk": 1}).encode()),  # no valid_from
           (b"x4", json.dumps({"merchant": "m9", "valid_from": "soon", "risk": 1}).encode())]
    name = _topic(kafka_broker.bootstrap, [*ROWS, *bad])
    table = TopicTable(parse_join(f"kafka://{name}:merchant:valid_from"), kafka_broker.bootstrap, time_format="s")
    try:
        assert table.rejected == 4 and len(table.rows) == 3
        err = capsys.readouterr().err
        assert "rejected: expected a JSON object" in err and "rejected: no valid_from" in err
        assert "rejected: valid_from 'soon' is not a time" in err and "offset" in err
        _send(kafka_broker.bootstrap, name, [(b"m1@50", None),  # m1's only version deleted
                                             (b"x5", json.dumps({"merchant": "m3", "valid_from": 1,
                                                                 "risk": "high"}).encode()),  # not an int64
                                             (b"x6", json.dumps({"merchant": "m3", "valid_from": 1, "risk": 1,
                                                                 "owner": "z"}).encode())])  # a new column
        _refreshed(table, lambda: table.rejected == 6)
        assert _joined(table, ["m1", "m0"], [60, 250]) == [None, 2] and table.rejected == 6
        err = capsys.readouterr().err
        assert "column(s) owner not in the table it started with" in err
    finally:
        table.close()


def test_an_empty_or_missing_topic_is_refused_in_one_line(kafka_broker):
    empty = _topic(kafka_broker.bootstrap, [])
    with pytest.raises(ValueError, match=f"topic '{empty}' holds no row of the table; publish the table"):
        TopicTable(parse_join(f"kafka://{empty}:merchant:valid_from"), kafka_broker.bootstrap, wait_s=5)
    with pytest.raises(ValueError, match="topic 'jt-none-here' does not exist on"):
        TopicTable(parse_join("kafka://jt-none-here:merchant"), kafka_broker.bootstrap, wait_s=2)

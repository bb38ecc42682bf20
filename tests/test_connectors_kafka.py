"""ReadFromKafka / WriteToKafka against the session's real broker."""
from __future__ import annotations

import time
import uuid

import apache_beam as beam
import pytest
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to
from apache_beam.transforms import window
from kafka import KafkaProducer

from connectors.kafka import KafkaRecord, ReadFromKafka, WriteToKafka
from flowtrain.local.runners import pipeline_options

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(240)]


def _produce(bootstrap, topic, n, partitions=3, start=0):
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    sent = []
    for i in range(start, start + n):
        md = producer.send(topic, key=f"k{i}".encode(), value=f"v{i}".encode(),
                           headers=[("i", str(i).encode())], partition=i % partitions,
                           timestamp_ms=1_700_000_000_000 + i).get(timeout=30)
        sent.append(KafkaRecord(topic, md.partition, md.offset, 1_700_000_000_000 + i,
                                f"k{i}".encode(), f"v{i}".encode(), (("i", str(i).encode()),)))
    producer.close()
    return sent


def test_bounded_read_returns_exactly_the_records(bootstrap, new_topic):
    topic = new_topic(partitions=3)
    sent = _produce(bootstrap, topic, 90)
    with TestPipeline(options=pipeline_options("batch")) as p:
        records = p | ReadFromKafka(bootstrap, topic, stop="end")
        assert_that(records, equal_to(sent))
        stamps = records | beam.Map(lambda r, ts=beam.DoFn.TimestampParam: (r.timestamp, ts.micros // 1000))
        assert_that(stamps | beam.Filter(lambda pair: pair[0] != pair[1]), equal_to([]), label="stamps")


def _open_sockets() -> int:
    import os

    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return count


def test_repeated_bounded_reads_do_not_leak_connections(bootstrap, new_topic):
    """Beam may drop the DoFn instances of a finished read without teardown; their Kafka
    clients must not stay connected on kafka-python's shared IO thread."""
    from connectors.kafka import close_all_clients

    topic = new_topic(partitions=3)
    sent = _produce(bootstrap, topic, 30)

    def read_once():
        with TestPipeline(options=pipeline_options("batch")) as p:
            assert_that(p | ReadFromKafka(bootstrap, topic, stop="end"), equal_to(sent))

    read_once()  # the process-wide end-offsets consumer is opened here
    time.sleep(0.5)
    after_one = _open_sockets()
    for _ in range(4):
        read_once()
    time.sleep(0.5)
    assert _open_sockets() <= after_one, "bounded reads left Kafka connections open"
    assert close_all_clients() >= 1  # the shared end-offsets consumer, closed on request


def test_start_committed_returns_only_newer_records(bootstrap, new_topic):
    topic = new_topic(partitions=3)
    group = f"g-{uuid.uuid4().hex[:6]}"
    first = _produce(bootstrap, topic, 30)
    with TestPipeline(options=pipeline_options("batch")) as p:
        assert_that(p | ReadFromKafka(bootstrap, topic, start="committed", stop="end", group_id=group),
                    equal_to(first))
    newer = _produce(bootstrap, topic, 12, start=30)
    with TestPipeline(options=pipeline_options("batch")) as p:
        assert_that(p | ReadFromKafka(bootstrap, topic, start="committed", stop="end", group_id=group),
                    equal_to(newer))


def test_stop_count_reads_n_per_partition(bootstrap, new_topic):
    topic = new_topic(partitions=2)
    sent = _produce(bootstrap, topic, 20, partitions=2)
    with TestPipeline(options=pipeline_options("batch")) as p:
        got = p | ReadFromKafka(bootstrap, topic, stop=3) | beam.Map(lambda r: (r.partition, r.offset))
        assert_that(got, equal_to([(p_, o) for p_ in range(2) for o in range(3)]))
    assert len(sent) == 20


def test_write_then_read_round_trip(bootstrap, new_topic):
    topic = new_topic(partitions=3)
    rows = [KafkaRecord(topic, -1, -1, 1_700_000_000_000 + i, f"key{i}".encode(), f"val{i}".encode(),
                        (("h", f"x{i}".encode()),)) for i in range(25)]
    pairs = [(f"pk{i}".encode(), f"pv{i}".encode()) for i in range(5)]
    with TestPipeline(options=pipeline_options("batch")) as p:
        _ = p | "Records" >> beam.Create(rows) | "WriteRecords" >> WriteToKafka(bootstrap, topic)
    with TestPipeline(options=pipeline_options("batch")) as p:
        _ = p | "Pairs" >> beam.Create(pairs) | "WritePairs" >> WriteToKafka(bootstrap, topic)
    with TestPipeline(options=pipeline_options("batch")) as p:
        got = (p | ReadFromKafka(bootstrap, topic, stop="end")
               | beam.Map(lambda r: (r.key, r.value, r.headers)))
        assert_that(got, equal_to([(r.key, r.value, r.headers) for r in rows]
                                  + [(k, v, ()) for k, v in pairs]))


def test_write_to_missing_topic_without_autocreate_fails_clearly(tmp_path):
    from flowtrain.local.kafka import LocalKafka, free_port

    broker = LocalKafka(port=free_port(), data_dir=tmp_path / "k",
                        extra_config={"auto.create.topics.enable": "false"})
    broker.start(timeout_s=120, quiet=True)
    try:
        with pytest.raises(Exception, match="does not exist on"):
            with TestPipeline(options=pipeline_options("batch")) as p:
                _ = (p | beam.Create([(b"k", b"v")])
                     | WriteToKafka(broker.bootstrap, "no-such-topic",
                                    producer_config={"max_block_ms": 3000}))
    finally:
        broker.stop(quiet=True)


class _Collect(beam.DoFn):
    seen: list = []

    def process(self, element, w=beam.DoFn.WindowParam):
        _Collect.seen.append((w.start.micros // 1_000_000, element))


@pytest.mark.streaming
def test_unbounded_read_on_prism_sees_new_records_and_fires_windows(bootstrap, new_topic):
    topic = new_topic(partitions=3)
    _Collect.seen = []
    p = beam.Pipeline(options=pipeline_options("streaming"))
    (p | ReadFromKafka(bootstrap, topic, poll_interval_s=0.2)
       | beam.WindowInto(window.FixedWindows(1))
       | beam.Map(lambda r: ("n", 1))
       | beam.CombinePerKey(sum)
       | beam.ParDo(_Collect()))
    result = p.run()
    try:
        producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
        deadline = time.monotonic() + 90
        produced = 0
        while time.monotonic() < deadline:
            for _ in range(10):  # records stamped "now": windows close as the watermark passes
                producer.send(topic, key=str(produced).encode(), value=b"x", partition=produced % 3)
                produced += 1
            producer.flush()
            if sum(c for _, (_, c) in _Collect.seen) >= 60 and len({w for w, _ in _Collect.seen}) >= 2:
                break
            time.sleep(0.5)
        producer.close()
        assert str(result.state).endswith("RUNNING")
    finally:
        result.cancel()
    windows = {w for w, _ in _Collect.seen}
    assert len(windows) >= 2, f"windows fired: {_Collect.seen}"
    assert sum(c for _, (_, c) in _Collect.seen) >= 60

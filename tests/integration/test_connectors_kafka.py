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
# Record timestamps an hour ago: far older ones (a fixed 2023 date) fall outside the broker's 7-day
# retention, and its periodic retention check (every 5 minutes) deleted them between a test's write
# and its read (an empty read, or a read waiting on deleted offsets, in long runs).
T0 = (int(time.time()) - 3600) * 1000


def _produce(bootstrap, topic, n, partitions=3, start=0):
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    sent = []
    for i in range(start, start + n):
        md = producer.send(topic, key=f"k{i}".encode(), value=f"v{i}".encode(),
                           headers=[("i", str(i).encode())], partition=i % partitions,
                           timestamp_ms=T0 + i).get(timeout=30)
        sent.append(KafkaRecord(topic, md.partition, md.offset, T0 + i,
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
        got = p | ReadFromKafka(bootstrap, topic, stop=3)
        assert_that(got, equal_to([r for r in sent if r.offset < 3]))  # the first 3 records of each partition


def test_write_then_read_round_trip(bootstrap, new_topic):
    topic = new_topic(partitions=3)
    rows = [KafkaRecord(topic, -1, -1, T0 + i, f"key{i}".encode(), f"val{i}".encode(),
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
    from flowtrain.local.kafka import LocalKafka
    from flowtrain.local.tools import free_port

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


# --- time-based reads, confirmed writes, dead letters, topics, no broker (issues 11 and 16) ------
def test_time_based_start_and_stop_read_exactly_the_records_in_between(bootstrap, new_topic):
    import datetime as dt

    topic = new_topic(partitions=3)
    sent = _produce(bootstrap, topic, 60)  # timestamps T0 + i ms
    at = lambda i: dt.datetime.fromtimestamp((T0 + i) / 1000, tz=dt.timezone.utc)  # noqa: E731
    with TestPipeline(options=pipeline_options("batch")) as p:
        got = p | ReadFromKafka(bootstrap, topic, start=at(10), stop=at(40))
        assert_that(got, equal_to(sent[10:40]))
    with TestPipeline(options=pipeline_options("batch")) as p:  # a start after every record: nothing
        assert_that(p | ReadFromKafka(bootstrap, topic, start=at(100), stop="end"), equal_to([]))


def test_write_dead_letters_to_kafka_one_wire_format_and_oversized_payloads_truncated(bootstrap, new_topic):
    import hashlib

    from kafka import KafkaConsumer, TopicPartition

    from connectors.deadletter import DeadLetter
    from connectors.kafka import WriteDeadLettersToKafka, dead_letter_from_record

    topic = new_topic(partitions=1, config={"max.message.bytes": "200000"})
    huge = b"{" + b"z" * 2_000_000  # a 2 MB event: larger than the topic allows
    letters = [DeadLetter(b"\x00raw", "raw/0/1", "broken JSON"), DeadLetter("text", "raw/0/2", "wrong type"),
               DeadLetter({"distance": -5.0}, "raw/0/3", "impossible distance"),
               DeadLetter(huge, "raw/0/4", "event too large")]
    with TestPipeline(options=pipeline_options("batch")) as p:
        _ = p | beam.Create(letters) | WriteDeadLettersToKafka(bootstrap, topic)
    c = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, consumer_timeout_ms=3000)
    c.assign([TopicPartition(topic, 0)])
    c.seek_to_beginning()
    back = {}
    for m in c:
        letter, info = dead_letter_from_record(m.value, m.headers)
        assert m.key == letter.source.encode()
        back[letter.source] = (letter, info, m.value)
    c.close()
    assert set(back) == {d.source for d in letters}
    for d in letters[:3]:
        assert back[d.source][:2] == (d, {})
    letter, info, value = back["raw/0/4"]
    assert letter.reason == "event too large" and huge.startswith(value) and 150_000 < len(value) < 200_000
    assert info == {"truncated": True, "size": len(huge), "sha256": hashlib.sha256(huge).hexdigest()}


def test_delivery_confirms_every_send_and_names_error_topic_and_size(bootstrap, new_topic):
    from connectors.kafka import KafkaDelivery, KafkaWriteError, close_client, new_producer

    topic = new_topic(partitions=1, config={"max.message.bytes": "20000"})
    producer = new_producer(bootstrap)
    try:
        delivery = KafkaDelivery(producer, what="test")  # not told the topic's limit: the broker rejects
        delivery.send(topic, b"ok", key=b"k")
        assert delivery.confirm() == 1
        for i in range(3):
            delivery.send(topic, b"x" * 50_000 if i == 1 else b"small", key=b"k")
        with pytest.raises(KafkaWriteError, match=rf"50,0\d\d bytes for topic '{topic}'.*MessageSizeTooLargeError"):
            delivery.confirm()
        told = KafkaDelivery(producer, what="test", max_message_bytes={topic: 20_000})
        with pytest.raises(KafkaWriteError, match=rf"does not fit topic '{topic}' \(max.message.bytes 20,000\)"):
            told.send(topic, b"x" * 50_000)
    finally:
        close_client(producer)


def test_write_to_kafka_fails_the_bundle_on_a_record_the_topic_cannot_take(bootstrap, new_topic):
    topic = new_topic(partitions=1, config={"max.message.bytes": "20000"})
    with pytest.raises(Exception, match=rf"50,0\d\d bytes does not fit topic '{topic}'"):
        with TestPipeline(options=pipeline_options("batch")) as p:
            _ = p | beam.Create([(b"k", b"small"), (b"k", b"x" * 50_000)]) | WriteToKafka(bootstrap, topic)


def test_ensure_topic_replication_factor_defaults_to_the_brokers_and_is_an_option(bootstrap):
    from kafka import KafkaAdminClient

    from connectors.kafka import ensure_topic

    name = f"rf-{uuid.uuid4().hex[:8]}"
    ensure_topic(bootstrap, name, partitions=2, config={"max.message.bytes": "300000"})  # min(3, 1 broker) = 1
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        (info,) = admin.describe_topics([name])
        assert len(info["partitions"]) == 2 and {len(p["replica_nodes"]) for p in info["partitions"]} == {1}
    finally:
        admin.close()
    with pytest.raises(ValueError, match=r"replication factor 3 cannot be reached.*1 broker.*--replication-factor"):
        ensure_topic(bootstrap, f"rf-{uuid.uuid4().hex[:8]}", replication_factor=3)
    with pytest.raises(ValueError, match="replication_factor=0"):
        ensure_topic(bootstrap, name, replication_factor=0)


def test_read_from_kafka_without_a_broker_fails_fast_naming_the_servers():
    from connectors.kafka import KafkaUnavailable
    from flowtrain.local.tools import free_port

    nobody = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(KafkaUnavailable, match=rf"no Kafka broker answered at {nobody} within 2 s.*check"):
        with TestPipeline(options=pipeline_options("batch")) as p:
            _ = p | ReadFromKafka(nobody, "t", stop="end", connect_timeout_s=2)
    assert time.monotonic() - t0 < 20
    t0 = time.monotonic()  # a launcher that does not check: the read itself fails within its bound
    with pytest.raises(Exception, match=rf"no Kafka broker answered at {nobody} within 2 s"):
        with TestPipeline(options=pipeline_options("batch")) as p:
            _ = p | ReadFromKafka(nobody, "t", stop="end", connect_timeout_s=2, check_brokers_at_build=False)
    assert time.monotonic() - t0 < 30

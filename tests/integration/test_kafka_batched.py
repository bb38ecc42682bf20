"""ReadFromKafka(batch_records=N) and ReadFromKafka(client="confluent") against the session's real broker."""
from __future__ import annotations

import datetime as dt
import time
import uuid

import apache_beam as beam
import pytest
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to
from kafka import KafkaProducer

from connectors.kafka import KafkaRecord, ReadFromKafka
from flowtrain.local.runners import pipeline_options

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(180)]
# The confluent tests fail, never skip, without confluent-kafka: it is in the test extra
# (`make test` installs it; by hand: pip install 'flowtrain[test]').
T0 = (int(time.time()) - 3600) * 1000  # an hour ago: inside the broker's retention


def _produce(bootstrap, topic, n, partitions=3, start=0):
    """n records, record i on partition i % partitions stamped T0 + i, with a header; returns them."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    futures = [(i, producer.send(topic, key=f"k{i}".encode(), value=f"v{i}".encode(),
                                 headers=[("i", str(i).encode())], partition=i % partitions,
                                 timestamp_ms=T0 + i)) for i in range(start, start + n)]
    sent = []
    for i, future in futures:
        md = future.get(timeout=30)
        sent.append(KafkaRecord(topic, md.partition, md.offset, T0 + i, f"k{i}".encode(), f"v{i}".encode(),
                                (("i", str(i).encode()),)))
    producer.close()
    return sent


def _chunk_facts(chunk, ts=beam.DoFn.TimestampParam):
    """What must hold of every emitted chunk, as one comparable tuple per chunk."""
    return (type(chunk).__name__, len({(r.topic, r.partition) for r in chunk}),
            [r.offset for r in chunk] == sorted(r.offset for r in chunk),
            ts.micros // 1000 == max(r.timestamp for r in chunk), len(chunk))


def _check_chunks(chunks, size: int, label: str):
    facts = chunks | f"{label}Facts" >> beam.Map(_chunk_facts)
    bad = facts | f"{label}Bad" >> beam.Filter(lambda f: f[:4] != ("list", 1, True, True) or not 1 <= f[4] <= size)
    assert_that(bad, equal_to([]), label=f"{label}ChunkShape")


def test_batched_read_returns_every_record_once_in_chunks_of_one_partition(bootstrap, new_topic):
    topic = new_topic(partitions=3)
    sent = _produce(bootstrap, topic, 200)
    with TestPipeline(options=pipeline_options("batch")) as p:
        chunks = p | ReadFromKafka(bootstrap, topic, stop="end", batch_records=16)
        assert_that(chunks | beam.FlatMap(lambda c: c), equal_to(sent))
        _check_chunks(chunks, 16, "end")
        # A chunk carries its partition's records in offset order: per partition, the chunks'
        # offsets together are exactly 0..66 with no repeat (every record once).
        per_partition = (chunks | beam.Map(lambda c: (c[0].partition, [r.offset for r in c]))
                         | beam.CombinePerKey(lambda lists: sorted(o for offs in lists for o in offs)))
        assert_that(per_partition, equal_to([(p_, list(range(len([r for r in sent if r.partition == p_]))))
                                             for p_ in range(3)]), label="offsets")


def test_batched_read_with_stop_count_never_crosses_the_stop(bootstrap, new_topic):
    topic = new_topic(partitions=2)
    sent = _produce(bootstrap, topic, 40, partitions=2)
    with TestPipeline(options=pipeline_options("batch")) as p:
        # 7 offsets per partition in chunks of at most 3; max_read_s=0 defers (checkpoints) after
        # every chunk, so the read also resumes from each checkpoint.
        chunks = p | ReadFromKafka(bootstrap, topic, stop=7, batch_records=3, max_read_s=0)
        assert_that(chunks | beam.FlatMap(lambda c: c), equal_to([r for r in sent if r.offset < 7]))
        assert_that(chunks | beam.Map(lambda c: max(r.offset for r in c)) | beam.Filter(lambda o: o >= 7),
                    equal_to([]), label="beyond")
        _check_chunks(chunks, 3, "n")


def test_a_read_that_hands_back_at_every_short_fetch_reads_every_record_once(bootstrap, new_topic):
    """live_read_s=0: every fetch that comes back short of a chunk (the partition caught up) ends the call and the
    read resumes from its checkpoint: the same records, each once, in offset order per partition."""
    topic = new_topic(partitions=3)
    sent = _produce(bootstrap, topic, 60)
    with TestPipeline(options=pipeline_options("batch")) as p:
        chunks = p | ReadFromKafka(bootstrap, topic, stop="end", batch_records=7, live_read_s=0)
        assert_that(chunks | beam.FlatMap(lambda c: c), equal_to(sent))
        _check_chunks(chunks, 7, "end")


def test_a_negative_live_read_is_rejected_naming_the_option():
    with pytest.raises(ValueError, match=r"live_read_s=-1.*>= 0"):
        ReadFromKafka("127.0.0.1:1", "t", live_read_s=-1, check_brokers_at_build=False)


def test_batched_and_per_record_reads_stop_at_a_time_inside_a_chunk(bootstrap, new_topic):
    topic = new_topic(partitions=3)
    sent = _produce(bootstrap, topic, 90)
    at = dt.datetime.fromtimestamp((T0 + 50) / 1000, tz=dt.timezone.utc)
    with TestPipeline(options=pipeline_options("batch")) as p:
        batched = p | "Batched" >> ReadFromKafka(bootstrap, topic, stop=at, batch_records=1000)
        assert_that(batched | beam.FlatMap(lambda c: c), equal_to(sent[:50]))
        single = p | "PerRecord" >> ReadFromKafka(bootstrap, topic, stop=at)
        assert_that(single, equal_to(sent[:50]), label="per-record")


@pytest.mark.parametrize("bad", [0, -5, 2.5, True, "100"])
def test_bad_batch_records_is_rejected_naming_the_option(bad):
    with pytest.raises(ValueError, match=r"batch_records=.*positive int"):
        ReadFromKafka("127.0.0.1:1", "t", stop="end", batch_records=bad, check_brokers_at_build=False)


def test_unknown_client_is_rejected_naming_the_choices():
    with pytest.raises(ValueError, match=r"client='rdkafka'.*'kafka-python', 'confluent'"):
        ReadFromKafka("127.0.0.1:1", "t", client="rdkafka", check_brokers_at_build=False)


def test_batched_read_commits_offsets_for_the_group(bootstrap, new_topic):
    topic = new_topic(partitions=3)
    group = f"g-{uuid.uuid4().hex[:6]}"
    first = _produce(bootstrap, topic, 30)
    with TestPipeline(options=pipeline_options("batch")) as p:
        chunks = p | ReadFromKafka(bootstrap, topic, start="committed", stop="end", group_id=group,
                                   batch_records=4)
        assert_that(chunks | beam.FlatMap(lambda c: c), equal_to(first))
    newer = _produce(bootstrap, topic, 12, start=30)
    with TestPipeline(options=pipeline_options("batch")) as p:
        assert_that(p | ReadFromKafka(bootstrap, topic, start="committed", stop="end", group_id=group),
                    equal_to(newer))


def test_confluent_client_reads_the_same_records_as_kafka_python(bootstrap, new_topic):
    topic = new_topic(partitions=3)
    sent = _produce(bootstrap, topic, 150)
    with TestPipeline(options=pipeline_options("batch")) as p:
        python = p | "Python" >> ReadFromKafka(bootstrap, topic, stop="end")
        # A librdkafka property (dotted name) reaches the confluent consumers, not kafka-python's.
        confluent = p | "Confluent" >> ReadFromKafka(bootstrap, topic, stop="end", client="confluent",
                                                     consumer_config={"socket.keepalive.enable": True,
                                                                      "client_id": "ft-test"})
        chunks = p | "ConfluentBatched" >> ReadFromKafka(bootstrap, topic, stop=20, batch_records=8,
                                                         client="confluent", max_read_s=0)
        assert_that(python, equal_to(sent), label="python")
        assert_that(confluent, equal_to(sent), label="confluent")
        assert_that(confluent | beam.Map(lambda r: type(r).__name__) | beam.Distinct(),
                    equal_to(["KafkaRecord"]), label="type")
        assert_that(chunks | beam.FlatMap(lambda c: c), equal_to([r for r in sent if r.offset < 20]),
                    label="batched")
        _check_chunks(chunks, 8, "confluent")


def test_confluent_client_commits_and_resumes_from_committed_offsets(bootstrap, new_topic):
    topic = new_topic(partitions=2)
    group = f"g-{uuid.uuid4().hex[:6]}"
    first = _produce(bootstrap, topic, 20, partitions=2)
    with TestPipeline(options=pipeline_options("batch")) as p:
        assert_that(p | ReadFromKafka(bootstrap, topic, start="committed", stop="end", group_id=group,
                                      client="confluent", batch_records=5) | beam.FlatMap(lambda c: c),
                    equal_to(first))
    newer = _produce(bootstrap, topic, 6, partitions=2, start=20)
    with TestPipeline(options=pipeline_options("batch")) as p:
        assert_that(p | ReadFromKafka(bootstrap, topic, start="committed", stop="end", group_id=group,
                                      client="confluent"), equal_to(newer))


def test_confluent_client_rejects_a_consumer_option_it_cannot_translate():
    with pytest.raises(ValueError, match=r"consumer_config option 'metric_reporters'"):
        ReadFromKafka("127.0.0.1:1", "t", client="confluent", consumer_config={"metric_reporters": []},
                      check_brokers_at_build=False)


class _Collect(beam.DoFn):
    seen: list = []

    def process(self, element, w=beam.DoFn.WindowParam):
        _Collect.seen.append((w.start.micros // 1_000_000, element))


@pytest.mark.streaming
@pytest.mark.parametrize("client", ["kafka-python", "confluent"])
def test_unbounded_batched_read_on_prism_sees_new_records_in_windows(bootstrap, new_topic, client):
    """An unbounded batched read defers and resumes (checkpoints) on Prism: every produced record
    arrives once, and event-time windows fire."""
    from apache_beam.transforms import window

    topic = new_topic(partitions=2)
    _Collect.seen = []
    p = beam.Pipeline(options=pipeline_options("streaming"))
    (p | ReadFromKafka(bootstrap, topic, poll_interval_s=0.2, batch_records=7, client=client)
       | beam.FlatMap(lambda chunk: [(r.partition, r.offset) for r in chunk])
       | beam.WindowInto(window.FixedWindows(1))
       | beam.CombineGlobally(beam.combiners.ToListCombineFn()).without_defaults()
       | beam.ParDo(_Collect()))
    result = p.run()
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    produced = 0
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if produced < 60:
                for _ in range(10):  # records stamped "now": windows close as the watermark passes
                    producer.send(topic, value=b"x", partition=produced % 2)
                    produced += 1
                producer.flush()
            got = [o for _, offs in _Collect.seen for o in offs]
            if len(got) >= produced == 60 and len({w for w, _ in _Collect.seen}) >= 2:
                break
            time.sleep(0.5)
        assert str(result.state).endswith("RUNNING")
    finally:
        producer.close()
        result.cancel()
    got = sorted(o for _, offs in _Collect.seen for o in offs)
    assert got == sorted((i % 2, i // 2) for i in range(60)), f"{client}: {len(got)} of 60 records, or repeats"
    assert len({w for w, _ in _Collect.seen}) >= 2, f"windows fired: {_Collect.seen}"


def test_building_a_read_prints_no_beam_yield_and_return_warning(bootstrap, new_topic, caplog):
    """Beam warns 'Using yield and return in the process method' for a `return  # comment` line in a
    generator; the reader's DoFns must not trigger it (users saw it once per pipeline)."""
    import logging

    import apache_beam as beam

    from connectors.kafka import ReadFromKafka

    topic = new_topic(partitions=1)
    with caplog.at_level(logging.WARNING):
        p = beam.Pipeline()
        for kwargs in ({}, {"batch_records": 10}, {"group_id": "g", "commit_offsets": True}):
            _ = p | f"Read{len(kwargs)}{sorted(kwargs)}" >> ReadFromKafka(bootstrap, topic, stop="end", **kwargs)
    assert not [r for r in caplog.records if "yield and return" in r.getMessage()]

"""Issue 30 item 4: replay runs from Python (``flowtrain.replay``) with the producers of ``connectors.kafka.produce``,
both clients, against a real broker: every event acknowledged and on the topic."""
from __future__ import annotations

import pytest
from kafka import KafkaConsumer, TopicPartition

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(180)]


def _records(bootstrap: str, topic: str) -> list:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, consumer_timeout_ms=3000)
    try:
        consumer.assign([TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic)])
        consumer.seek_to_beginning()
        return list(consumer)
    finally:
        consumer.close()


@pytest.mark.parametrize("client", ["kafka-python", "confluent"])
def test_item4_replay_from_python_sends_every_event_with_either_producer(client, bootstrap, new_topic, tmp_path):
    import flowtrain
    from flowtrain.commands.stream.options import ReplayJob

    events = tmp_path / "events.csv"
    events.write_text("t,k,x,y\n" + "".join(f"{i},k{i % 4},{i * 0.5},{i % 2}\n" for i in range(60)))
    topic = new_topic(2)
    counts = flowtrain.replay(ReplayJob(input=(str(events),), bootstrap=bootstrap, topic=topic, key_column="k",
                                        malformed=0.1, seed=3), client=client)
    records = _records(bootstrap, topic)
    assert counts["events"] == 60 == len(records)
    assert sum(v for k, v in counts.items() if k not in ("events", "unlabelled", "seconds")) > 0  # some malformed
    assert {r.key for r in records} == {b"k0", b"k1", b"k2", b"k3"}

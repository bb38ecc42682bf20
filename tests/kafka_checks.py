"""Kafka checks the tests share, read from the real broker."""
from __future__ import annotations


def committed(bootstrap: str, topic: str, group: str) -> tuple[int, int]:
    """(offsets ``group`` has committed on ``topic``, the topic's end offsets), each summed over partitions."""
    from kafka import KafkaConsumer, TopicPartition

    c = KafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    try:
        tps = [TopicPartition(topic, p) for p in c.partitions_for_topic(topic)]
        return sum(c.committed(tp) or 0 for tp in tps), sum(c.end_offsets(tps).values())
    finally:
        c.close()

"""Pure-Python Kafka I/O for Apache Beam, and the Kafka clients flowtrain's jobs use.

Modules by job:

- ``clients``: making, tracking, closing and retrying kafka-python consumers and producers;
- ``admin``: is a broker there, create a topic, a topic's ``max.message.bytes``;
- ``read``: ``ReadFromKafka`` (a splittable DoFn per partition) and its offset commits;
- ``fetch``: one partition's fetcher behind the reader (kafka-python or confluent-kafka);
- ``offsets``: the arithmetic of start/stop specs and offset ranges (no client);
- ``record``: ``KafkaRecord`` and its Beam coder;
- ``delivery``: ``KafkaDelivery``, sending records and confirming every one;
- ``produce``: senders of many records (kafka-python or confluent-kafka), every one confirmed;
- ``write``: ``WriteToKafka``;
- ``deadletters``: the one Kafka wire format of a dead letter, ``WriteDeadLettersToKafka``.

The names below are the package's API: ``from connectors.kafka import ReadFromKafka``.
"""
from connectors.kafka.admin import (
    brokers_unreachable,
    check_brokers,
    ensure_topic,
    topic_config,
    topic_max_message_bytes,
)
from connectors.kafka.clients import (
    DEFAULT_CONNECT_TIMEOUT_S,
    PRODUCER_DEFAULTS,
    KafkaUnavailable,
    ReconnectSummary,
    close_all_clients,
    close_client,
    describe_error,
    is_retriable,
    new_consumer,
    new_producer,
    retry_kafka,
    summarize_reconnects,
    topic_end_offsets,
    topic_partitions,
    track_client,
    unavailable_message,
    wait_for_partitions,
)
from connectors.kafka.deadletters import WriteDeadLettersToKafka, dead_letter_from_record, dead_letter_record
from connectors.kafka.delivery import KafkaDelivery, KafkaWriteError, record_size, value_budget
from connectors.kafka.fetch import CLIENTS, KafkaReadError, confluent_config
from connectors.kafka.offsets import PartitionRead
from connectors.kafka.produce import ProduceError, new_sender
from connectors.kafka.read import ReadFromKafka
from connectors.kafka.record import KafkaRecord, KafkaRecordCoder
from connectors.kafka.restriction import PartitionRange
from connectors.kafka.target import KafkaTarget, Topics
from connectors.kafka.write import WriteToKafka

__all__ = ["KafkaRecord", "KafkaRecordCoder", "ReadFromKafka", "WriteToKafka", "KafkaWriteError", "KafkaUnavailable",
           "KafkaReadError", "KafkaDelivery", "PartitionRead", "PartitionRange", "CLIENTS", "close_all_clients",
           "ensure_topic", "topic_config", "retry_kafka", "check_brokers", "topic_max_message_bytes", "record_size",
           "value_budget", "new_producer", "new_consumer", "track_client", "close_client", "confluent_config",
           "DEFAULT_CONNECT_TIMEOUT_S", "PRODUCER_DEFAULTS", "unavailable_message", "describe_error", "is_retriable",
           "ReconnectSummary", "summarize_reconnects", "brokers_unreachable", "ProduceError", "new_sender",
           "topic_partitions", "topic_end_offsets", "wait_for_partitions", "WriteDeadLettersToKafka", "dead_letter_record",
           "dead_letter_from_record", "KafkaTarget", "Topics"]

"""The project's local Apache Kafka broker (KRaft, from the Apache jars on Maven Central)."""
from flowtrain.local.kafka.broker import (
    KAFKA_VERSION,
    BrokerError,
    LocalKafka,
    answers_metadata,
    ensure_jars,
)

__all__ = ["KAFKA_VERSION", "BrokerError", "LocalKafka", "answers_metadata", "ensure_jars"]

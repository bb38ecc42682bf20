"""Shared fixtures: a real Kafka broker for the whole session, started from the Apache jars.

Infrastructure tests fail (never skip) when the broker or the streaming runner cannot be had:
a skipped infrastructure test would let CI go green while testing nothing.
"""
from __future__ import annotations

import uuid

import pytest

from flowtrain.local.kafka import LocalKafka, free_port


@pytest.fixture(scope="session")
def say(request):
    """Write a line to the test log itself (not captured): what infrastructure really ran."""
    capture = request.config.pluginmanager.getplugin("capturemanager")

    def write(line: str) -> None:
        with capture.global_and_fixture_disabled():
            print(line, flush=True)

    return write


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory, say) -> LocalKafka:
    broker = LocalKafka(port=free_port(below_ephemeral=True), data_dir=tmp_path_factory.mktemp("kafka"))
    status = broker.start(timeout_s=120, quiet=True)
    say(f"\nkafka: broker {broker.version} started from jars on {broker.bootstrap} in "
        f"{status.get('start_seconds', 0):.1f} s (pid {status['pid']}, log {broker.log_path})")
    try:
        yield broker
    finally:
        # Close clients of streaming DoFns that a cancelled runner never tore down before the
        # broker goes away, so they do not poll a dead broker until the process exits.
        import logging
        import time

        from connectors.kafka import close_all_clients

        close_all_clients()
        time.sleep(1.5)  # an in-flight bundle of a cancelled streaming job may open one more
        close_all_clients()
        broker.stop(timeout_s=20)
        logging.getLogger("kafka").setLevel(logging.CRITICAL)


@pytest.fixture(scope="session")
def bootstrap(kafka_broker) -> str:
    return kafka_broker.bootstrap


@pytest.fixture
def new_topic(bootstrap):
    """Create a fresh topic with the given partition count; returns its name."""
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    created = []

    def make(partitions: int = 3, prefix: str = "t", config: dict | None = None) -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1,
                                      topic_configs=config or {})])
        created.append(name)
        return name

    yield make
    admin.close()


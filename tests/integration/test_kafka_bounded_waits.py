"""Waits on a topic's partitions are bounded (h6 item 2): kafka-python's ``partitions_for_topic`` waits for the
brokers' metadata without a bound, so with the brokers gone (the client already knows their API version, as
every client after the first in a process does) the status line's ``raw_lag``, the reader's partition lookup and
the trainer's raw-topic ends never returned. Now each gives up within its bound with a line naming the brokers.

No broker here: a port nothing listens on is a broker that does not answer. Each call runs on a helper thread
that the test joins with a generous bound (the old code never returned at all)."""
from __future__ import annotations

import types

import pytest

from connectors.kafka import KafkaUnavailable, close_client, new_consumer, topic_end_offsets, topic_partitions
from tests.silent_broker import KNOWN_VERSION, dead_bootstrap, finishes

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("ask", [topic_partitions, topic_end_offsets])  # the end offsets' one helper (issue 48)
def test_a_topics_partitions_and_end_offsets_give_up_naming_the_brokers_and_the_topic(ask):
    bootstrap = dead_bootstrap()
    consumer = new_consumer(bootstrap, KNOWN_VERSION, group_id=None)
    try:
        done, result = finishes(lambda: ask(consumer, "raw", timeout_s=1.0))
    finally:
        close_client(consumer)
    assert done
    assert isinstance(result, KafkaUnavailable), result
    assert f"no Kafka broker answered at {bootstrap} within 1 s (no metadata for topic 'raw')" in str(result)


def test_raw_lag_is_unknown_when_the_brokers_do_not_answer(monkeypatch):
    from flowtrain.commands.stream import status as stream_status

    monkeypatch.setattr(stream_status, "KAFKA_WAIT_S", 1.0)
    monkeypatch.setattr(stream_status, "kafka_config", lambda *a: dict(KNOWN_VERSION))
    args = types.SimpleNamespace(bootstrap=dead_bootstrap(), kafka_config=None, kafka_config_file=None,
                                 group_id="g", raw_topic="raw")
    done, result = finishes(lambda: stream_status.raw_lag(args))
    assert done and result is None


def test_the_raw_topic_partition_count_is_a_one_line_exit_when_the_brokers_do_not_answer(monkeypatch):
    from flowtrain.commands.stream import inputs as stream_inputs

    monkeypatch.setattr("connectors.kafka.DEFAULT_CONNECT_TIMEOUT_S", 1.0)
    bootstrap = dead_bootstrap()
    done, result = finishes(lambda: stream_inputs.raw_partitions(bootstrap, "raw", dict(KNOWN_VERSION)))
    assert done and isinstance(result, SystemExit), result
    assert str(result).startswith(f"flowtrain stream: the partitions of raw topic 'raw': no Kafka broker answered "
                                  f"at {bootstrap}")


def test_the_trainers_raw_topic_ends_wait_ends_on_a_stop_request(monkeypatch):
    from flowtrain.train.stream import input as stream_input
    from flowtrain.train.stream.input import RawTopicEnds

    monkeypatch.setattr(stream_input, "RAW_ENDS_WAIT_S", 1.0)

    ends = RawTopicEnds(dead_bootstrap(), dict(KNOWN_VERSION), "raw", should_stop=lambda: True)
    done, result = finishes(ends)
    assert done and isinstance(result, KafkaUnavailable), result

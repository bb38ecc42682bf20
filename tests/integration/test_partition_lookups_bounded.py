"""The stream trainer's features-topic partitions and the scorer's updates-topic partitions are asked within a
bound (issue 32 item 3, as h6 item 2 did for the other callers): kafka-python's ``partitions_for_topic`` waits for
the brokers' metadata without one, so with the brokers gone (the client already knows their API version, as every
client after the first in a process does) the trainer's start and the scorer's ``updates_consumer`` never
returned. Now each asks again within its wait and then gives up with one line naming the topic and the brokers
(a ``ValueError``: what their commands print as their one-line error, like a missing topic).

No broker here: a port nothing listens on is a broker that does not answer. Each call runs on a helper thread
that the test joins with a generous bound (the old code never returned at all)."""
from __future__ import annotations

import pytest

from tests.silent_broker import KNOWN_VERSION, dead_bootstrap, finishes

pytestmark = pytest.mark.timeout(180)


def test_stream_trainer_features_partitions_give_up_naming_the_topic_and_the_brokers(monkeypatch):
    from types import SimpleNamespace

    from connectors.kafka import KafkaTarget, Topics, close_client, new_consumer
    from flowtrain.train.stream import source as stream_source
    from flowtrain.train.stream.source import FeatureSource

    monkeypatch.setattr(stream_source, "FEATURES_WAIT_S", 3.0)
    monkeypatch.setattr(stream_source, "PARTITIONS_ASK_S", 1.0)
    bootstrap = dead_bootstrap()
    source = object.__new__(FeatureSource)  # only what the start's partition lookup reads (no dataset, no torch)
    source.cfg = SimpleNamespace(kafka=KafkaTarget(bootstrap, dict(KNOWN_VERSION)), topics=Topics(features="features"))
    source.should_stop = lambda: False
    source.consumer = new_consumer(bootstrap, source.consumer_config(), group_id=None)
    try:
        done, result = finishes(source.features_partitions)
    finally:
        if source.consumer is not None:
            close_client(source.consumer)
    assert done
    assert isinstance(result, ValueError), result
    assert str(result).startswith(f"the partitions of features topic 'features' (asked for 3 s): no Kafka broker answered at "
                                  f"{bootstrap} within 1 s (no metadata for topic 'features')")
    assert source.consumer is None  # the consumer left waiting was closed (its helper's wait ends with it)


def test_stream_trainer_features_partitions_wait_ends_on_a_stop_request(monkeypatch):
    from types import SimpleNamespace

    from connectors.kafka import KafkaTarget, Topics, new_consumer
    from flowtrain.train.stream import source as stream_source
    from flowtrain.train.stream.source import FeatureSource

    monkeypatch.setattr(stream_source, "FEATURES_WAIT_S", 600.0)  # only the stop can end it within the test's bound
    monkeypatch.setattr(stream_source, "PARTITIONS_ASK_S", 1.0)
    bootstrap = dead_bootstrap()
    source = object.__new__(FeatureSource)
    source.cfg = SimpleNamespace(kafka=KafkaTarget(bootstrap, dict(KNOWN_VERSION)), topics=Topics(features="features"))
    source.should_stop = lambda: True
    source.consumer = new_consumer(bootstrap, source.consumer_config(), group_id=None)
    done, result = finishes(source.features_partitions)
    assert done and isinstance(result, ValueError) and "no Kafka broker answered" in str(result), result


def test_scorer_updates_consumer_gives_up_naming_the_topic_and_the_brokers(monkeypatch):
    from pipelines.serving import updates

    monkeypatch.setattr(updates, "PARTITIONS_ASK_S", 1.0)
    bootstrap = dead_bootstrap()
    done, result = finishes(lambda: updates.updates_consumer(bootstrap, "updates", dict(KNOWN_VERSION),
                                                              wait_s=3.0))
    assert done
    assert isinstance(result, ValueError), result
    assert str(result).startswith(f"the partitions of model-updates topic 'updates' (asked for 3 s): no Kafka broker answered at "
                                  f"{bootstrap} within 1 s (no metadata for topic 'updates')")


def test_no_unbounded_partition_lookup_left_in_the_tree():
    """Every caller (the benchmarks too) asks through ``connectors.kafka.topic_partitions``: the one place that
    calls kafka-python's unbounded ``partitions_for_topic``."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    callers = sorted(str(p.relative_to(root)) for pkg in ("bench", "flowtrain", "pipelines", "connectors")
                     for p in (root / pkg).rglob("*.py") if ".partitions_for_topic(" in p.read_text())
    assert callers == ["connectors/kafka/clients.py"]

"""The stream pipeline counts with Beam's Metrics: on Prism, against the real broker,
``PipelineResult.metrics()`` of the running job equals what the topics hold."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import apache_beam as beam
import pytest

from connectors.kafka import KafkaTarget, Topics
from tests.kafka_checks import committed

pytestmark = [pytest.mark.kafka, pytest.mark.streaming, pytest.mark.timeout(420)]
ROOT = Path(__file__).resolve().parent.parent.parent
ENV = dict(os.environ, PYTHONPATH=str(ROOT))


@pytest.fixture(scope="module")
def flights_dataset(shared_data) -> str:
    return shared_data.flights(every=80)


def _counters(result) -> dict:
    from flowtrain.local.runners import beam_counters
    from pipelines.stream.pipeline import METRICS_NAMESPACE

    return beam_counters(result, METRICS_NAMESPACE)


def test_stream_pipeline_beam_metrics_on_prism_equal_the_topics(bootstrap, new_topic, flights_dataset):
    from kafka import KafkaConsumer, TopicPartition

    from connectors.dataset import read_manifest
    from flowtrain.local.paths import cache_root
    from flowtrain.local.runners import cancel_pipeline, pipeline_options
    from pipelines.flights.preset import FLIGHTS
    from pipelines.flights.streaming import FlightReference
    from pipelines.stream.pipeline import StreamConfig, build_stream_pipeline

    raw, features, dead = new_topic(2, "raw"), new_topic(2, "feat"), new_topic(2, "dead")
    replay = subprocess.run([sys.executable, "-m", "flowtrain.cli", "replay", "--bootstrap", bootstrap, "--topic",
                             raw, "--limit", "300", "--malformed", "0.1", "--seed", "2"],
                            capture_output=True, text=True, timeout=180, env=ENV)
    assert replay.returncode == 0, replay.stderr[-2000:]
    manifest = read_manifest(flights_dataset)
    tables = FLIGHTS.demo_inputs(cache_root())
    cfg = StreamConfig(kafka=KafkaTarget(bootstrap, group_id=f"{raw}-group", connect_timeout=30),
                       topics=Topics(raw=raw, features=features, dead_letters=dead), batch_size=50, max_delay=0.5,
                       spec=manifest["spec"],
                       stats=manifest["stats"], enrichment_factory=FlightReference(tables["weather"], tables["planes"]))
    p = beam.Pipeline(options=pipeline_options("streaming"))
    build_stream_pipeline(p, cfg)
    result = p.run()
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and committed(bootstrap, raw, cfg.kafka.group_id)[0] < 300:
            assert "FAILED" not in str(result.state)
            time.sleep(1)
        assert committed(bootstrap, raw, cfg.kafka.group_id) == (300, 300)
        consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
        letters = sum(consumer.end_offsets([TopicPartition(dead, p) for p in range(2)]).values())
        messages = sum(consumer.end_offsets([TopicPartition(features, p) for p in range(2)]).values())
        consumer.close()
        counters = {}
        while time.monotonic() < deadline:  # the runner reports metrics as bundles finish
            counters = _counters(result)
            if counters.get("events") == 300:
                break
            time.sleep(1)
        assert counters.get("events") == 300, counters
        assert counters["dead_letters"] == letters > 0
        assert counters["rows"] + counters["unlabelled"] + counters["dead_letters"] == 300
        assert sum(v for k, v in counters.items() if k.startswith("dead_letters: ")) == letters
        assert counters["feature_messages"] == messages and counters["micro_batches"] >= 2
        assert counters["bytes_read"] > 0
    finally:
        cancel_pipeline(result, p.options)

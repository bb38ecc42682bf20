"""The foundation's real services: a Kafka broker, a streaming Beam runner (Prism), the `flowtrain kafka` CLI."""
from __future__ import annotations

import subprocess
import sys
import time

import apache_beam as beam
import pytest
from apache_beam.transforms import window
from apache_beam.transforms.periodicsequence import PeriodicImpulse
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from flowtrain.local.runners import pipeline_options
from flowtrain.local.tools import free_port


@pytest.mark.kafka
@pytest.mark.timeout(120)
def test_kafka_round_trip_three_partitions_keys_headers(bootstrap, new_topic):
    topic = new_topic(partitions=3)
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    sent = []
    for i in range(30):
        key, value = f"k{i}".encode(), f"v{i}".encode()
        headers = [("i", str(i).encode()), ("src", b"test")]
        md = producer.send(topic, key=key, value=value, headers=headers, partition=i % 3).get(timeout=30)
        sent.append((md.partition, key, value, tuple(headers)))
    producer.close()

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                             enable_auto_commit=False, consumer_timeout_ms=5000)
    consumer.assign([TopicPartition(topic, p) for p in range(3)])
    got = [(r.partition, r.key, r.value, tuple(r.headers)) for r in consumer]
    consumer.close()
    assert sorted(got) == sorted(sent)
    assert {p for p, *_ in got} == {0, 1, 2}


class _RecordWindows(beam.DoFn):
    fired: list = []

    def process(self, element, w=beam.DoFn.WindowParam):
        _RecordWindows.fired.append((w.start, element))


@pytest.mark.streaming
@pytest.mark.timeout(180)
def test_unbounded_pipeline_fires_windows_on_prism_then_is_stopped(say):
    _RecordWindows.fired = []
    options = pipeline_options("streaming")
    assert "prism" in options.get_all_options()["prism_location"]
    p = beam.Pipeline(options=options)
    (p | PeriodicImpulse(fire_interval=0.2, apply_windowing=False)
       | beam.WindowInto(window.FixedWindows(1))
       | beam.Map(lambda _: ("n", 1))
       | beam.CombinePerKey(sum)
       | beam.ParDo(_RecordWindows()))
    result = p.run()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(_RecordWindows.fired) < 2:
        time.sleep(0.25)
    state_while_running = str(result.state)
    result.cancel()
    assert len(_RecordWindows.fired) >= 2, "no two windows fired within 120 s on the streaming runner"
    say(f"\nprism: unbounded PeriodicImpulse pipeline fired {len(_RecordWindows.fired)} windows on "
        f"{options.get_all_options()['prism_location']} while running, then was cancelled")
    assert "RUNNING" in state_while_running
    assert all(count >= 1 for _, (_, count) in _RecordWindows.fired)


@pytest.mark.kafka
@pytest.mark.timeout(180)
def test_kafka_cli_start_status_stop(tmp_path):
    port = free_port()  # the JVM binds seconds later: out of the range where clients take ports
    base = [sys.executable, "-m", "flowtrain.cli", "kafka"]
    opts = ["--port", str(port), "--data-dir", str(tmp_path)]

    def run(action):
        return subprocess.run(base + [action] + opts, capture_output=True, text=True, timeout=150)

    try:
        started = run("start")
        assert started.returncode == 0, started.stderr
        assert "started from jars" in started.stdout
        again = run("start")
        assert again.returncode == 0 and "already running" in again.stdout
        status = run("status")
        assert status.returncode == 0
        assert f"127.0.0.1:{port}" in status.stdout and "answers metadata: True" in status.stdout
        assert str(tmp_path / "broker.log") in status.stdout
    finally:
        stopped = run("stop")
    assert stopped.returncode == 0 and "stopped" in stopped.stdout
    after = run("status")
    assert after.returncode == 3 and "not running" in after.stdout

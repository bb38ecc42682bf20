"""Issue 32 item 4: `flowtrain replay --generate clicks` produces a synthetic click stream (Zipf users and items,
new users arriving, the true click probability kept aside) onto the real broker."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.csv as pacsv
import pytest
from kafka import KafkaConsumer

from pipelines.ids.clicks import COLUMNS, generate_clicks

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))


def test_id_generated_clicks_are_seeded_with_new_users_arriving():
    a, pa_ = generate_clicks(3000, users=200, new_user_rate=0.02, seed=3)
    b, pb = generate_clicks(3000, users=200, new_user_rate=0.02, seed=3)
    assert a.equals(b) and (pa_ == pb).all()
    assert tuple(a.column_names) == COLUMNS and "p_click" not in a.column_names
    users = a.column("user").to_pylist()
    first_seen = {u: i for i, u in reversed(list(enumerate(users)))}
    late = [u for u, i in first_seen.items() if int(u[1:]) >= 200]  # users that arrived during the stream
    assert len(late) > 20 and max(first_seen[u] for u in late) > 1500
    assert 0.05 < a.column("clicked").to_numpy().mean() < 0.95 and ((pa_ > 0) & (pa_ < 1)).all()


def test_id_replay_generate_clicks_to_kafka(bootstrap, new_topic, tmp_path):
    topic = new_topic(partitions=1)
    proc = subprocess.run([sys.executable, "-m", "flowtrain.cli", "replay", "--generate", "clicks", "--limit", "300",
                           "--generate-out", str(tmp_path / "gen"), "--topic", topic, "--bootstrap", bootstrap],
                          capture_output=True, text=True, timeout=240, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "generated 300 click events" in proc.stdout and f"replay: 300 events to {topic}" in proc.stdout
    truth = pacsv.read_csv(tmp_path / "gen" / "truth.csv")
    assert truth.num_rows == 300 and "p_click" in truth.column_names
    consumer = KafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                             consumer_timeout_ms=5000)
    events = [json.loads(m.value) for m in consumer]
    consumer.close()
    assert len(events) == 300
    assert set(events[0]) == set(COLUMNS) and events[0]["user"].startswith("u")

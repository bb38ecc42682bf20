"""`flowtrain stream` on a table that is not the flights demo: a sensor table made here with a 3-class
label, `flowtrain batch` on it, `flowtrain replay --input` with malformed and unlabelled events, the
generic stream pipeline on Prism and the online trainer started from the batch run, killed with
SIGKILL mid-stream and restarted: every labelled valid event trained exactly once, counts reconcile."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
from kafka import KafkaConsumer, TopicPartition

from connectors.arrow import decode_batch
from tests.kafka_checks import committed as _committed
from tests.procs import stop_group as _stop

pytestmark = [pytest.mark.kafka, pytest.mark.streaming, pytest.mark.timeout(600)]
CLI = [sys.executable, "-m", "flowtrain.cli"]
ROWS = 3000
MAX_EVENT_BYTES = 50_000  # the pipeline's bound, and replay's size of its "too large" events


@pytest.fixture(scope="module")
def sensor_run(shared_data):
    return shared_data.sensor_run(rows=ROWS)


def _names():
    tag = uuid.uuid4().hex[:6]
    return {"raw": f"sraw-{tag}", "features": f"sfeat-{tag}", "dead": f"sdead-{tag}", "updates": f"supd-{tag}",
            "group": f"sg-{tag}"}


def _stream_args(bootstrap, names, dataset, out):
    return ["--bootstrap", bootstrap, "--raw-topic", names["raw"], "--features-topic", names["features"],
            "--dead-letter-topic", names["dead"], "--updates-topic", names["updates"], "--group-id", names["group"],
            "--dataset", dataset, "--out", str(out)]


def _read_topic(bootstrap, topic):
    c = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, consumer_timeout_ms=4000)
    tps = [TopicPartition(topic, p) for p in c.partitions_for_topic(topic)]
    c.assign(tps)
    c.seek_to_beginning()
    out = list(c)
    c.close()
    return out


def _pipeline_until_caught_up(bootstrap, names, dataset, out, timeout=240):
    Path(out).mkdir(parents=True, exist_ok=True)
    log = Path(out) / "pipeline-test.log"
    proc = subprocess.Popen(CLI + ["stream", "pipeline", *_stream_args(bootstrap, names, dataset, out),
                                   "--batch-size", "300", "--max-event-bytes", str(MAX_EVENT_BYTES)],
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            done, end = _committed(bootstrap, names["raw"], names["group"])
            if end and done == end:
                break
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(1)
        else:
            raise AssertionError(f"pipeline did not catch up in {timeout} s: {log.read_text()[-2000:]}")
    finally:
        _stop(proc)
    return log.read_text()


def _trainer(bootstrap, names, dataset, out, *extra):
    return subprocess.Popen(CLI + ["stream", "train", *_stream_args(bootstrap, names, dataset, out), "--ledger",
                                   "--checkpoint-every", "2", "--checkpoint-seconds", "1000", "--idle-exit", "4",
                                   *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def _status_step(run) -> int:
    try:
        return json.loads((Path(run) / "trainer-status.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return 0


def test_own_table_replayed_streamed_and_trained_exactly_once_across_a_kill9(bootstrap, sensor_run, tmp_path):
    dataset, run, csv = sensor_run
    names = _names()
    rp = subprocess.run(CLI + ["replay", "--bootstrap", bootstrap, "--topic", names["raw"], "--input", csv,
                               "--dataset", dataset, "--time-column", "ts", "--partitions", "2", "--malformed", "0.05",
                               "--unlabelled", "0.1",
                               "--max-event-bytes", str(MAX_EVENT_BYTES)],
                        capture_output=True, text=True, timeout=180)
    assert rp.returncode == 0, rp.stderr[-2000:]
    printed = rp.stdout.split("malformed: ", 1)[1]
    injected = json.loads(printed.split("; unlabelled: ")[0].replace("'", '"'))
    unlabelled_sent = int(printed.split("; unlabelled: ")[1].replace(",", ""))
    assert set(injected) == {"broken JSON", "missing field(s)", "wrong type", "NaN", "infinite",
                             "too deeply nested JSON", "not UTF-8", "event too large"}, injected
    assert sum(injected.values()) > 0.03 * ROWS and unlabelled_sent > 0.07 * ROWS
    raw = _read_topic(bootstrap, names["raw"])
    assert len(raw) == ROWS
    times = [m.timestamp for m in sorted(raw, key=lambda m: (m.partition, m.offset))]
    assert times[0] == 1709251200000  # the ts column as the Kafka timestamp (2024-03-01T00:00:00Z)
    by_partition = Counter(m.partition for m in raw)
    assert set(by_partition.values()) == {ROWS // 2}  # no key column: round robin

    log = _pipeline_until_caught_up(bootstrap, names, dataset, tmp_path / "p")
    features = [decode_batch(m.value) for m in _read_topic(bootstrap, names["features"])]
    rows = Counter((p, o) for b in features
                   for p, o in zip(b["src_partition"].to_pylist(), b["src_offset"].to_pylist()))
    dead = {}
    for m in _read_topic(bootstrap, names["dead"]):
        headers = dict(m.headers)
        _, p, o = headers["source"].decode().rsplit("/", 2)
        dead[(int(p), int(o))] = headers["reason"].decode()
    events = {(m.partition, m.offset): m.value for m in raw}
    unlabelled = set(events) - set(rows) - set(dead)
    assert set(rows.values()) == {1} and not set(rows) & set(dead)
    # every raw event: a training row, an unlabelled event (no "state": not a dead letter) or a dead letter
    no_pressure = sum(b'"state"' not in events[k] and r.startswith("numeric feature 'pressure'")
                      for k, r in dead.items())
    assert all(b'"state"' not in events[k] for k in unlabelled) and len(unlabelled) + no_pressure == unlabelled_sent
    assert len(rows) + len(unlabelled) + len(dead) == ROWS
    assert f"{ROWS:,} raw events -> {len(rows):,} training rows + {len(unlabelled):,} unlabelled" in log
    reasons = Counter(r.split(":")[0] for r in dead.values())
    assert reasons["broken JSON"] >= injected["broken JSON"]
    for kind in ("missing field(s)", "too deeply nested JSON", "event too large", "not UTF-8", "NaN", "infinite",
                 "wrong type"):  # each injected kind is the kind of its dead letters, by the same name (#45 item 5)
        assert reasons[kind] == injected[kind], (kind, reasons)
    # the batch ETL's own reasons: rows without pressure, as in the batch dead letters
    assert reasons["numeric feature 'pressure' is missing or not a finite number"] > 0
    labels = {y for b in features for y in b["label"].to_pylist()}
    assert labels == {0.0, 1.0, 2.0}  # three classes, encoded as the batch job does

    # the online trainer, from the batch run's weights (the wide-and-deep default), killed mid-stream
    crashed = tmp_path / "crashed"
    proc = _trainer(bootstrap, names, dataset, crashed, "--init-weights", str(run / "model.pt"))
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and _status_step(crashed) < 4 and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
    _stop(proc, signal.SIGKILL)
    final = _trainer(bootstrap, names, dataset, crashed, "--init-weights", str(run / "model.pt"))
    out, _ = final.communicate(timeout=300)
    assert final.returncode == 0, out.decode()[-3000:]
    assert "resumed from" in out.decode()
    ledger = Counter()
    for line in (crashed / "ledger.jsonl").read_text().splitlines():
        r = json.loads(line)
        ledger[(r["partition"], r["offset"])] += 1
    assert set(ledger) == set(rows) and set(ledger.values()) == {1}  # every labelled valid event, once


def test_events_of_another_table_or_no_dataset_stop_the_job_with_one_line(bootstrap, sensor_run, tmp_path):
    dataset, _, _ = sensor_run
    names = _names()
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    for i in range(30):
        producer.send(names["raw"], json.dumps({"carat": 0.3 + i / 100, "cut": "Ideal", "price": 500 + i}).encode())
    producer.flush()
    producer.close()
    out = tmp_path / "foreign"
    proc = subprocess.run(CLI + ["stream", "pipeline", *_stream_args(bootstrap, names, dataset, out)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0
    stopped = [line for line in proc.stderr.splitlines() if line.startswith("stream pipeline: stopped: ")]
    assert len(stopped) == 1, proc.stderr[-3000:]
    assert f"raw topic {names['raw']!r} holds events of another table" in stopped[0]
    assert "carat, cut, price" in stopped[0] and "temp, pressure" in stopped[0]
    assert _committed(bootstrap, names["raw"], names["group"])[0] == 0  # nothing committed: nothing lost

    not_dataset = tmp_path / "nothing"
    not_dataset.mkdir()
    proc = subprocess.run(CLI + ["stream", "pipeline", *_stream_args(bootstrap, names, str(not_dataset), out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "is not a flowtrain dataset" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and str(not_dataset) in proc.stderr, proc.stderr


def test_init_weights_from_a_run_on_another_dataset_is_an_error_naming_both(bootstrap, sensor_run, tmp_path):
    from connectors.dataset_spec import FeatureSpec
    from flowtrain.local.runners import pipeline_options
    from pipelines.tabular.pipeline import run_tabular_etl
    from tests.sensor_data import sensor_rows, write_csv

    dataset, run, _ = sensor_run
    # the same columns, classes and vocabularies, other rows: weights of the same shapes, other statistics
    other_csv = write_csv(tmp_path / "other.csv", sensor_rows(1200, seed=5))
    spec = FeatureSpec(label="state", task="classification", numeric=["temp", "pressure"],
                       optional_numeric=["humidity"], categorical=["site", "machine"], time_column="ts", min_count=2)
    run_tabular_etl([other_csv], spec, dataset_path=str(tmp_path / "other"), dead_letters_path=None,
                    options=pipeline_options("batch"))
    names = _names()
    proc = subprocess.run(CLI + ["stream", "train", *_stream_args(bootstrap, names, str(tmp_path / "other"),
                                                                  tmp_path / "t"),
                                 "--init-weights", str(run / "model.pt"), "--idle-exit", "2"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"flowtrain stream train: --init-weights {run / 'model.pt'}: that run was trained on "
                           f"the dataset {dataset}") and "numeric statistics" in line, proc.stderr


def test_replay_by_event_time_keeps_old_records_or_refuses_a_topic_that_would_delete_them(
        bootstrap, sensor_run, new_topic, tmp_path):
    from kafka import KafkaAdminClient
    from kafka.admin import ConfigResource, ConfigResourceType

    dataset, _, csv = sensor_run
    base = CLI + ["replay", "--bootstrap", bootstrap, "--input", csv, "--dataset", dataset, "--limit", "20",
                  "--time-column", "ts"]
    made = f"sraw-{uuid.uuid4().hex[:6]}"
    rp = subprocess.run(base + ["--topic", made, "--key-column", "site"], capture_output=True, text=True, timeout=120)
    assert rp.returncode == 0, rp.stderr[-2000:]
    records = _read_topic(bootstrap, made)
    assert len(records) == 20 and all(m.key == json.loads(m.value)["site"].encode() for m in records)
    assert all(len({m.partition for m in records if m.key == k}) == 1 for k in {m.key for m in records})
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    found = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, made, {"retention.ms": None})])
    admin.close()
    assert found.get("topic", {})[made]["retention.ms"]["value"] == "-1"  # 2024 events are kept until read
    week = new_topic(2, config={"retention.ms": str(7 * 24 * 3600 * 1000)})
    rp = subprocess.run(base + ["--topic", week], capture_output=True, text=True, timeout=120)
    assert rp.returncode == 2 and len(rp.stderr.strip().splitlines()) == 1, rp.stderr
    assert f"topic {week!r} deletes records older than its retention.ms 604,800,000" in rp.stderr
    assert not _read_topic(bootstrap, week)  # nothing sent

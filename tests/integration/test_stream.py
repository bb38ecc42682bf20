"""The streaming job against a real broker and the real streaming runner (Prism)."""
from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from kafka import KafkaConsumer, TopicPartition

from connectors.arrow import decode_batch
from connectors.kafka import KafkaTarget, Topics
from pipelines.flights.events import MALFORMED_KINDS
from tests.kafka_checks import committed as _committed
from tests.procs import stop_group as _stop

pytestmark = [pytest.mark.kafka, pytest.mark.streaming, pytest.mark.timeout(420)]
CLI = [sys.executable, "-m", "flowtrain.cli"]


@pytest.fixture(scope="module")
def dataset(shared_data) -> str:
    return shared_data.flights(every=80)


def _names():
    tag = uuid.uuid4().hex[:6]
    return {"raw": f"raw-{tag}", "features": f"feat-{tag}", "dead": f"dead-{tag}", "updates": f"upd-{tag}",
            "group": f"g-{tag}"}


def _replay(bootstrap, topic, n, *, partitions=3, malformed=0.0, skip=0):
    proc = subprocess.run(CLI + ["replay", "--bootstrap", bootstrap, "--topic", topic, "--limit", str(n),
                                 "--partitions", str(partitions), "--malformed", str(malformed), "--skip", str(skip)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def _stream_args(bootstrap, names, dataset, out):
    return ["--bootstrap", bootstrap, "--raw-topic", names["raw"], "--features-topic", names["features"],
            "--dead-letter-topic", names["dead"], "--updates-topic", names["updates"], "--group-id", names["group"],
            "--dataset", dataset, "--out", str(out)]


def _start_pipeline(bootstrap, names, dataset, out, extra=()):
    Path(out).mkdir(parents=True, exist_ok=True)
    log = open(Path(out) / "pipeline-test.log", "ab")
    return subprocess.Popen(CLI + ["stream", "pipeline", *_stream_args(bootstrap, names, dataset, out),
                                   "--batch-size", "200", *extra],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _run_pipeline_until_caught_up(bootstrap, names, dataset, out, timeout=180):
    proc = _start_pipeline(bootstrap, names, dataset, out)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            done, end = _committed(bootstrap, names["raw"], names["group"])
            if end and done == end:
                return
            assert proc.poll() is None, (Path(out) / "pipeline-test.log").read_text()[-3000:]
            time.sleep(1)
        raise AssertionError(f"pipeline did not catch up in {timeout} s: {done}/{end}")
    finally:
        _stop(proc)


def _read_topic(bootstrap, topic):
    c = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, consumer_timeout_ms=4000)
    tps = [TopicPartition(topic, p) for p in c.partitions_for_topic(topic)]
    c.assign(tps)
    c.seek_to_beginning()
    out = list(c)
    c.close()
    return out


def test_counts_reconcile_and_every_malformed_kind_is_a_dead_letter(bootstrap, dataset, tmp_path):
    names = _names()
    printed = _replay(bootstrap, names["raw"], 1500, malformed=0.1)
    injected = json.loads(printed.split("malformed: ", 1)[1].strip().replace("'", '"'))
    _run_pipeline_until_caught_up(bootstrap, names, dataset, tmp_path)
    rows = sum(decode_batch(m.value).num_rows for m in _read_topic(bootstrap, names["features"]))
    dead = [dict(m.headers) for m in _read_topic(bootstrap, names["dead"])]
    reasons = [d["reason"].decode() for d in dead]
    totals = _status_totals(tmp_path)
    assert (totals["events"], totals["rows"], totals["dead_letters"]) == (1500, rows, len(dead))
    assert totals["unlabelled"] > 0  # real flights without an arrival delay: scored, not trained, not dead letters
    assert rows + totals["unlabelled"] + len(dead) == 1500  # raw events = training rows + unlabelled + dead letters
    # replay's kinds are the dead letters' own names (issue 45 item 5): a reason is its kind or starts "kind: "
    assert set(injected) == set(MALFORMED_KINDS)
    assert {kind: sum(r == kind or r.startswith(kind + ": ") for r in reasons) for kind in injected} == injected
    assert all(d["source"].decode().startswith(names["raw"] + "/") for d in dead)
    assert not any(r.startswith("cancelled or diverted") for r in reasons)  # label-optional: not dead letters


def _status_totals(out) -> dict:
    from pipelines.stream.status import read_status

    totals: dict = {}
    for data in read_status(str(Path(out) / "pipeline-status.json")):
        for key in ("events", "rows", "unlabelled", "dead_letters"):
            totals[key] = totals.get(key, 0) + data.get(key, 0)
    return totals


def _trainer(bootstrap, names, dataset, out, *extra):
    return subprocess.Popen(CLI + ["stream", "train", *_stream_args(bootstrap, names, dataset, out), "--ledger",
                                   "--checkpoint-every", "3", "--checkpoint-seconds", "1000", "--idle-exit", "3",
                                   *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def _ledger(run) -> dict[tuple[int, int], int]:
    counts: dict = {}
    for line in (Path(run) / "ledger.jsonl").read_text().splitlines():
        r = json.loads(line)
        counts[(r["partition"], r["offset"])] = counts.get((r["partition"], r["offset"]), 0) + 1
    return counts


def _final_model(run):
    from flowtrain.train import checkpoint

    return checkpoint.load(checkpoint.latest(Path(run) / "checkpoints"))["model"]


def _status_step(run) -> int:
    try:
        return json.loads((Path(run) / "trainer-status.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return 0


def test_trainer_killed_repeatedly_trains_every_event_exactly_once(bootstrap, dataset, tmp_path):
    names = _names()
    _replay(bootstrap, names["raw"], 3000, partitions=1)  # one feature partition: a deterministic order
    _run_pipeline_until_caught_up(bootstrap, names, dataset, tmp_path / "p")
    valid = {(int(p), int(o)) for m in _read_topic(bootstrap, names["features"])
             for p, o in zip(decode_batch(m.value)["src_partition"].to_pylist(),
                             decode_batch(m.value)["src_offset"].to_pylist())}
    steps = len(_read_topic(bootstrap, names["features"]))

    clean = _trainer(bootstrap, names, dataset, tmp_path / "clean")
    assert clean.wait(timeout=240) == 0, clean.stdout.read().decode()[-3000:]

    crashed = tmp_path / "crashed"
    rng = random.Random(1)
    for _ in range(3):  # kill -9 at random points, then restart from the checkpoint
        proc = _trainer(bootstrap, names, dataset, crashed)
        target = _status_step(crashed) + rng.randint(2, max(3, steps // 5))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and _status_step(crashed) < target and proc.poll() is None:
            time.sleep(0.05)
        time.sleep(rng.random() * 0.5)
        _stop(proc, signal.SIGKILL)
    final = _trainer(bootstrap, names, dataset, crashed)
    assert final.wait(timeout=240) == 0, final.stdout.read().decode()[-3000:]

    for run in (tmp_path / "clean", crashed):
        counts = _ledger(run)
        assert set(counts) == valid  # nothing lost
        assert set(counts.values()) == {1}  # nothing trained twice
    a, b = _final_model(tmp_path / "clean"), _final_model(crashed)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6


def test_pipeline_kill9_and_replayed_output_are_not_trained_twice(bootstrap, dataset, tmp_path):
    names = _names()
    _replay(bootstrap, names["raw"], 2000, partitions=2)
    proc = _start_pipeline(bootstrap, names, dataset, tmp_path)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and _committed(bootstrap, names["raw"], names["group"])[0] == 0:
        time.sleep(0.2)
    _stop(proc, signal.SIGKILL)  # mid-stream, outputs possibly written but not committed
    _replay(bootstrap, names["raw"], 1000, partitions=2, skip=2000)  # more events while it is down
    # Rewind the group to the start of each partition: the restarted pipeline writes everything
    # again, as it would after a crash between producing and committing.
    from kafka import OffsetAndMetadata

    c = KafkaConsumer(bootstrap_servers=bootstrap, group_id=names["group"], enable_auto_commit=False)
    c.commit({TopicPartition(names["raw"], p): OffsetAndMetadata(0, "", -1) for p in range(2)})
    c.close()
    _run_pipeline_until_caught_up(bootstrap, names, dataset, tmp_path)
    messages = _read_topic(bootstrap, names["features"])
    sources = [(p, o) for m in messages for p, o in zip(decode_batch(m.value)["src_partition"].to_pylist(),
                                                           decode_batch(m.value)["src_offset"].to_pylist())]
    assert len(sources) > len(set(sources))  # the features topic holds duplicates
    run = tmp_path / "train"
    trainer = _trainer(bootstrap, names, dataset, run)
    out, _ = trainer.communicate(timeout=240)
    assert trainer.returncode == 0, out.decode()[-3000:]
    counts = _ledger(run)
    assert set(counts) == set(sources) and set(counts.values()) == {1}
    assert f"{len(sources) - len(set(sources)):,} duplicate rows dropped" in out.decode()


def test_broker_stopped_and_restarted_mid_stream_loses_nothing(dataset, tmp_path):
    from flowtrain.local.kafka import LocalKafka
    from flowtrain.local.tools import free_port

    broker = LocalKafka(port=free_port(), data_dir=tmp_path / "kafka")
    broker.start(timeout_s=120, quiet=True)
    bootstrap = broker.bootstrap
    names = _names()
    run = tmp_path / "run"
    procs = []
    try:
        _replay(bootstrap, names["raw"], 1500, partitions=2)
        procs.append(_start_pipeline(bootstrap, names, dataset, tmp_path / "p"))
        procs.append(subprocess.Popen(
            CLI + ["stream", "train", *_stream_args(bootstrap, names, dataset, run), "--ledger",
                   "--checkpoint-seconds", "1"],
            stdout=open(tmp_path / "trainer.log", "ab"), stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and _status_step(run) < 2:
            time.sleep(0.2)
        broker.stop(quiet=True)  # mid-stream
        time.sleep(5)
        broker.start(timeout_s=120, quiet=True)
        _replay(bootstrap, names["raw"], 1500, partitions=2, skip=1500)
        deadline = time.monotonic() + 240
        valid = set()
        while time.monotonic() < deadline:
            done, end = _committed(bootstrap, names["raw"], names["group"])
            if end == 3000 and done == end:
                valid = {(int(p), int(o)) for m in _read_topic(bootstrap, names["features"])
                         for p, o in zip(decode_batch(m.value)["src_partition"].to_pylist(),
                                         decode_batch(m.value)["src_offset"].to_pylist())}
                if (run / "ledger.jsonl").exists() and set(_ledger(run)) == valid:
                    break
            assert procs[0].poll() is None, _tail(tmp_path / "p" / "pipeline-test.log")
            assert procs[1].poll() is None, _tail(tmp_path / "trainer.log")
            time.sleep(1)
        counts = _ledger(run)
        assert len(valid) > 2500 and set(counts) == valid and set(counts.values()) == {1}
    finally:
        for p in procs:
            _stop(p)
        from connectors.kafka import close_all_clients

        close_all_clients()
        broker.stop(quiet=True)


def _tail(path: Path, n: int = 40) -> str:
    """The log's last lines, without kafka-python's reconnect chatter."""
    lines = [line for line in Path(path).read_text(errors="replace").splitlines()
             if "kafka.cluster" not in line and "kafka.net" not in line and "kafka.consumer.fetcher" not in line]
    return "\n".join(lines[-n:])


# --- nothing lost: sizes, poison events, undeliverable sends, no broker (issue 16) -------------
def _events(n: int, skip: int = 0) -> list[bytes]:
    """The first ``n`` flights after ``skip`` as JSON events, as `flowtrain replay` makes them."""
    import itertools

    import pyarrow.parquet as pq

    from flowtrain.local.paths import cache_root
    from pipelines.flights.events import events_from_table
    from pipelines.flights.preset import FLIGHTS

    flights = pq.read_table(FLIGHTS.demo_inputs(cache_root())["flights"]).slice(0, skip + n + 2000)
    return [json.dumps(e).encode() for e in itertools.islice(events_from_table(flights), skip, skip + n)]


def _produce(bootstrap, topic, values, *, partitions):
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=20, max_request_size=16 << 20)
    futures = [producer.send(topic, value=v, partition=i % partitions) for i, v in enumerate(values)]
    producer.flush()
    for f in futures:
        f.get(timeout=30)
    producer.close()


def _delivered(bootstrap, names) -> tuple[list, dict]:
    """Feature rows' (partition, offset) sources, and dead letters by (partition, offset)."""
    from connectors.kafka import dead_letter_from_record

    rows = [(int(p), int(o)) for m in _read_topic(bootstrap, names["features"])
            for p, o in zip(decode_batch(m.value)["src_partition"].to_pylist(),
                            decode_batch(m.value)["src_offset"].to_pylist())]
    dead = {}
    for m in _read_topic(bootstrap, names["dead"]):
        letter, info = dead_letter_from_record(m.value, m.headers)
        _, p, o = letter.source.rsplit("/", 2)
        dead[(int(p), int(o))] = (letter, info, m.value)
    return rows, dead


def _topics(new_topic, names, *, raw_partitions, features_max=None, dead_max=None):
    names["raw"] = new_topic(raw_partitions, "raw", {"max.message.bytes": str(8 << 20)})
    names["features"] = new_topic(raw_partitions, "feat", {"max.message.bytes": str(features_max)} if features_max else None)
    names["dead"] = new_topic(raw_partitions, "dead", {"max.message.bytes": str(dead_max)} if dead_max else None)


def test_large_micro_batches_and_poison_events_every_event_is_a_row_or_a_dead_letter(
        bootstrap, dataset, tmp_path, new_topic):
    """--batch-size 10000 against a features topic that takes ~60 KB per message (a batch is far
    larger: the old pipeline lost it and committed), and poison events next to valid ones."""
    import hashlib

    names = _names()
    _topics(new_topic, names, raw_partitions=2, features_max=60_000, dead_max=300_000)
    valid = _events(6000)
    broken_2mb = b'{"carrier": "' + b"x" * 2_000_000  # broken JSON, larger than the dead-letter topic takes
    event = json.loads(valid[0])
    poison = {
        "broken_2mb": broken_2mb,
        "deep": ('{"a":' * 100_000 + "1" + "}" * 100_000).encode(),  # RecursionError in the old pipeline
        "overflow": json.dumps({**event, "year": 10 ** 30}).encode(),  # OverflowError in the old pipeline
        "not_utf8": valid[1].replace(b'"carrier": "', b'"carrier": "\xff\xfe'),
        "string_5mb": json.dumps({**event, "carrier": "x" * 5_000_000}).encode(),
    }
    _produce(bootstrap, names["raw"], valid[:3000] + list(poison.values()) + valid[3000:], partitions=2)
    total = len(valid) + len(poison)
    proc = _start_pipeline(bootstrap, names, dataset, tmp_path,
                           ["--batch-size", "10000", "--max-delay", "30", "--max-event-bytes", str(4 << 20)])
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and _committed(bootstrap, names["raw"], names["group"]) != (total, total):
            assert proc.poll() is None, _tail(tmp_path / "pipeline-test.log")
            time.sleep(1)
    finally:
        _stop(proc)
    log = (tmp_path / "pipeline-test.log").read_text(errors="replace")
    assert _committed(bootstrap, names["raw"], names["group"]) == (total, total), _tail(tmp_path / "pipeline-test.log")
    rows, dead = _delivered(bootstrap, names)
    everything = {(i % 2, i // 2) for i in range(total)}  # produced round-robin over 2 partitions
    assert len(rows) == len(set(rows)) and not set(rows) & set(dead)
    unlabelled = everything - set(rows) - set(dead)  # each raw event: a feature row, unlabelled or a dead letter
    produced = valid[:3000] + list(poison.values()) + valid[3000:]
    assert unlabelled and all(json.loads(produced[o * 2 + p])["arr_delay"] is None for p, o in unlabelled)
    assert _status_totals(tmp_path) == {"events": total, "rows": len(rows), "unlabelled": len(unlabelled),
                                        "dead_letters": len(dead)}
    assert len(rows) > 5000
    positions = {name: ((3000 + i) % 2, (3000 + i) // 2) for i, name in enumerate(poison)}
    reasons = {name: dead[pos][0].reason for name, pos in positions.items()}
    assert reasons["broken_2mb"].startswith("broken JSON")
    assert reasons["deep"].startswith("too deeply nested JSON")
    assert reasons["overflow"].startswith("number out of range: field 'year'")
    assert reasons["not_utf8"].startswith("not UTF-8: ")
    assert reasons["string_5mb"].startswith("event too large")
    for name in ("broken_2mb", "string_5mb", "deep"):  # too large for the topic: truncated, size and hash kept
        letter, info, value = dead[positions[name]]
        assert info == {"truncated": True, "size": len(poison[name]),
                        "sha256": hashlib.sha256(poison[name]).hexdigest()} and poison[name].startswith(value)
    for name in ("overflow", "not_utf8"):  # the raw bytes, as they came
        assert dead[positions[name]][1] == {} and dead[positions[name]][0].payload == poison[name]
    # the pipeline's own count is what Kafka acknowledged
    assert (f"{total:,} raw events -> {len(rows):,} training rows + {len(unlabelled):,} unlabelled (not trained on) "
            f"+ {len(dead):,} dead letters") in log


def test_undeliverable_features_stop_the_pipeline_and_a_restart_delivers_the_rest(
        bootstrap, dataset, tmp_path, new_topic):
    from kafka import KafkaAdminClient
    from kafka.admin import ConfigResource, ConfigResourceType

    names = _names()
    _topics(new_topic, names, raw_partitions=1)
    values = _events(2000)
    _produce(bootstrap, names["raw"], values[:500], partitions=1)
    proc = _start_pipeline(bootstrap, names, dataset, tmp_path / "a", ["--batch-size", "2000", "--max-delay", "30"])
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and _committed(bootstrap, names["raw"], names["group"]) != (500, 500):
            assert proc.poll() is None, _tail(tmp_path / "a" / "pipeline-test.log")
            time.sleep(0.5)
        # The features topic now takes less than any micro-batch: Kafka refuses the next sends.
        admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, names["features"], {"max.message.bytes": "1000"})])
        _produce(bootstrap, names["raw"], values[500:], partitions=1)
        try:
            proc.wait(timeout=120)  # the pipeline stops on its own
        except subprocess.TimeoutExpired:
            raise AssertionError("the pipeline kept running although Kafka refused its features") from None
        log = (tmp_path / "a" / "pipeline-test.log").read_text(errors="replace")
        assert proc.returncode != 0
        assert f"bytes for topic '{names['features']}'" in log and "MessageSizeTooLargeError" in log, _tail(
            tmp_path / "a" / "pipeline-test.log")
        committed, end = _committed(bootstrap, names["raw"], names["group"])
        rows, dead = _delivered(bootstrap, names)
        assert 500 <= committed < end == 2000
        # flights without an arrival delay are unlabelled: neither a feature row nor a dead letter
        unlabelled = {(0, o) for o, v in enumerate(values) if json.loads(v)["arr_delay"] is None}
        assert unlabelled and not unlabelled & (set(rows) | set(dead))
        assert {(0, o) for o in range(committed)} <= set(rows) | set(dead) | unlabelled  # commits never pass a lost one
        # The cause fixed, a restart delivers the rest.
        admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, names["features"],
                                            {"max.message.bytes": str(1 << 20)})])
        _run_pipeline_until_caught_up(bootstrap, names, dataset, tmp_path / "b", timeout=180)
        rows, dead = _delivered(bootstrap, names)
        assert set(rows) | set(dead) | unlabelled == {(0, o) for o in range(2000)} and not set(rows) & set(dead)
    finally:
        _stop(proc)
        admin.close()


def test_no_broker_every_streaming_command_fails_fast_with_one_line(dataset, tmp_path):
    from flowtrain.local.tools import free_port

    nobody = f"127.0.0.1:{free_port()}"
    commands = {
        "replay": ["replay", "--bootstrap", nobody, "--limit", "5"],
        "stream pipeline": ["stream", "pipeline", "--bootstrap", nobody, "--dataset", dataset, "--out",
                            str(tmp_path / "pipeline")],
        # its own --out: the whole job's trainer refuses a directory another command wrote into (run.json rules)
        "stream": ["stream", "--bootstrap", nobody, "--dataset", dataset, "--out", str(tmp_path / "job")],
    }
    t0 = time.monotonic()
    procs = {name: subprocess.Popen(CLI + args + ["--connect-timeout", "3"], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, start_new_session=True)
             for name, args in commands.items()}
    try:
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=90)
            lines = [line for line in err.splitlines() if line.strip() and "apitools" not in line]  # Beam's import warning
            assert proc.returncode not in (0, None), (name, err)
            assert len(lines) == 1 and "Traceback" not in err, (name, err)
            assert lines[0].startswith(f"flowtrain {name}: no Kafka broker answered at {nobody} within 3 s"), lines
            assert "flowtrain kafka status" in lines[0]
    finally:
        for proc in procs.values():
            _stop(proc, signal.SIGKILL)
    assert time.monotonic() - t0 < 90


def test_public_transforms_composed_deliver_what_the_steps_compute(bootstrap, dataset, new_topic):
    """read -> ParseFlightEvents -> MicroBatchEvents -> FeaturizeFlightBatches -> EncodeArrow ->
    WriteToKafka (+ errs -> WriteDeadLettersToKafka), as a bounded backfill on the batch runner."""
    from apache_beam.testing.test_pipeline import TestPipeline

    from connectors.dataset import read_manifest
    from connectors.kafka import ReadFromKafka
    from flowtrain.local.paths import cache_root
    from flowtrain.local.runners import pipeline_options
    from pipelines.flights.events import FLIGHT_EVENTS
    from pipelines.flights.preset import FLIGHTS
    from pipelines.flights.streaming import flights_stream_config
    from pipelines.stream.pipeline import build_features
    from pipelines.stream.steps import featurize_events, parse_records

    names = _names()
    _topics(new_topic, names, raw_partitions=2)
    values = _events(400)
    values[7], values[8] = b'{"broken', json.dumps({**json.loads(values[8]), "distance": 1e40}).encode()
    _produce(bootstrap, names["raw"], values, partitions=2)
    tables = FLIGHTS.demo_inputs(cache_root())
    cfg = flights_stream_config(kafka=KafkaTarget(bootstrap, group_id=names["group"], connect_timeout=30),
                                topics=Topics(raw=names["raw"], features=names["features"], dead_letters=names["dead"]),
                                batch_size=150, stats=read_manifest(dataset)["stats"], weather_path=tables["weather"],
                                planes_path=tables["planes"])
    with TestPipeline(options=pipeline_options("batch")) as p:
        records = p | ReadFromKafka(bootstrap, names["raw"], start="committed", stop="end", group_id=names["group"])
        build_features(records, cfg, max_message_bytes=8_000)
    messages = _read_topic(bootstrap, names["features"])
    assert len(messages) > 4 and max(len(m.value) for m in messages) <= 8_000  # split to fit
    rows, dead = _delivered(bootstrap, names)
    expected_events, expected_letters = parse_records(_read_topic(bootstrap, names["raw"]), FLIGHT_EVENTS)
    out = featurize_events(cfg.featurizer(), expected_events)
    features, bad = out.training(), out.training_dead_letters
    expected_letters += bad
    assert sorted(rows) == sorted(zip(features["src_partition"].to_pylist(), features["src_offset"].to_pylist()))
    assert {k: v[0].reason for k, v in dead.items()} == {
        tuple(int(x) for x in d.source.rsplit("/", 2)[1:]): d.reason for d in expected_letters}
    # raw = training rows + unlabelled (flights without an arrival delay: scored, not dead letters) + dead letters
    assert len(rows) + out.unlabelled + len(dead) == 400 and dead[(1, 3)][0].reason.startswith("broken JSON")
    assert dead[(0, 4)][0].reason.startswith("number out of range")
    assert _committed(bootstrap, names["raw"], names["group"]) == (400, 400)  # the read's own commit branch

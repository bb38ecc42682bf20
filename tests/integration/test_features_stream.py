"""Features over time on the stream (Prism, a real broker): generated payments replayed keyed by card, delivered
out of order within the allowed lateness, the stream pipeline computing the aggregates and the as-of join,
SIGKILLed mid-stream and restarted. The skew gate (`flowtrain skew`) against `flowtrain features`' backfill of the
same events finds zero mismatches; rows go to the features topic in offset order; a second pipeline with a
shorter lateness counts and dead-letters the late events (reason `late`). The scorer (`flowtrain stream score`, its
own group and states) on the same raw topic, a published model serving, joining the merchants from a compacted
topic instead of the file, logs the same values: skew zero as well."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.csv as pacsv
import pytest
from kafka import KafkaConsumer, TopicPartition

from connectors.arrow import decode_batch
from connectors.dataset_spec import FeatureSpec
from flowtrain.cli.main import main
from flowtrain.commands.features.skew import SkewJob, run_skew
from flowtrain.local.runners import pipeline_options
from pipelines.features.declare import declare
from pipelines.features.transactions import generate_transactions
from pipelines.stream.status import read_status
from pipelines.tabular.pipeline import run_tabular_etl
from tests.features_oracle import logged_ids, waiting_at_end
from tests.kafka_checks import committed
from tests.procs import stop_group

pytestmark = [pytest.mark.kafka, pytest.mark.streaming, pytest.mark.timeout(600)]
CLI = [sys.executable, "-m", "flowtrain.cli"]
EVENTS, DELAY, PARTITIONS = 2400, 600, 3
AGGREGATIONS = ["card:amount:count,sum,mean,max,std:10m,1h,1d,life", "card:*:count:10m",
                "card:merchant:distinct:1d"]


def _declaration_args(merchants: str) -> list[str]:
    args = ["--join", f"{merchants}:merchant:valid_from"]
    for a in AGGREGATIONS:
        args += ["--aggregate", a]
    return args


def _read(bootstrap: str, topic: str, missing_ok: bool = False) -> list:
    c = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, consumer_timeout_ms=4000)
    parts = c.partitions_for_topic(topic) or ()
    if not parts and missing_ok:  # not made yet
        c.close()
        return []
    c.assign([TopicPartition(topic, p) for p in parts])
    c.seek_to_beginning()
    out = list(c)
    c.close()
    return out


def _pipeline(bootstrap, names, dataset, out: Path, merchants, lateness: float, log: Path):
    out.mkdir(parents=True, exist_ok=True)
    args = ["stream", "pipeline", "--bootstrap", bootstrap, "--raw-topic", names["raw"], "--features-topic",
            names["features"], "--dead-letter-topic", names["dead"], "--group-id", names["group"], "--dataset",
            dataset, "--out", str(out), "--batch-size", "150", "--max-delay", "0.5", "--allowed-lateness",
            str(lateness), "--log-features", str(log), "--log-features-id", "txn", *_declaration_args(merchants)]
    return subprocess.Popen(CLI + args, stdout=open(out / "pipeline.log", "ab"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _wait(bootstrap, names, proc, out: Path, at_least: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, end = committed(bootstrap, names["raw"], names["group"])
        if done >= at_least and (at_least < EVENTS or done == end):
            return
        assert proc.poll() is None, (out / "pipeline.log").read_text()[-3000:]
        time.sleep(0.5)
    raise AssertionError(f"pipeline did not commit {at_least} in {timeout} s: "
                         f"{(out / 'pipeline.log').read_text()[-2000:]}")


@pytest.fixture(scope="module")
def streamed(bootstrap, tmp_path_factory):
    base = tmp_path_factory.mktemp("features-stream")
    txns, merchants = generate_transactions(EVENTS, cards=60, merchants=30, days=8, delay_s=DELAY, seed=21)
    pacsv.write_csv(txns, base / "txns.csv")
    pacsv.write_csv(merchants, base / "merchants.csv")
    m = str(base / "merchants.csv")
    # the backfill, and a dataset of it (the model's columns: the aggregates) for the stream's featurizer
    assert main(["features", "--input", str(base / "txns.csv"), "--time-column", "time", "--out",
                 str(base / "backfill.parquet"), *_declaration_args(m)]) == 0
    decl = declare(AGGREGATIONS, [f"{m}:merchant:valid_from"])
    names_ = decl.aggregate_names()
    nullable = [n for n in names_ if any(a in n for a in ("_mean_", "_max_", "_std_"))]
    spec = FeatureSpec(label="fraud", task="classification", time_column="time", categorical=["category"],
                       numeric=["amount", *(n for n in names_ if n not in nullable)],
                       optional_numeric=[*nullable, "merchant_risk_tier"])
    run_tabular_etl([str(base / "backfill.parquet")], spec, dataset_path=str(base / "dataset"),
                    dead_letters_path=None, options=pipeline_options("batch"))
    tag = uuid.uuid4().hex[:6]
    names = {"raw": f"fraw-{tag}", "features": f"ffeat-{tag}", "dead": f"fdead-{tag}", "group": f"fg-{tag}"}
    # the pipeline first, then the payments at 400/s in arrival order (out of order by up to 10 minutes),
    # keyed by card; the pipeline is SIGKILLed halfway and started again
    replay = subprocess.Popen(CLI + ["replay", "--bootstrap", bootstrap, "--topic", names["raw"], "--input",
                                     str(base / "txns.csv"), "--key-column", "card", "--partitions",
                                     str(PARTITIONS), "--rate", "400"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    log, out = base / "logged", base / "p"
    proc = _pipeline(bootstrap, names, str(base / "dataset"), out, m, DELAY, log)
    try:
        _wait(bootstrap, names, proc, out, EVENTS // 2)
        stop_group(proc, signal.SIGKILL)
        assert replay.wait(timeout=120) == 0, replay.stdout.read().decode()[-2000:]
        proc = _pipeline(bootstrap, names, str(base / "dataset"), out, m, DELAY, log)
        _wait(bootstrap, names, proc, out, EVENTS)
    finally:
        stop_group(proc)
        stop_group(replay, signal.SIGKILL)
    # a second pipeline (its own group) with a shorter lateness: events more than 2 minutes late are dead letters
    late_names = {**names, "features": f"ffeat2-{tag}", "dead": f"fdead2-{tag}", "group": f"fg2-{tag}"}
    late_out = base / "late"
    proc = _pipeline(bootstrap, late_names, str(base / "dataset"), late_out, m, 120, base / "logged-late")
    try:
        _wait(bootstrap, late_names, proc, late_out, EVENTS)
    finally:
        stop_group(proc)
    return {"base": base, "txns": txns, "names": names, "raw": _read(bootstrap, names["raw"]),
            "late_names": late_names, "log": log,
            "pipeline_log": (out / "pipeline.log").read_text(), "late_log": (late_out / "pipeline.log").read_text(),
            "aggregates": [*names_, "merchant_risk_tier"]}


@pytest.fixture(scope="module")
def scored(streamed, bootstrap):
    """`flowtrain stream score --log-features` on the same raw topic (its own group and feature states) with the
    pipeline's --aggregate/--allowed-lateness and its --join's table from a compacted topic (--join kafka://...), a
    model version with random weights published first; until it
    has logged as many events as the pipeline did (the same ones wait for the watermark at the end)."""
    import os

    from connectors.model_updates import UpdateKeySource
    from flowtrain.train.loader import TabularDataset
    from flowtrain.train.models import Architecture
    from flowtrain.train.published import Publisher

    base, names = streamed["base"], streamed["names"]
    tag = uuid.uuid4().hex[:6]
    snames = {"updates": f"fupd-{tag}", "pred": f"fpred-{tag}", "dead": f"fsdead-{tag}", "group": f"fsg-{tag}",
              "merchants": f"fmerch-{tag}"}
    key = base / "update.key"
    key.write_bytes(b"features-test-key-0123456789abcdef")
    key.chmod(0o600)
    arch = {"kind": "mlp", "hidden": [16], "dropout": 0.0, "seed": 0}
    model = Architecture.from_dict(arch, "test").build(TabularDataset(str(base / "dataset")))
    record = Publisher(base / "publisher", keep=2, key_source=UpdateKeySource.from_options(str(key))).publish(
        model={k: v.clone() for k, v in model.state_dict().items()}, architecture=arch, version=1, step=1,
        run_id="run-f", reason="periodic", time=time.time())
    from kafka import KafkaProducer

    # the scorer joins the merchants from a compacted topic (one JSON row per record), the backfill from the file
    from kafka.admin import KafkaAdminClient, NewTopic

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(snames["merchants"], 1, 1, topic_configs={"cleanup.policy": "compact"})])
    admin.close()
    producer = KafkaProducer(bootstrap_servers=bootstrap)
    producer.send(snames["updates"], json.dumps(record).encode(), key=b"1").get(timeout=30)
    for row in pacsv.read_csv(base / "merchants.csv").to_pylist():
        producer.send(snames["merchants"], json.dumps(row).encode(),
                      key=f"{row['merchant']}@{row['valid_from']}".encode())
    producer.flush(timeout=30)
    producer.close()
    out, log = base / "s", base / "scored"
    out.mkdir()
    args = ["stream", "score", "--bootstrap", bootstrap, "--raw-topic", names["raw"], "--updates-topic",
            snames["updates"], "--predictions-topic", snames["pred"], "--score-dead-letter-topic", snames["dead"],
            "--score-group-id", snames["group"], "--dataset", str(base / "dataset"), "--out", str(out),
            "--wait-model", "120", "--id-column", "txn", "--update-key-file", str(key), "--allowed-lateness",
            str(DELAY), "--log-features", str(log), "--log-features-id", "txn",
            *_declaration_args(f"kafka://{snames['merchants']}")]
    proc = subprocess.Popen(CLI + args, stdout=open(out / "scorer.log", "ab"), stderr=subprocess.STDOUT,
                            start_new_session=True, env={k: v for k, v in os.environ.items()
                                                         if k != "FLOWTRAIN_UPDATE_KEY"})
    want = len(logged_ids(streamed["log"]))
    try:
        deadline, preds = time.monotonic() + 240, []
        while len(logged_ids(log)) < want or len({str(p.get("txn")) for p in preds}) < want:
            assert proc.poll() is None, (out / "scorer.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (len(logged_ids(log)), len(preds), want,
                                                 (out / "scorer.log").read_text()[-2000:])
            time.sleep(1)
            preds = [row for m in _read(bootstrap, snames["pred"], missing_ok=True)
                     for row in decode_batch(m.value).to_pylist()]
        time.sleep(2)  # anything more it would log or predict (it must not)
    finally:
        stop_group(proc)
    preds = [row for m in _read(bootstrap, snames["pred"]) for row in decode_batch(m.value).to_pylist()]
    return {"log": log, "want": want, "predictions": preds, "scorer_log": (out / "scorer.log").read_text(),
            "merchants": snames["merchants"]}


def test_the_scorer_logs_the_same_values_as_the_backfill(streamed, scored):
    code, lines = run_skew(SkewJob(logged=(str(scored["log"]),), backfill=str(streamed["base"] / "backfill.parquet"),
                                   id="txn", features=tuple(streamed["aggregates"])))
    report = "\n".join(lines)
    assert code == 0 and "skew: none" in report, report
    assert f"topic {scored['merchants']!r}" not in scored["scorer_log"]  # no join record rejected, no late version
    assert lines[0].startswith(f"events: {scored['want']:,} compared"), (lines[0], scored["want"])
    everything = {str(t) for t in streamed["txns"].column("txn").to_pylist()}
    assert logged_ids(scored["log"]) == everything - waiting_at_end(streamed["raw"], DELAY)
    assert " 0 logged twice with other values" in lines[0], lines[0]
    scored_ids = {str(p["txn"]) for p in scored["predictions"] if p.get("txn") is not None}
    assert scored_ids == logged_ids(scored["log"]), (len(scored_ids), scored["want"], scored["scorer_log"][-2000:])


def test_the_stream_equals_the_backfill_across_a_kill9(streamed):
    assert "stream pipeline:" in streamed["pipeline_log"]
    code, lines = run_skew(SkewJob(logged=(str(streamed["log"]),), backfill=str(streamed["base"] / "backfill.parquet"),
                                   id="txn", features=tuple(streamed["aggregates"])))
    report = "\n".join(lines)
    assert code == 0 and "skew: none" in report, report
    events = lines[0]
    # what is not logged: exactly the events still waiting for the watermark at the end: in each partition, in
    # offset order, from the first event more than the allowed lateness after the partition's greatest time on
    # (rows go on in offset order); the pipeline counted them (its status, written per micro-batch, may lag)
    waiting = waiting_at_end(streamed["raw"], DELAY)
    missing = {str(t) for t in streamed["txns"].column("txn").to_pylist()} - logged_ids(streamed["log"])
    assert missing == waiting and waiting, (sorted(missing - waiting)[:10], sorted(waiting - missing)[:10], report)
    counted = sum(s.get("waiting", 0) for s in read_status(str(streamed["base"] / "p" / "pipeline-status.json")))
    assert 0 < counted <= len(waiting), (counted, len(waiting))
    assert " 0 logged twice with other values" in events, events


def test_rows_go_on_in_offset_order_and_no_event_was_late(streamed, bootstrap):
    names = streamed["names"]
    for message in _read(bootstrap, names["features"]):
        offsets = decode_batch(message.value)["src_offset"].to_pylist()
        assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets)
    reasons = Counter(dict(m.headers)["reason"].decode().split(":")[0] for m in _read(bootstrap, names["dead"]))
    assert reasons.get("late", 0) == 0, reasons


def test_a_shorter_lateness_counts_and_dead_letters_the_late_events(streamed, bootstrap):
    names = streamed["late_names"]
    late = [m for m in _read(bootstrap, names["dead"]) if dict(m.headers)["reason"].decode().startswith("late:")]
    assert late, streamed["late_log"][-2000:]
    status = read_status(str(streamed["base"] / "late" / "pipeline-status.json"))
    assert sum(s.get("late", 0) for s in status) == len({(m.partition, m.offset) for m in late})
    # the line the pipeline prints when it stops counts them too
    assert f"; {len({(m.partition, m.offset) for m in late}):,} of the dead letters late (features over time)" in \
        streamed["late_log"], streamed["late_log"][-2000:]
    reason = dict(late[0].headers)["reason"].decode()
    assert "more than the allowed lateness (120 s) behind its partition's watermark" in reason


def test_flowtrain_skew_exits_0_then_3_on_a_value_changed_in_the_log(streamed, tmp_path, capsys):
    backfill = str(streamed["base"] / "backfill.parquet")
    args = ["skew", "--backfill", backfill, "--id", "txn", "--features", ",".join(streamed["aggregates"])]
    assert main([*args, "--logged", str(streamed["log"])]) == 0
    assert "skew: none" in capsys.readouterr().out
    rows = [json.loads(line) for f in sorted(streamed["log"].glob("*.jsonl")) for line in f.read_text().splitlines()]
    once = Counter(r["txn"] for r in rows)
    row = next(r for r in rows[len(rows) // 2:] if once[r["txn"]] == 1 and r["card_amount_sum_1d"])
    changed = [dict(r, card_amount_sum_1d=r["card_amount_sum_1d"] * (1 + 1e-8)) if r is row else r for r in rows]
    (tmp_path / "changed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in changed))  # 1e-8: beyond 1e-9
    assert main([*args, "--logged", str(tmp_path / "changed.jsonl")]) == 3
    out = capsys.readouterr().out
    assert "skew: 1 mismatches beyond 1e-09 relative" in out and f"txn={row['txn']}" in out, out


def test_replay_generate_transactions_writes_the_tables_and_replays_keyed_by_card(bootstrap, tmp_path, capsys):
    topic = f"fgen-{uuid.uuid4().hex[:6]}"
    assert main(["replay", "--bootstrap", bootstrap, "--topic", topic, "--generate", "transactions", "--limit", "300",
                 "--out-of-order", "600", "--generate-out", str(tmp_path), "--partitions", "2"]) == 0
    assert "300 card payments" in capsys.readouterr().out
    txns, merchants = pacsv.read_csv(tmp_path / "transactions.csv"), pacsv.read_csv(tmp_path / "merchants.csv")
    assert txns.num_rows == 300 and {"merchant", "valid_from", "risk_tier"} <= set(merchants.column_names)
    times = txns.column("time").to_numpy()
    assert (np.diff(times) < 0).any()  # delivered out of event-time order
    records = _read(bootstrap, topic)
    assert len(records) == 300
    part_of = {}
    for m in records:  # keyed by card: a card's payments in one partition
        card = json.loads(m.value)["card"]
        assert m.key == str(card).encode() and part_of.setdefault(card, m.partition) == m.partition

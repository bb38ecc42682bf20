"""Features over time on the local Flink session cluster (the session's, EXTERNAL SDK workers from its worker pool)
and a real broker: generated payments replayed keyed by card while `flowtrain stream pipeline --runner flink` runs
on a dataset made by `flowtrain batch --aggregate/--join` (the stream takes the dataset's declaration: declared
once). Mid-stream a TaskManager's JVM and the SDK workers running the fused step are SIGKILLed (kill -9 where the
aggregations' state and the offsets are written), `flowtrain flink start` (``LocalFlink.start``) starts the dead
TaskManager again with the rest of the cluster kept, the pipeline is started again, and the skew gate against the
batch run's own backfill finds zero mismatches: the same values as an uninterrupted run."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
import uuid

import pyarrow.csv as pacsv
import pytest
from kafka import KafkaConsumer, TopicPartition

from flowtrain.cli.main import main
from flowtrain.commands.features.skew import SkewJob, run_skew
from flowtrain.local.processes import same_process
from pipelines.features.declare import declare
from pipelines.features.transactions import generate_transactions
from tests.features_oracle import logged_ids, waiting_at_end
from tests.kafka_checks import committed
from tests.procs import descendants, stop_group

pytestmark = [pytest.mark.flink, pytest.mark.kafka, pytest.mark.streaming, pytest.mark.timeout(600)]
CLI = [sys.executable, "-m", "flowtrain.cli"]
EVENTS, DELAY, PARTITIONS = 1500, 600, 3
AGGREGATIONS = ["card:amount:count,sum,mean,max,std:10m,1h,1d,life", "card:*:count:10m", "card:merchant:distinct:1d"]


def _active_jobs(rest: str) -> list[dict]:
    with urllib.request.urlopen(f"{rest}/jobs/overview", timeout=10) as resp:
        return [j for j in json.loads(resp.read())["jobs"] if j["state"] not in ("FINISHED", "CANCELED", "FAILED")]


def _cancel_active(rest: str) -> None:
    from flowtrain.local.flink.rest import cancel_flink_jobs

    for job in _active_jobs(rest):
        cancel_flink_jobs(rest, job["name"])


def _sdk_workers(cluster) -> dict[int, str]:
    """The SDK worker processes the cluster's worker pool started (the ones running the pipeline's steps)."""
    pool = cluster.read_state()["processes"]["worker-pool"]
    assert same_process(pool), pool
    return descendants(pool["pid"])


def test_the_stream_on_flink_equals_the_backfill_across_a_kill9_of_a_taskmanager_and_its_sdk_workers(
        bootstrap, flink_cluster, tmp_path, say):
    base = tmp_path
    txns, merchants = generate_transactions(EVENTS, cards=40, merchants=20, days=6, delay_s=DELAY, seed=33)
    pacsv.write_csv(txns, base / "txns.csv")
    pacsv.write_csv(merchants, base / "merchants.csv")
    declared = ["--join", f"{base / 'merchants.csv'}:merchant:valid_from"]
    for a in AGGREGATIONS:
        declared += ["--aggregate", a]
    run = base / "run"  # the dataset (and its backfill, run/features.parquet) the stream reads
    assert main(["batch", "--input", str(base / "txns.csv"), "--label", "fraud", "--time-column", "time",
                 "--numeric", "amount", "--categorical", "category", *declared, "--job-only", "--out", str(run)]) == 0
    tag = uuid.uuid4().hex[:6]
    raw, group, log, out = f"fkraw-{tag}", f"fkg-{tag}", base / "logged", base / "p"
    out.mkdir()
    rest = flink_cluster.status()["rest"]

    def pipeline() -> subprocess.Popen:  # no --aggregate/--join: the dataset's
        return subprocess.Popen(CLI + [
            "stream", "pipeline", "--bootstrap", bootstrap, "--raw-topic", raw, "--features-topic", f"fkfeat-{tag}",
            "--dead-letter-topic", f"fkdead-{tag}", "--group-id", group, "--dataset", str(run / "dataset"), "--out",
            str(out), "--batch-size", "100", "--max-delay", "0.5", "--allowed-lateness", str(DELAY),
            "--log-features", str(log), "--log-features-id", "txn", "--runner", "flink"],
            stdout=open(out / "pipeline.log", "ab"), stderr=subprocess.STDOUT, start_new_session=True)

    def wait(proc, at_least: int, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            done, end = committed(bootstrap, raw, group)
            if done >= at_least and (at_least < EVENTS or done == end):
                return
            assert proc.poll() is None, (out / "pipeline.log").read_text()[-3000:]
            time.sleep(0.5)
        raise AssertionError(f"{done} of {at_least} committed in {timeout} s: "
                             f"{(out / 'pipeline.log').read_text()[-2000:]}")

    replay = subprocess.Popen(CLI + ["replay", "--bootstrap", bootstrap, "--topic", raw, "--input",
                                     str(base / "txns.csv"), "--key-column", "card", "--partitions", str(PARTITIONS),
                                     "--rate", "50"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    proc = pipeline()
    try:
        wait(proc, EVENTS // 3)
        jobmanager = flink_cluster.read_state()["processes"]["jobmanager"]
        workers = _sdk_workers(flink_cluster)
        assert workers, "no SDK worker runs the job"
        at_kill = committed(bootstrap, raw, group)[0]
        assert at_kill < EVENTS, "every event was committed before the kill: not mid-stream"
        taskmanager = flink_cluster.read_state()["processes"]["taskmanager-1"]
        assert same_process(taskmanager), taskmanager
        # kill -9 a TaskManager's JVM, and the SDK workers where the features' state and the offsets are written
        for pid in [taskmanager["pid"], *workers]:
            subprocess.run(["kill", "-9", str(pid)], check=False)
        say(f"flink features: TaskManager 1 and {len(workers)} SDK worker process(es) SIGKILLed at {at_kill} of "
            f"{EVENTS} committed")
        stop_group(proc, signal.SIGKILL)  # the job (failed or restarting) goes; a new one starts from the state
        _cancel_active(rest)
        t0 = time.monotonic()
        flink_cluster.start(quiet=True)  # only the dead TaskManager starts again (the rest of the cluster kept)
        state = flink_cluster.read_state()
        assert flink_cluster.running() and state["processes"]["taskmanager-1"]["pid"] != taskmanager["pid"]
        assert state["processes"]["jobmanager"]["pid"] == jobmanager["pid"]
        say(f"flink features: TaskManager 1 started again in {time.monotonic() - t0:.1f} s")
        proc = pipeline()
        assert replay.wait(timeout=120) == 0, replay.stdout.read().decode()[-2000:]
        wait(proc, EVENTS)
    finally:
        stop_group(proc)
        stop_group(replay, signal.SIGKILL)
        _cancel_active(rest)
    features = (*declare(AGGREGATIONS).aggregate_names(), "merchant_risk_tier")
    code, lines = run_skew(SkewJob(logged=(str(log),), backfill=str(run / "features.parquet"), id="txn",
                                   features=features))
    report = "\n".join(lines)
    assert code == 0 and "skew: none" in report, report
    assert " 0 logged twice with other values" in lines[0], lines[0]
    # not logged: exactly the events still waiting for their partition's watermark at the end
    missing = {str(t) for t in txns.column("txn").to_pylist()} - logged_ids(log)
    c = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, consumer_timeout_ms=4000)
    c.assign([TopicPartition(raw, p) for p in c.partitions_for_topic(raw) or ()])
    c.seek_to_beginning()
    records = list(c)
    c.close()
    assert len(records) == EVENTS
    waiting = waiting_at_end(records, DELAY)
    assert missing == waiting and waiting, (sorted(missing - waiting)[:10], sorted(waiting - missing)[:10], report)

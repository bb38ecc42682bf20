"""bench stream: the whole streaming job on this machine, on a broker it starts itself.

1. Sustained throughput: N raw events replayed as fast as possible, then the stream pipeline
   (Prism) and the online trainer run until every valid event is trained; raw events/s.
2. Latency at a fixed rate (2,000 events/s): for every event, the time from its produce
   timestamp to the publish time of the first model version that trained it (from the
   trainer's ledger and the model-updates topic); p50 and p99 (goal p99 < 5 s).
3. The trainer's consume rate on the features topic vs a raw kafka-python consumer of the same
   topic (the anchor), in the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
from kafka import KafkaConsumer, TopicPartition

from bench.table import report
from bench.timing import MIN_REPEATS, interleaved, median_rows, repeats_note
from flowtrain.local.kafka import LocalKafka, free_port

CLI = [sys.executable, "-m", "flowtrain.cli"]


def _dataset(work: Path) -> str:
    from flowtrain.local.runners import pipeline_options
    from flowtrain.local.paths import demo_tables_dir
    from pipelines.flights.batch import export_tables, run_flights_etl

    run_flights_etl(dataset_path=str(work / "ds"), dead_letters_path=None, options=pipeline_options("batch"),
                    tables=export_tables(demo_tables_dir()))
    return str(work / "ds")


def _names() -> dict:
    tag = uuid.uuid4().hex[:6]
    return {"raw": f"raw-{tag}", "features": f"feat-{tag}", "dead": f"dead-{tag}", "updates": f"upd-{tag}",
            "group": f"g-{tag}"}


def _args(bootstrap, names, dataset, out) -> list[str]:
    return ["--bootstrap", bootstrap, "--raw-topic", names["raw"], "--features-topic", names["features"],
            "--dead-letter-topic", names["dead"], "--updates-topic", names["updates"], "--group-id", names["group"],
            "--dataset", dataset, "--out", str(out)]


def _spawn(cmd, log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def _trained_rows(run: Path) -> int:
    try:
        return json.loads((run / "trainer-status.json").read_text())["rows"]
    except (OSError, ValueError, KeyError):
        return 0


def _valid_count(bootstrap, topic) -> int:
    from connectors.arrow import decode_batch

    c = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, consumer_timeout_ms=3000)
    tps = [TopicPartition(topic, p) for p in c.partitions_for_topic(topic)]
    c.assign(tps)
    c.seek_to_beginning()
    n = sum(decode_batch(m.value).num_rows for m in c)
    c.close()
    return n


def _run_job(bootstrap, names, dataset, run: Path, *, events: int, rate: float, ckpt_s: float,
             timeout: float = 600) -> tuple[float, subprocess.Popen, subprocess.Popen]:
    run.mkdir(parents=True, exist_ok=True)
    subprocess.run(CLI + ["replay", "--bootstrap", bootstrap, "--topic", names["raw"], "--limit", "1",
                          "--partitions", "3"], check=True, capture_output=True, timeout=120)  # topic exists
    pipeline = _spawn(CLI + ["stream", "pipeline", *_args(bootstrap, names, dataset, run)], run / "pipeline.log")
    trainer = _spawn(CLI + ["stream", "train", *_args(bootstrap, names, dataset, run), "--ledger",
                            "--checkpoint-every", "1000000", "--checkpoint-seconds", str(ckpt_s)], run / "trainer.log")
    time.sleep(8)  # both halves up (Prism start, torch import)
    t0 = time.monotonic()
    replay = _spawn(CLI + ["replay", "--bootstrap", bootstrap, "--topic", names["raw"], "--skip", "1",
                           "--limit", str(events), "--rate", str(rate)], run / "replay.log")
    replay.wait(timeout=timeout)
    return t0, pipeline, trainer


def run(out_dir: str | None = "bench/results", events: int = 30_000, latency_events: int = 20_000,
        repeats: int = MIN_REPEATS) -> str:
    """Every measurement ``repeats`` times (whole rounds, so the cases interleave); cells are medians."""
    rounds = interleaved({"round": lambda: _one_round(events, latency_events)}, repeats=repeats)["round"]
    return report("stream", ["measure", "events/rows", "seconds", "per second", "vs anchor"], median_rows(rounds),
                  notes=["One broker, Prism, 2 cores shared by broker, pipeline and trainer. Latency: from each "
                         "event's produce timestamp to the publish time of the first model version that trained "
                         f"it (checkpoint and publish every 1 s); goal p99 < 5 s. Each cell the {repeats_note(repeats)} "
                         "(a round runs every measurement once, on a broker of its own)."], out_dir=out_dir)


def _one_round(events: int, latency_events: int) -> list[tuple]:
    work = Path(tempfile.mkdtemp(prefix="flowtrain-bench-stream-"))
    broker = LocalKafka(port=free_port(), data_dir=work / "kafka")
    broker.start(quiet=True)
    bootstrap = broker.bootstrap
    rows = []
    try:
        dataset = _dataset(work)
        # --- 1. sustained throughput ----------------------------------------------------------
        names = _names()
        run1 = work / "throughput"
        t0, pipeline, trainer = _run_job(bootstrap, names, dataset, run1, events=events, rate=0, ckpt_s=5)
        deadline = time.monotonic() + 600
        valid = None
        while time.monotonic() < deadline:
            done, end = _committed(bootstrap, names)
            if end >= events + 1 and done == end:
                valid = valid or _valid_count(bootstrap, names["features"])
                if _trained_rows(run1) >= valid:
                    break
            time.sleep(0.5)
        took = time.monotonic() - t0
        _stop(trainer)
        _stop(pipeline)
        rows.append(("sustained, whole job (replay -> pipeline -> trainer)", events, took, events / took, ""))

        # --- 3. trainer consume rate vs a raw consumer of the same features topic --------------
        raw_t = time.monotonic()
        c = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, consumer_timeout_ms=2000,
                          max_partition_fetch_bytes=16 * 1024 * 1024)
        tps = [TopicPartition(names["features"], p) for p in c.partitions_for_topic(names["features"])]
        c.assign(tps)
        c.seek_to_beginning()
        for _ in c:  # fetch every message once
            pass
        raw_s = time.monotonic() - raw_t - 2.0  # minus the consumer_timeout at the end
        c.close()
        run3 = work / "consume"
        proc = subprocess.run(CLI + ["stream", "train", *_args(bootstrap, names, dataset, run3), "--idle-exit", "2",
                                     "--checkpoint-seconds", "1000"], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:]
        # the trainer's own rate from its first to its last message (not its start-up)
        rate = float(proc.stdout.split("rows trained (", 1)[1].split(" rows/s", 1)[0].replace(",", ""))
        train_s = valid / rate
        rows.append(("features topic: raw kafka-python consumer (anchor)", valid, raw_s, valid / raw_s, 1.0))
        rows.append(("features topic: online trainer (evaluate + train)", valid, train_s, valid / train_s,
                     raw_s / train_s))

        # --- 2. latency at a fixed rate ---------------------------------------------------------
        names2 = _names()
        run2 = work / "latency"
        t0, pipeline, trainer = _run_job(bootstrap, names2, dataset, run2, events=latency_events, rate=2000,
                                         ckpt_s=1.0)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            done, end = _committed(bootstrap, names2)
            if end >= latency_events + 1 and done == end:
                break
            time.sleep(0.5)
        time.sleep(4)  # the last checkpoint publishes
        _stop(trainer)
        _stop(pipeline)
        lat = _latencies(bootstrap, names2, run2)
        rows.append(("latency at 2,000 events/s: produce -> published model (p50)", len(lat), float(np.percentile(lat, 50)),
                     "", ""))
        rows.append(("latency at 2,000 events/s: produce -> published model (p99)", len(lat), float(np.percentile(lat, 99)),
                     "", ""))
    finally:
        from connectors.kafka import close_all_clients

        close_all_clients()
        broker.stop(quiet=True)
    return rows


def _committed(bootstrap, names) -> tuple[int, int]:
    c = KafkaConsumer(bootstrap_servers=bootstrap, group_id=names["group"], enable_auto_commit=False)
    try:
        tps = [TopicPartition(names["raw"], p) for p in c.partitions_for_topic(names["raw"]) or []]
        ends = c.end_offsets(tps)
        return sum(c.committed(tp) or 0 for tp in tps), sum(ends.values())
    finally:
        c.close()


def _latencies(bootstrap, names, run: Path) -> np.ndarray:
    c = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, consumer_timeout_ms=3000)
    produced: dict[tuple[int, int], float] = {}
    tps = [TopicPartition(names["raw"], p) for p in c.partitions_for_topic(names["raw"])]
    c.assign(tps)
    c.seek_to_beginning()
    for m in c:
        produced[(m.partition, m.offset)] = m.timestamp / 1000.0
    up = [TopicPartition(names["updates"], p) for p in c.partitions_for_topic(names["updates"])]
    c.assign(up)
    c.seek_to_beginning()
    published = {json.loads(m.value)["version"]: m.timestamp / 1000.0 for m in c}
    c.close()
    out = []
    for line in (run / "ledger.jsonl").read_text().splitlines():
        r = json.loads(line)
        key = (r["partition"], r["offset"])
        if key in produced and r["version"] in published:
            out.append(published[r["version"]] - produced[key])
    return np.array(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--events", type=int, default=30_000)
    ap.add_argument("--latency-events", type=int, default=20_000)
    ap.add_argument("--repeats", type=int, default=MIN_REPEATS, help="rounds of every measurement (>= 3); medians")
    a = ap.parse_args(argv)
    run(events=a.events, latency_events=a.latency_events, repeats=a.repeats)


if __name__ == "__main__":
    main()

"""bench features, the stream's part: the stream pipeline (Prism, a real broker) with 4 windows x 5 aggregations per
card against the same pipeline without aggregations, and the freshness of its feature rows.

Throughput: ``--stream-events`` generated payments are replayed first (keyed by card, 3 partitions); each run is a
new consumer group of the same raw topic; events/s from the pipeline's first commit to its commit of the last event
(so Prism's start-up is not counted; from its start when the first commit holds every event, as in a tiny run);
cases interleaved, medians. Without aggregations the dataset holds the payments' own columns; with them, the
aggregates too (the batch ETL on the backfill), and the pipeline computes them
(``--aggregate card:amount:count,sum,mean,max,std:10m,1h,1d,30d``, lateness 0).

Freshness: without and with the aggregations, payments replayed at ``--freshness-rate`` events/s for
``--freshness-seconds`` into a running pipeline; per event, the features topic's record time of its row minus the
raw record's produce time (Kafka timestamps, one clock); p50 and p99.
"""
from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from kafka import KafkaConsumer, TopicPartition

from bench.stream import stop_process
from connectors.arrow import decode_batch
from connectors.dataset_spec import FeatureSpec
from connectors.kafka import topic_partitions
from flowtrain.local.runners import pipeline_options
from pipelines.features.backfill import run_backfill
from pipelines.features.declare import declare
from pipelines.features.transactions import generate_transactions
from pipelines.tabular.pipeline import run_tabular_etl

CLI = [sys.executable, "-m", "flowtrain.cli"]
AGGREGATE = "card:amount:count,sum,mean,max,std:10m,1h,1d,30d"


def _committed(bootstrap: str, topic: str, group: str) -> tuple[int, int]:
    c = KafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    try:
        tps = [TopicPartition(topic, p) for p in sorted(topic_partitions(c, topic))]
        ends = c.end_offsets(tps)
        return sum(c.committed(tp) or 0 for tp in tps), sum(ends.values())
    finally:
        c.close()


def datasets(work: Path, events: int) -> tuple[Path, str, str]:
    """(the payments' Parquet file, the dataset without aggregates, the dataset with them)."""
    txns, _ = generate_transactions(events, seed=3)
    pq.write_table(txns, work / "stream.parquet")
    decl = declare([AGGREGATE])
    run_backfill([str(work / "stream.parquet")], decl, time_column="time", time_format=None,
                 out=str(work / "stream-backfill.parquet"), options=pipeline_options("batch"), overwrite=True)
    names = decl.aggregate_names()
    nullable = [n for n in names if any(f"_{a}_" in n for a in ("mean", "max", "std"))]
    base = dict(label="fraud", task="classification", time_column="time", categorical=["category"])
    plain = FeatureSpec(**base, numeric=["amount"])
    agg = FeatureSpec(**base, numeric=["amount", *(n for n in names if n not in nullable)], optional_numeric=nullable)
    for name, spec, source in (("plain", plain, "stream.parquet"), ("agg", agg, "stream-backfill.parquet")):
        run_tabular_etl([str(work / source)], spec, dataset_path=str(work / f"dataset-{name}"), dead_letters_path=None,
                        options=pipeline_options("batch"))
    return work / "stream.parquet", str(work / "dataset-plain"), str(work / "dataset-agg")


def replay(bootstrap: str, topic: str, table: Path, *, rate: float = 0, skip: int = 0, limit: int = 0) -> None:
    args = ["replay", "--bootstrap", bootstrap, "--topic", topic, "--input", str(table), "--key-column", "card",
            "--partitions", "3", "--rate", str(rate), "--skip", str(skip)] + (["--limit", str(limit)] if limit else [])
    subprocess.run(CLI + args, check=True, capture_output=True, timeout=900)


def _pipeline(bootstrap: str, raw: str, dataset: str, out: Path, aggregated: bool, max_delay: float | None = None
              ) -> tuple[subprocess.Popen, str, str]:
    out.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:6]
    group = f"bfg-{tag}"
    args = ["stream", "pipeline", "--bootstrap", bootstrap, "--raw-topic", raw, "--features-topic", f"bff-{tag}",
            "--dead-letter-topic", f"bfd-{tag}", "--group-id", group, "--dataset", dataset, "--out", str(out),
            *(["--aggregate", AGGREGATE] if aggregated else []),
            *(["--max-delay", str(max_delay)] if max_delay is not None else [])]
    proc = subprocess.Popen(CLI + args, stdout=open(out / "pipeline.log", "ab"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    return proc, group, f"bff-{tag}"


def _wait_all(bootstrap: str, raw: str, group: str, proc: subprocess.Popen, log: Path, timeout: float = 900
              ) -> tuple[float, int, float]:
    """(time of the first commit, events committed then, time of the commit of the last event)."""
    deadline, first = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        done, end = _committed(bootstrap, raw, group)
        now = time.monotonic()
        if done and first is None:
            first = (now, done)
        if end and done == end:
            return first[0], first[1], now
        if proc.poll() is not None:
            raise RuntimeError(f"bench features: the stream pipeline ended: {log.read_text()[-2000:]}")
        time.sleep(0.1)
    raise RuntimeError(f"bench features: the stream pipeline did not commit every event in {timeout} s")


def throughput(bootstrap: str, work: Path, raw: str, dataset: str, events: int, aggregated: bool, run: int) -> float:
    """One run: events/s from the first commit to the last (a group of its own on the replayed topic)."""
    out = work / f"run-{'agg' if aggregated else 'plain'}-{run}"
    started = time.monotonic()
    proc, group, _ = _pipeline(bootstrap, raw, dataset, out, aggregated)
    try:
        t0, c0, t1 = _wait_all(bootstrap, raw, group, proc, out / "pipeline.log")
    finally:
        stop_process(proc)
    if c0 >= events:  # all in the first commit (a tiny run): from the start, Prism's start-up included
        t0, c0 = started, 0
    return (events - c0) / max(t1 - t0, 1e-9)


def freshness(bootstrap: str, work: Path, table: Path, dataset: str, rate: float, seconds: float,
              aggregated: bool = True, max_delay: float | None = None) -> np.ndarray:
    """Seconds from each raw event's produce time to its feature row's record time, the pipeline already running
    (``max_delay``: its ``--max-delay``; None: the default)."""
    raw = f"bfraw-fresh-{uuid.uuid4().hex[:6]}"
    replay(bootstrap, raw, table, limit=1)  # the topic, and a first event that tells when the pipeline is up
    out = work / f"fresh-{'agg' if aggregated else 'plain'}-{max_delay or 'default'}"
    proc, group, features = _pipeline(bootstrap, raw, dataset, out, aggregated, max_delay)
    try:
        _wait_all(bootstrap, raw, group, proc, out / "pipeline.log")
        replay(bootstrap, raw, table, rate=rate, skip=1, limit=int(rate * seconds))
        _wait_all(bootstrap, raw, group, proc, out / "pipeline.log")
    finally:
        stop_process(proc)
    c = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, consumer_timeout_ms=3000)
    try:
        produced = {}
        c.assign([TopicPartition(raw, p) for p in sorted(topic_partitions(c, raw))])
        c.seek_to_beginning()
        for m in c:
            produced[(m.partition, m.offset)] = m.timestamp / 1000.0
        produced.pop(min(produced, key=produced.get))  # the readiness probe
        c.assign([TopicPartition(features, p) for p in sorted(topic_partitions(c, features))])
        c.seek_to_beginning()
        out_s = []
        for m in c:
            b = decode_batch(m.value)
            for part, off in zip(b["src_partition"].to_pylist(), b["src_offset"].to_pylist()):
                t = produced.get((part, off))
                if t is not None:
                    out_s.append(m.timestamp / 1000.0 - t)
    finally:
        c.close()
    return np.array(out_s)

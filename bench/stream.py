"""bench stream: the whole streaming job on this machine, on a broker it starts itself.

1. Sustained throughput: with the stream pipeline (Prism) and the online trainer running, N raw
   events replayed as fast as possible; raw events/s from the first event's produce time (Kafka's
   timestamp) until every valid event is trained, counts reconciled (raw events = feature rows +
   dead letters, every feature row trained). Goal >= 10,000 events/s.
2. Latency at fixed rates (2,000 and 8,000 events/s): for every event, the time from its produce
   timestamp to the publish time of the first model version that trained it (from the
   trainer's ledger and the model-updates topic); p50 and p99 (goal at 2,000/s: p99 < 5 s).
3. The trainer's consume rate on the features topic vs a raw kafka-python consumer of the same
   topic (the anchor), in the same run.

``--input FILE`` measures the same on any table instead of the demo (the default dataset preset): its dataset comes from
the batch ETL with the spec given (``--label``, ``--numeric``, ...) or from ``--dataset DIR``, and
the replay is ``flowtrain replay --input FILE`` (the table's rows in file or ``--time-column``
order; the number of events is at most the table's rows).

The replay produces with confluent-kafka when it is installed (``flowtrain replay --client
confluent``; kafka-python's producer alone tops out near the rate measured), so the load
generator is not what is measured.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import numpy as np
from kafka import KafkaConsumer, TopicPartition

from bench.demo import describe
from bench.inputs import Table, add_table_options, table_from_options
from bench.table import report
from bench.timing import MIN_REPEATS, interleaved, median_rows, repeats_note
from connectors.kafka import ensure_topic, topic_partitions
from flowtrain.commands.stream.pipeline import pipeline_totals
from flowtrain.local.kafka import LocalKafka
from flowtrain.local.tools import free_port

CLI = [sys.executable, "-m", "flowtrain.cli"]

#: The streaming job's options in every measurement (besides topics and paths): the defaults
#: but for the raw topic's reader, in lists of records per fetched chunk.
JOB_OPTIONS = ["--read-batch-records", "2000"]
#: Fixed rates of the latency rows (events/s) and how long each replays.
LATENCY_RATES = (2_000, 8_000)
LATENCY_SECONDS = 10.0


def _replay_client() -> str:
    try:
        import confluent_kafka  # noqa: F401
    except ImportError:
        return "kafka-python"
    return "confluent"


def _names() -> dict:
    tag = uuid.uuid4().hex[:6]
    return {"raw": f"raw-{tag}", "features": f"feat-{tag}", "dead": f"dead-{tag}", "updates": f"upd-{tag}",
            "group": f"g-{tag}"}


def _args(bootstrap, names, dataset, out) -> list[str]:
    return ["--bootstrap", bootstrap, "--raw-topic", names["raw"], "--features-topic", names["features"],
            "--dead-letter-topic", names["dead"], "--updates-topic", names["updates"], "--group-id", names["group"],
            "--dataset", dataset, "--out", str(out)]


def _spawn(cmd, log: Path, code: Path | None = None) -> subprocess.Popen:
    """``cmd`` in a session of its own; ``code``: another checkout of flowtrain whose code it runs."""
    env = dict(os.environ, PYTHONPATH=str(code)) if code else None
    return subprocess.Popen(cmd, stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True,
                            env=env, cwd=code)


def stop_process(proc: subprocess.Popen) -> None:
    """Ctrl-C to a bench's streaming process; its group SIGKILLed (and reaped) when it has not ended in 60 s."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _trained_rows(run: Path) -> int:
    try:
        return json.loads((run / "trainer-status.json").read_text())["rows"]
    except (OSError, ValueError, KeyError):
        return 0


def _valid_count(bootstrap, topic) -> int:
    from connectors.arrow import decode_batch

    c = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, consumer_timeout_ms=3000)
    tps = [TopicPartition(topic, p) for p in sorted(topic_partitions(c, topic))]
    c.assign(tps)
    c.seek_to_beginning()
    n = sum(decode_batch(m.value).num_rows for m in c)
    c.close()
    return n


def _run_job(bootstrap, names, dataset, run: Path, *, events: int, rate: float, ckpt_s: float,
             timeout: float = 600, table: Table | None = None, extra: tuple[list[str], list[str]] = ([], []),
             code: Path | None = None, replay_extra: tuple[str, ...] = ()) -> tuple[float, subprocess.Popen,
                                                                                   subprocess.Popen]:
    # The trainer's run directory is its own (a run marker first: it refuses a directory with files it did
    # not write), so the logs lie beside it and the pipeline starts once the trainer has marked it.
    logs = run.with_name(f"{run.name}-logs")
    logs.mkdir(parents=True, exist_ok=True)
    source = [*(table or Table()).replay_args(dataset), *replay_extra]
    subprocess.run(CLI + ["replay", "--bootstrap", bootstrap, "--topic", names["raw"], "--limit", "1",
                          "--partitions", "3", *source], check=True, capture_output=True, timeout=120)  # topic exists
    # the features topic too, as the pipeline makes it (raw's partitions): an older checkout's trainer
    # (--compare-with) refuses to start before it exists
    ensure_topic(bootstrap, names["features"], partitions=3)
    trainer = _spawn(CLI + ["stream", "train", *_args(bootstrap, names, dataset, run), *JOB_OPTIONS, "--ledger",
                            "--checkpoint-every", "1000000", "--checkpoint-seconds", str(ckpt_s), *extra[1]],
                     logs / "trainer.log", code)
    deadline = time.monotonic() + 120
    # run.json: this checkout's marker; trainer-status.json: the first file an older checkout's trainer writes
    while not ((run / "run.json").exists() or (run / "trainer-status.json").exists()):
        if trainer.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"bench stream: the trainer did not start; see {logs / 'trainer.log'}")
        time.sleep(0.2)
    pipeline = _spawn(CLI + ["stream", "pipeline", *_args(bootstrap, names, dataset, run), *JOB_OPTIONS,
                             *extra[0]], logs / "pipeline.log", code)
    time.sleep(8)  # both halves up (Prism start, torch import)
    t0 = time.monotonic()
    replay = _spawn(CLI + ["replay", "--bootstrap", bootstrap, "--topic", names["raw"], "--skip", "1",
                           "--limit", str(events), "--rate", str(rate), "--client", _replay_client(), *source],
                    logs / "replay.log")
    if replay.wait(timeout=timeout) != 0:
        raise RuntimeError(f"bench stream: the replay failed (exit {replay.returncode}); see {logs / 'replay.log'}")
    return t0, pipeline, trainer


def run(out_dir: str | None = "bench/results", events: int = 150_000, latency_seconds: float = LATENCY_SECONDS,
        repeats: int = MIN_REPEATS, table: Table | None = None, metrics_compare: bool = False,
        compare_with: str | None = None, event_format: str | None = None, bootstrap: str | None = None,
        latency_rates: tuple[int, ...] = LATENCY_RATES) -> str:
    """Every measurement ``repeats`` times (whole rounds, so the cases interleave); cells are medians.
    ``bootstrap``: a running broker's (its topics named per round), else each round starts one of its own."""
    table = table or Table()
    rows = table.rows()
    if rows is not None and events > rows - 1:  # one event creates the topic, the rest are measured
        events = rows - 1
    code = Path(compare_with).resolve() if compare_with else None
    if code and not (code / "flowtrain" / "cli").is_dir():
        raise SystemExit(f"bench stream: --compare-with {compare_with}: not a flowtrain checkout (no flowtrain/cli)")
    rounds = interleaved({"round": lambda: _one_round(events, latency_seconds, table, metrics_compare, code,
                                                      event_format, bootstrap, latency_rates)},
                         repeats=repeats)["round"]
    what = f"input {' '.join(table.input)}" if table.input else describe()
    headers = ["measure", "events/rows", "seconds", "per second", "vs anchor"]
    if code:
        return report("stream-compare", headers, median_rows(rounds),
                      notes=[f"Events: {what}. The sustained measurement twice per round, interleaved: the stream "
                             f"pipeline and trainer of {code} (the anchor; PYTHONPATH), then this checkout's, on the "
                             "same broker, dataset and replay. Each cell the "
                             f"{repeats_note(repeats)}."], out_dir=out_dir)
    if event_format:
        return report(f"stream-{event_format}", headers, median_rows(rounds),
                      notes=[f"Events: {what}. The sustained measurement twice per round, interleaved: JSON events "
                             f"(the anchor), then the same events as {event_format} in the Confluent wire format "
                             "(`replay` and `stream pipeline --event-format "
                             f"{event_format} --schema-registry`, a local Apicurio Registry). Goal: >= 0.9 x JSON. "
                             f"Each cell the {repeats_note(repeats)}."], out_dir=out_dir)
    if metrics_compare:
        return report("stream-metrics", headers, median_rows(rounds),
                      notes=[f"Events: {what}. The sustained measurement twice per round, interleaved: both halves "
                             "without --metrics-port (the anchor), then both serving /metrics and the status page "
                             "(--metrics-port), each scraped once a second. Goal: on >= 0.95 x off. Each cell the "
                             f"{repeats_note(repeats)}."], out_dir=out_dir)
    return report("stream-input" if table.input else "stream", headers, median_rows(rounds),
                  notes=[f"Events: {what}. One broker, Prism, 2 cores shared by broker, replay, pipeline and trainer. "
                         "Job options: the "
                         f"defaults and {' '.join(JOB_OPTIONS)}; replay client: {_replay_client()}. Sustained: from "
                         "the first event's produce time until every feature row is trained (raw events = feature "
                         "rows + unlabelled + dead letters checked); goal >= 10,000 events/s. Latency: from each "
                         "event's produce "
                         "timestamp to the publish time of the first model version that trained it (checkpoint "
                         f"and publish every 1 s), {latency_seconds:g} s of events at each rate; goal p99 < 5 s at "
                         f"2,000 events/s. Each cell the {repeats_note(repeats)} (a round runs every measurement "
                         f"once, on {'the broker at ' + bootstrap if bootstrap else 'a broker of its own'})."],
                  out_dir=out_dir)


def _sustained(bootstrap, dataset, run1: Path, events: int, table: Table, *, metrics: bool = False,
               code: Path | None = None, formats: tuple[str, ...] = ()) -> tuple[dict, float]:
    """``events`` replayed as fast as possible through both halves until every feature row is trained;
    (topic names, seconds from the first event's produce time). ``metrics``: both halves serve
    ``/metrics`` (``--metrics-port``), scraped every second as Prometheus would. ``code``: the halves
    run another checkout's flowtrain (the replay is this one's). ``formats``: --event-format options of the
    replay and the pipeline."""
    names = _names()
    ports = (free_port(), free_port()) if metrics else None
    extra = ([f"--metrics-port={ports[0]}"], [f"--metrics-port={ports[1]}"]) if ports else ([], [])
    extra = ([*extra[0], *formats], extra[1])
    scraped = {"n": 0}
    stop_scraping = threading.Event()

    def scrape() -> None:
        while not stop_scraping.wait(1.0):
            for port in ports:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                        resp.read()
                    scraped["n"] += 1
                except OSError:
                    pass  # not up yet

    scraper = threading.Thread(target=scrape, daemon=True) if ports else None
    if scraper:
        scraper.start()
    try:
        _, pipeline, trainer = _run_job(bootstrap, names, dataset, run1, events=events, rate=0, ckpt_s=5,
                                        table=table, extra=extra, code=code, replay_extra=formats)
        deadline = time.monotonic() + 600
        valid = None
        while time.monotonic() < deadline:
            done, end = _committed(bootstrap, names)
            if end >= events + 1 and done == end:
                valid = valid or _valid_count(bootstrap, names["features"])
                if _trained_rows(run1) >= valid:
                    break
            time.sleep(0.25)
        finished = time.time()
        stop_process(trainer)
        stop_process(pipeline)
    finally:
        stop_scraping.set()
    if ports and not scraped["n"]:
        raise RuntimeError(f"bench stream: /metrics was never scraped on ports {ports}; see {run1}")
    if valid is None or _trained_rows(run1) < valid:
        raise RuntimeError(f"bench stream: the job did not train every feature row within 600 s (see {run1})")
    totals = pipeline_totals(run1)
    if totals["events"] != events + 1 or totals["rows"] + totals["unlabelled"] + totals["dead_letters"] \
            != totals["events"] or totals["rows"] != valid:
        raise RuntimeError(f"bench stream: counts do not reconcile: {totals}, {valid:,} feature rows on the topic, "
                           f"{events + 1:,} raw events")
    return names, finished - _first_produced(bootstrap, names)


def _one_round(events: int, latency_seconds: float = LATENCY_SECONDS, table: Table | None = None,
               metrics_compare: bool = False, compare_with: Path | None = None,
               event_format: str | None = None, bootstrap: str | None = None,
               latency_rates: tuple[int, ...] = LATENCY_RATES) -> list[tuple]:
    table = table or Table()
    work = Path(tempfile.mkdtemp(prefix="flowtrain-bench-stream-"))
    broker = None
    if bootstrap is None:  # a broker of the round's own
        broker = LocalKafka(port=free_port(), data_dir=work / "kafka")
        broker.start(quiet=True)
        bootstrap = broker.bootstrap
    rows = []
    try:
        dataset = table.make_dataset(work)
        # --- 1. sustained throughput ----------------------------------------------------------
        if compare_with:  # the anchor: the halves of another checkout (an earlier release) on the same events
            old = _sustained(bootstrap, dataset, work / "anchor", events, table, code=compare_with)
            new = _sustained(bootstrap, dataset, work / "this", events, table)
            rows.append((f"sustained, {compare_with} (anchor)", events, old[1], events / old[1], 1.0))
            rows.append(("sustained, this checkout", events, new[1], events / new[1], old[1] / new[1]))
        elif event_format:  # the anchor (JSON events) and the same events in --event-format with a registry
            rows += _formats_compare(bootstrap, dataset, work, events, table, event_format)
        elif metrics_compare:  # the anchor (no --metrics-port) and the same job serving /metrics, scraped
            off = _sustained(bootstrap, dataset, work / "metrics-off", events, table)
            on = _sustained(bootstrap, dataset, work / "metrics-on", events, table, metrics=True)
            rows.append(("sustained, metrics off (anchor)", events, off[1], events / off[1], 1.0))
            rows.append(("sustained, --metrics-port on both halves, scraped every 1 s", events, on[1],
                         events / on[1], off[1] / on[1]))
        else:
            rows += _whole_job(bootstrap, dataset, work, events, latency_seconds, table, latency_rates)
    finally:
        from connectors.kafka import close_all_clients

        close_all_clients()
        if broker is not None:
            broker.stop(quiet=True)
    shutil.rmtree(work, ignore_errors=True)  # kept only when the round failed (logs, broker data)
    return rows


def _formats_compare(bootstrap, dataset, work: Path, events: int, table: Table, event_format: str) -> list[tuple]:
    """The sustained measurement on JSON events (the anchor), then on the same events in ``event_format`` in the
    Schema Registry's wire format (a local Apicurio Registry of the round's own)."""
    from flowtrain.local.registry import LocalRegistry

    registry = LocalRegistry(port=free_port(), data_dir=work / "registry")
    registry.start(quiet=True)
    try:
        old = _sustained(bootstrap, dataset, work / "json", events, table)
        new = _sustained(bootstrap, dataset, work / event_format, events, table,
                         formats=("--event-format", event_format, "--schema-registry", registry.url))
    finally:
        registry.stop(quiet=True)
    return [("sustained, JSON events (anchor)", events, old[1], events / old[1], 1.0),
            (f"sustained, {event_format} events with the registry", events, new[1], events / new[1],
             old[1] / new[1])]


def _whole_job(bootstrap, dataset, work: Path, events: int, latency_seconds: float, table: Table,
               latency_rates: tuple[int, ...] = LATENCY_RATES) -> list[tuple]:
    """Sustained throughput, the trainer's consume rate, latency at fixed rates: the rows of a round."""
    rows = []
    names, took = _sustained(bootstrap, dataset, work / "throughput", events, table)
    valid = _valid_count(bootstrap, names["features"])
    rows.append(("sustained, whole job (replay -> pipeline -> trainer)", events, took, events / took, ""))

    # --- 3. trainer consume rate vs a raw consumer of the same features topic --------------
    raw_t = time.monotonic()
    c = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, consumer_timeout_ms=2000,
                      max_partition_fetch_bytes=16 * 1024 * 1024)
    tps = [TopicPartition(names["features"], p) for p in sorted(topic_partitions(c, names["features"]))]
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

    # --- 2. latency at fixed rates ---------------------------------------------------------
    for rate in latency_rates:
        names2 = _names()
        run2 = work / f"latency-{rate}"
        n = min(int(rate * latency_seconds), events)
        _, pipeline, trainer = _run_job(bootstrap, names2, dataset, run2, events=n, rate=rate, ckpt_s=1.0,
                                        table=table)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            done, end = _committed(bootstrap, names2)
            if end >= n + 1 and done == end:
                break
            time.sleep(0.5)
        else:
            raise RuntimeError(f"bench stream: the job did not catch up with {n:,} events at {rate:,}/s in 300 s; "
                               f"see {run2}")
        valid = _valid_count(bootstrap, names2["features"])
        while time.monotonic() < deadline and _trained_rows(run2) < valid:  # the trainer has them all
            time.sleep(0.5)
        time.sleep(4)  # the last checkpoint publishes
        stop_process(trainer)
        stop_process(pipeline)
        lat = _latencies(bootstrap, names2, run2)
        if len(lat) != valid:  # percentiles of a partial sample would drop the slow tail
            raise RuntimeError(f"bench stream: {len(lat):,} of {valid:,} feature rows reached a published model "
                               f"at {rate:,}/s; see {run2}")
        for q in (50, 99):
            rows.append((f"latency at {rate:,} events/s: produce -> published model (p{q})", len(lat),
                         float(np.percentile(lat, q)), "", ""))
    return rows


def _first_produced(bootstrap, names) -> float:
    """The produce time of the first replayed event (the topic's first event only creates it)."""
    c = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, consumer_timeout_ms=2000)
    try:
        tps = [TopicPartition(names["raw"], p) for p in sorted(topic_partitions(c, names["raw"]))]
        c.assign(tps)
        c.seek_to_beginning()
        first: list[float] = []
        for tp in tps:  # the first two records of each partition hold the two earliest times
            c.assign([tp])
            c.seek_to_beginning(tp)
            got = c.poll(timeout_ms=2000, max_records=2).get(tp, [])
            first += [m.timestamp / 1000.0 for m in got]
        return sorted(first)[1]
    finally:
        c.close()


def _committed(bootstrap, names) -> tuple[int, int]:
    c = KafkaConsumer(bootstrap_servers=bootstrap, group_id=names["group"], enable_auto_commit=False)
    try:
        tps = [TopicPartition(names["raw"], p) for p in sorted(topic_partitions(c, names["raw"]))]
        ends = c.end_offsets(tps)
        return sum(c.committed(tp) or 0 for tp in tps), sum(ends.values())
    finally:
        c.close()


def _latencies(bootstrap, names, run: Path) -> np.ndarray:
    c = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, consumer_timeout_ms=3000)
    produced: dict[tuple[int, int], float] = {}
    tps = [TopicPartition(names["raw"], p) for p in sorted(topic_partitions(c, names["raw"]))]
    c.assign(tps)
    c.seek_to_beginning()
    for m in c:
        produced[(m.partition, m.offset)] = m.timestamp / 1000.0
    up = [TopicPartition(names["updates"], p) for p in sorted(topic_partitions(c, names["updates"]))]
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
    ap.add_argument("--events", type=int, default=150_000, help="events of the sustained measurement")
    ap.add_argument("--latency-seconds", type=float, default=LATENCY_SECONDS,
                    help="seconds of events replayed at each latency row's rate")
    ap.add_argument("--repeats", type=int, default=MIN_REPEATS, help="rounds of every measurement (>= 3); medians")
    ap.add_argument("--out-dir", default="bench/results", help="where the table is written (default bench/results)")
    ap.add_argument("--metrics-compare", action="store_true",
                    help="only the sustained measurement, without and with --metrics-port (scraped every 1 s)")
    ap.add_argument("--compare-with", metavar="CHECKOUT", default=None,
                    help="only the sustained measurement, the halves of another flowtrain checkout (e.g. a `git "
                         "worktree` of the previous release) against this one's")
    ap.add_argument("--event-format", choices=("avro", "protobuf"), default=None,
                    help="only the sustained measurement, JSON events against the same events in this format with a "
                         "local Schema Registry (Apicurio)")
    ap.add_argument("--latency-rates", default=",".join(map(str, LATENCY_RATES)),
                    help="comma-separated events/s of the latency rows (default 2000,8000)")
    ap.add_argument("--bootstrap", default=None, help="a running broker to use (default: each round starts its own)")
    add_table_options(ap, "replay this table (CSV, Parquet, JSON lines)")
    a = ap.parse_args(argv)
    rates = tuple(int(r) for r in a.latency_rates.split(",") if r.strip())
    if not rates or min(rates) < 1:
        raise SystemExit(f"--latency-rates {a.latency_rates!r}: give events/s >= 1, e.g. 2000,8000")
    run(out_dir=a.out_dir, events=a.events, latency_seconds=a.latency_seconds, repeats=a.repeats,
        table=table_from_options(ap, a), metrics_compare=a.metrics_compare, compare_with=a.compare_with,
        event_format=a.event_format, bootstrap=a.bootstrap, latency_rates=rates)


if __name__ == "__main__":
    main()

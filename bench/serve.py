"""bench serve: the scoring pipeline (Beam RunInference on Prism) on a broker it starts itself.

The demo (the default dataset preset) by default; ``--input FILE`` (with ``--dataset DIR`` or the spec: ``--label``,
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
3. Freshness, in the same run, as users feel it: a new model version published every 5 s; for each, the time
   from its publication (its record's timestamp on the updates topic) until >= 99% of the predictions made from
   then on carry it (or a newer one); p50 and p99 over the versions (goal p99 <= 5 s); and the share of the
   predictions made more than 5 s after a newer version's publication that carry a superseded one (goal < 1%).
   (Until issue #42 this measured the time to the *first* predictions message with the version: a version that
   reached one micro-batch passed, while most predictions kept an old one.)
Each cell is the median of the rounds (>= 3, interleaved: a round runs every measurement once).

``--drift-compare``: only (1), with drift monitoring on (``--drift-window 2000``) and off (``0``), interleaved
(goal: on >= 0.9x off). ``--drift-micro``: in one process, no broker: the CPU time drift monitoring adds per
event (``pipelines.serving.drift.DriftReporter``) against the scorer's own per-event work on the same events.
"""
from __future__ import annotations

import argparse
import json
import threading
import time
import uuid

import numpy as np
import torch

from bench.demo import describe
from bench.inputs import add_table_options, table_from_options
from bench.serve_env import (
    ServeEnv,
    make_topics,
    model_of,
    produce,
    publish,
    read_topic,
    start_scorer,
    stop,
    topic_names,
    wait_all,
)
from bench.table import report
from bench.timing import MIN_REPEATS, interleaved, median, median_rows, repeats_note
from connectors.dataset_spec import LABEL
from flowtrain.train.loader import TabularDataset
from pipelines.drift.profile import read_train_sample, reference_profile
from pipelines.serving.config import ScoreConfig
from pipelines.serving.drift import DriftConfig, DriftReporter


# --- 1. throughput ----------------------------------------------------------------------------------
def _pipeline_throughput(env: ServeEnv, extra: tuple[str, ...] = ()) -> dict:
    names, work = topic_names(), env.work / f"tp-{uuid.uuid4().hex[:6]}"
    make_topics(env, names)
    publish(env, names, 1, work)
    n = env.n_throughput
    produce(env, names["raw"], env.events[:n])
    t0 = time.monotonic()
    proc = start_scorer(env, names, work, extra)
    try:
        msgs = wait_all(env, names, n, proc, work / "scorer.log")
        whole = time.monotonic() - t0
    finally:
        stop(proc)
    rows = sum(b.num_rows for _, b in msgs)
    times = np.concatenate([b.column("pred_scoring_time").cast("int64").to_numpy() for _, b in msgs]) / 1000.0
    span = float(times.max() - times.min())
    return {"rows": rows, "events": n, "span": span, "whole": whole}


def _feature_batches(env: ServeEnv) -> tuple[list, list]:
    """The throughput run's events as the scorer micro-batches them (ScoreConfig.score_batch_size per partition), featurized
    with the same code; and the raw records, for the plain-Python reference."""
    from connectors.kafka import KafkaRecord
    from pipelines.serving.featurize import featurize_records

    featurizer = env.featurizer()
    records = [KafkaRecord("raw", 0, i, 0, None, v) for i, v in enumerate(env.events[:env.n_throughput])]
    size = ScoreConfig.score_batch_size  # as the scorer micro-batches them
    chunks = [records[i:i + size] for i in range(0, len(records), size)]
    return [featurize_records(c, featurizer)[0] for c in chunks], [(c, featurizer) for c in chunks]


def _forward_loop(batches, model, spec) -> tuple[int, float]:
    """Anchor: per feature batch, Arrow columns -> tensors -> forward -> sigmoid/softmax (or the value)."""
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
#: Freshness: the share of the predictions made after a version's publication that must carry it (or a newer one).
FRESH_SHARE = 0.99
#: ... and how long after its successor's publication a superseded version counts against the scorer.
SUPERSEDED_AFTER_S = 5.0


def freshness(made: list[tuple[float, int]], published: dict[int, float], *, share: float = FRESH_SHARE,
              after_s: float = SUPERSEDED_AFTER_S) -> dict:
    """Freshness as users feel it, from the predictions (``made``: (when it reached the predictions topic, s; the
    version it carries)) and the publications (``published``: version -> when its record was written, s).

    For each version v after the first: the time from its publication until at least ``share`` of the
    predictions made from then on (up to the next publication) carry v or a newer one (None: never within its
    time); and over all of them, the share of predictions made more than ``after_s`` after a newer version's
    publication that carry a superseded one."""
    made = sorted(made)
    order = sorted(published, key=published.get)
    until = {v: (published[order[i + 1]] if i + 1 < len(order) else float("inf")) for i, v in enumerate(order)}
    at = np.array([t for t, _ in made], dtype=np.float64)
    got = np.array([v for _, v in made], dtype=np.int64)
    times = {}
    for v in order[1:]:
        inside = (at >= published[v]) & (at < until[v])
        t, ok = at[inside], got[inside] >= v
        # the first moment from which on >= share of the predictions carry v or a newer one
        fine = np.nonzero(np.cumsum(ok[::-1])[::-1] >= share * np.arange(len(t), 0, -1))[0]
        times[v] = float(t[fine[0]] - published[v]) if len(fine) else None
    checked = superseded = 0
    for t, got in made:
        due = [v for v in order if published[v] + after_s <= t]
        if due and due[-1] != order[0]:
            checked += 1
            superseded += got < due[-1]
    return {"times": times, "checked": checked, "superseded": superseded,
            "superseded_share": superseded / checked if checked else 0.0}


def _latency_and_freshness(env: ServeEnv, publish_every_s: float = 5.0) -> dict:
    names, work = topic_names(), env.work / f"lat-{uuid.uuid4().hex[:6]}"
    make_topics(env, names)
    publish(env, names, 1, work)
    proc = start_scorer(env, names, work)
    warm = env.events[env.n_throughput:env.n_throughput + 200]
    try:
        produce(env, names["raw"], warm)  # wait until the scorer runs
        wait_all(env, names, len(warm), proc, work / "scorer.log")
        stream = env.events[env.n_throughput + 200:env.n_throughput + 200 + int(env.rate * env.seconds)]
        stop_publishing = threading.Event()

        def publisher():
            version = 1
            while not stop_publishing.wait(publish_every_s):
                version += 1
                publish(env, names, version, work)

        t = threading.Thread(target=publisher, daemon=True)
        t.start()
        t_start = time.time()
        produce(env, names["raw"], stream, rate=env.rate)
        stop_publishing.set()
        t.join()
        msgs = wait_all(env, names, len(warm) + len(stream), proc, work / "scorer.log")
    finally:
        stop(proc)
    lat, made = [], []
    for m, b in msgs:
        event_ms = b.column("pred_event_time").cast("int64").to_numpy()
        steady = event_ms >= (t_start + 2.0) * 1000  # after the first seconds at the rate
        lat.append((m.timestamp - event_ms[steady]) / 1000.0)
        made += [(m.timestamp / 1000.0, int(v)) for v in b.column("pred_model_version").to_pylist()]
    published = {json.loads(m.value)["version"]: m.timestamp / 1000.0
                 for m in read_topic(env.bootstrap, names["updates"])}
    fresh = freshness(made, published)
    never = [v for v, t in fresh["times"].items() if t is None]
    return {"latency": np.concatenate(lat), "fresh": np.array([t for t in fresh["times"].values() if t is not None]),
            "versions": len(published) - 1, "never": never, "superseded_share": fresh["superseded_share"],
            "checked": fresh["checked"]}


#: A percentile cell with nothing to take it of (e.g. a run shorter than the first 2 s left out of the latency).
NO_SAMPLES = "no samples"


def _percentile(values: np.ndarray, q: float) -> float | str:
    return float(np.percentile(values, q)) if len(values) else NO_SAMPLES


def _one_round(env: ServeEnv) -> list[tuple]:
    torch.set_num_threads(1)  # as the scorer runs its forward (ScoreConfig.torch_threads)
    spec = TabularDataset(env.dataset).spec
    model = model_of(env, 1)
    batches, chunks = _feature_batches(env)
    anchor_rows, anchor_s = _forward_loop(batches, model, spec)
    loop_rows, loop_s = _python_loop(chunks, model, spec)
    tp = _pipeline_throughput(env)
    lf = _latency_and_freshness(env, env.publish_every_s)
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
         _percentile(lf["latency"], 50), "", ""),
        (f"latency at {env.rate:,.0f} events/s: produce -> prediction (p99)", len(lf["latency"]),
         _percentile(lf["latency"], 99), "", ""),
        (f"freshness: publish -> {FRESH_SHARE:.0%} of predictions carry it (p50 over versions)", lf["versions"],
         _percentile(lf["fresh"], 50), "", ""),
        (f"freshness: publish -> {FRESH_SHARE:.0%} of predictions carry it (p99 over versions)", lf["versions"],
         _percentile(lf["fresh"], 99), "", ""),
        ("versions never reaching it before the next publication", lf["versions"], float(len(lf["never"])), "", ""),
        (f"predictions with a superseded version > {SUPERSEDED_AFTER_S:g} s after its successor (share)",
         lf["checked"], lf["superseded_share"], "", ""),
    ]


def run(out_dir: str | None = "bench/results", events: int = 30_000, rate: float = 2000.0, seconds: float = 20.0,
        repeats: int = MIN_REPEATS, table=None, bootstrap: str | None = None, publish_every_s: float = 5.0) -> str:
    """``bootstrap``: a running broker's (topics named per measurement), else one of its own."""
    env = ServeEnv(events, rate, seconds, table, bootstrap=bootstrap, publish_every_s=publish_every_s)
    try:
        rounds = interleaved({"round": lambda: _one_round(env)}, repeats=repeats,
                             on_run=lambda _c, r, _res: print(f"bench serve: round {r + 1} done", flush=True))["round"]
    finally:
        env.close()
    what = f"input {' '.join(env.table.input)}" if env.table.input else describe()
    return report("serve-input" if env.table.input else "serve",
                  ["measure", "rows/events/versions", "seconds (or share)", "per second", "vs anchor"],
                  median_rows(rounds), out_dir=out_dir, notes=[
                      f"Events: {what}. One broker, Prism, the machine's cores shared by the broker, the scorer and "
                      f"the producer; torch with 1 thread in (a), (b) and the scorer; versions signed and "
                      f"authenticated (--update-key-file). (c): rows / "
                      f"(last - first pred_scoring_time), {events:,} events already in the topic. Latency: each event's "
                      f"produce timestamp to its predictions message's timestamp, events produced at {rate:,.0f}/s "
                      f"for {seconds:g} s (the first 2 s left out). Freshness: a version published every {publish_every_s:g} s "
                      f"during that run; its record's timestamp until >= 99% of the predictions made from then on "
                      f"(until the next publication) carry it or a newer one; superseded: the predictions made "
                      f"more than 5 s after a newer version's publication that carry an older one. "
                      f"Goals: (c) >= 10,000 events/s, latency p99 < 2 s, freshness p99 <= 5 s, superseded "
                      f"< 1%. "
                      f"Each cell the {repeats_note(repeats)}."])


def run_drift_compare(out_dir: str | None = "bench/results", events: int = 10_000, repeats: int = MIN_REPEATS,
                      table=None) -> str:
    """Throughput (c) with drift monitoring on (``--drift-window`` 2,000, the default) and off (``0``), interleaved:
    goal on >= 0.9x off."""
    env = ServeEnv(events, 0.0, 0.0, table)
    cases = {"off": lambda: _pipeline_throughput(env, ("--drift-window", "0")),
             "on": lambda: _pipeline_throughput(env, ("--drift-window", "2000"))}
    try:
        runs = interleaved(cases, repeats=repeats,
                           on_run=lambda c, r, res: print(f"bench serve: drift {c}, round {r + 1}: "
                                                          f"{res['rows'] / res['span']:,.0f} predictions/s", flush=True))
    finally:
        env.close()
    rate = {c: sorted(r["rows"] / r["span"] for r in rs)[len(rs) // 2] for c, rs in runs.items()}
    rows = [(f"scoring pipeline, drift monitoring {c}", runs[c][0]["rows"], "", rate[c], rate[c] / rate["off"])
            for c in ("off", "on")]
    what = f"input {' '.join(env.table.input)}" if env.table.input else describe()
    return report("serve-drift", ["measure", "events", "", "predictions per second", "vs off"], rows,
                  out_dir=out_dir, notes=[
                      f"Events: {what}, {events:,} already in the topic; predictions/s from the first to the last "
                      f"prediction (scoring_time). On: --drift-window 2000 (every micro-batch counted into the "
                      f"reference's buckets, the window's counts to the status file); off: --drift-window 0. "
                      f"Goal: on >= 0.9x off. Each cell the {repeats_note(repeats)}."])


def _drift_cost(env: ServeEnv, batches: list, profile: dict, size: int, classification: bool) -> tuple[int, float]:
    """(events, CPU seconds) of drift monitoring as the scorer does it: each micro-batch of ``size`` events given
    to a ``DriftReporter`` (its thread writing the status file), closed at the end (its last window written)."""
    rng = np.random.default_rng(0)
    parts = [f.slice(i, size) for f in batches for i in range(0, f.num_rows, size)]
    given = [(f, f.column(LABEL).to_numpy(zero_copy_only=False).astype(np.float64) if LABEL in f.schema.names
              else None, rng.random(f.num_rows), (rng.random(f.num_rows) < 0.2).astype(np.float64)) for f in parts]
    status = env.work / f"drift-{uuid.uuid4().hex[:6]}" / "score-status.json"
    status.parent.mkdir()
    reporter = DriftReporter(DriftConfig(profile=profile, window=2000), classification=classification,
                             status_path=str(status))
    t0 = time.process_time()
    for features, label, scores, wrong in given:
        reporter.add(features, label, scores, wrong[np.isfinite(label)] if label is not None else None)
    reporter.close()
    return sum(f.num_rows for f in parts), time.process_time() - t0


def run_drift_micro(out_dir: str | None = "bench/results", events: int = 30_000, repeats: int = MIN_REPEATS,
                    table=None) -> str:
    """In-process, no broker: the CPU time drift monitoring adds per event (counting each micro-batch into the
    window, the reporter's status writes) against the CPU time of the scorer's own per-event work on the same
    events (parse + featurize + forward, the plain Python loop (b) of ``run``), interleaved."""
    torch.set_num_threads(1)  # as the scorer runs its forward
    env = ServeEnv(events, 0.0, 0.0, table, broker=False)
    try:
        data = TabularDataset(env.dataset)
        profile = reference_profile(read_train_sample(env.dataset, data.spec), data.spec, data.stats,
                                    classes=data.classes)  # as the scorer makes it without --drift-reference
        model = model_of(env, 1)
        batches, chunks = _feature_batches(env)
        features = [b.features for b in batches if b.features is not None and b.features.num_rows]
        classification = data.spec.task == "classification"

        def scorer():
            t0 = time.process_time()
            rows, _ = _python_loop(chunks, model, data.spec)
            return rows, time.process_time() - t0

        sizes = (ScoreConfig.score_batch_size, 500)
        cases = {"scorer": scorer, **{f"drift {n}": (lambda n=n: _drift_cost(env, features, profile, n,
                                                                               classification)) for n in sizes}}
        runs = interleaved(cases, repeats=repeats, on_run=lambda c, r, res: print(
            f"bench serve: {c}, round {r + 1}: {res[1] / res[0] * 1e6:.2f} us per event", flush=True))
    finally:
        env.close()
    per_event = {c: median(rs, key=lambda r: r[1] / r[0] * 1e6) for c, rs in runs.items()}
    rows = [("the scorer's own work: parse + featurize + forward (plain Python loop)", runs["scorer"][0][0],
             per_event["scorer"], 1.0)]
    rows += [(f"drift monitoring, micro-batches of {n:,} events", runs[f"drift {n}"][0][0], per_event[f"drift {n}"],
              per_event[f"drift {n}"] / per_event["scorer"]) for n in sizes]
    what = f"input {' '.join(env.table.input)}" if env.table.input else describe()
    return report("serve-drift-micro", ["measure", "events", "CPU us per event", "vs the scorer's work"], rows,
                  out_dir=out_dir, notes=[
                      f"In one process, no broker, no runner: {what}, {events:,} events featurized as the scorer "
                      f"micro-batches them. Drift: each micro-batch counted into the window of a DriftReporter "
                      f"(--drift-window 2000, the reference made from the dataset's training split as the scorer "
                      f"makes it, the first window's scores as the score reference), its status file written by "
                      f"its thread at most once a second, closed at the end. Process CPU time (both threads). "
                      f"Each cell the {repeats_note(repeats)}."])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=30_000, help="events for the throughput run (default 30,000)")
    ap.add_argument("--rate", type=float, default=2000.0, help="events/s for latency and freshness (default 2,000)")
    ap.add_argument("--seconds", type=float, default=20.0, help="how long events are produced at --rate (default 20)")
    ap.add_argument("--repeats", type=int, default=MIN_REPEATS, help="rounds of every measurement (>= 3); medians")
    ap.add_argument("--out-dir", default="bench/results", help="where the table is written (default bench/results)")
    ap.add_argument("--publish-every", type=float, default=5.0, help="seconds between the versions published during "
                    "the latency run (default 5)")
    ap.add_argument("--bootstrap", default=None, help="a running broker to use (default: one of its own)")
    add_table_options(ap, "score this table's rows (CSV, Parquet, JSON lines)")
    ap.add_argument("--drift-compare", action="store_true", help="only the throughput, with drift monitoring on "
                    "and off (interleaved; goal on >= 0.9x off)")
    ap.add_argument("--drift-micro", action="store_true", help="in one process, no broker: the CPU time drift "
                    "monitoring adds per event vs the scorer's own per-event work")
    a = ap.parse_args(argv)
    if a.drift_micro:
        run_drift_micro(out_dir=a.out_dir, events=a.events, repeats=a.repeats, table=table_from_options(ap, a))
        return
    if a.drift_compare:
        run_drift_compare(out_dir=a.out_dir, events=a.events, repeats=a.repeats, table=table_from_options(ap, a))
        return
    run(out_dir=a.out_dir, events=a.events, rate=a.rate, seconds=a.seconds, repeats=a.repeats,
        table=table_from_options(ap, a), bootstrap=a.bootstrap, publish_every_s=a.publish_every)


if __name__ == "__main__":
    main()

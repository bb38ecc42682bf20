"""bench features: the backfill of features over time (``flowtrain features``, Beam FnApiRunner) against a
straightforward pandas implementation (groupby + time-based rolling, closed='left', and merge_asof) and DuckDB's
window functions (RANGE frames, ASOF JOIN) as the single-machine anchor; state bytes per key; test AUC with and
without the aggregates and joins.

The data: ``pipelines.features.transactions`` (``--events`` payments, default 1,000,000, over 60 days; cards at
heavy-tailed rates; merchants' versioned risk tiers) as one Parquet file. The features: 4 windows x 5
aggregations of the amount per card (``card:amount:count,sum,mean,max,std:10m,1h,1d,30d``) and the merchant's tier
as of each payment (``--join merchants:merchant:valid_from``). Each engine reads the Parquet file and writes the
input's rows in their order with the 20 aggregates and the joined column to a Parquet file: rows/s is input rows
over that whole run. Cases are interleaved (each engine once per repeat); cells are medians.

State: the core's states after the whole data (``pipelines.features.state.encode_state``), bytes per card (mean,
p50, p99, max) and per card and window; and at ``--keys`` keys (default 1,000,000, two payments each): the states'
bytes, and the process's RSS growth holding them as Python objects.

AUC: ``flowtrain batch`` on the generated payments (``--auc-events``) with ``amount`` and ``category`` as features,
without and with the aggregates and the join (the same run otherwise), the test split's AUC of the fraud label.

Stream: the stream pipeline's events/s with the 4 x 5 aggregations against without, and the freshness of its
feature rows at ``--freshness-rate`` events/s (``bench.features_stream``; on ``--bootstrap``'s broker, else one it
starts).
"""
from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import duckdb
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

import flowtrain
from bench import features_stream
from bench.table import report
from bench.timing import MIN_REPEATS, check_repeats, interleaved, median, repeats_note
from connectors.kafka import close_all_clients
from flowtrain.local.kafka import LocalKafka
from flowtrain.local.runners import pipeline_options
from flowtrain.local.tools import free_port
from pipelines.features.backfill import run_backfill
from pipelines.features.columns import encode_keys
from pipelines.features.core import KeyFeatures
from pipelines.features.declare import declare
from pipelines.features.state import encode_state
from pipelines.features.transactions import generate_transactions

WINDOWS = {"10m": 600, "1h": 3600, "1d": 86400, "30d": 30 * 86400}
AGGS = ("count", "sum", "mean", "max", "std")
FRESH_MAX_DELAY = 0.2  # the freshness rows' second setting: --max-delay 0.2 (issue 47: p99 <= 1 s at 2,000 events/s)
AGGREGATE = f"card:amount:{','.join(AGGS)}:{','.join(WINDOWS)}"


def _rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


# --- the three engines -------------------------------------------------------------------------------------
def run_flowtrain(work: Path, txns: Path, merchants: Path) -> float:
    out = work / "flowtrain.parquet"
    t0 = time.perf_counter()
    counts = run_backfill([str(txns)], declare([AGGREGATE], [f"{merchants}:merchant:valid_from"]),
                          time_column="time", time_format=None, out=str(out), options=pipeline_options("batch"),
                          overwrite=True)
    seconds = time.perf_counter() - t0
    assert counts["rows_out"] == pq.ParquetFile(txns).metadata.num_rows, counts
    return seconds


def run_pandas(work: Path, txns: Path, merchants: Path) -> float:
    """groupby(card).rolling(w, closed='left') per window and aggregation, merge_asof, back in input order."""
    t0 = time.perf_counter()
    df = pd.read_parquet(txns)
    df["_i"] = np.arange(len(df))
    frame = df[["card", "time", "amount", "_i"]].assign(ts=pd.to_datetime(df["time"], unit="s"))
    frame = frame.sort_values(["card", "ts", "_i"], kind="stable").set_index("ts")
    rolled = frame.groupby("card")["amount"]
    order = frame["_i"].to_numpy()
    for w, seconds in WINDOWS.items():
        r = rolled.rolling(f"{seconds}s", closed="left")
        for agg in AGGS:
            values = (r.std(ddof=0) if agg == "std" else getattr(r, agg)()).to_numpy()
            col = np.empty(len(df))
            col[order] = values
            if agg in ("count", "sum"):
                col = np.nan_to_num(col)
            df[f"card_amount_{agg}_{w}"] = col.astype(np.int64) if agg == "count" else col
    m = pd.read_parquet(merchants).rename(columns={"risk_tier": "merchant_risk_tier"}).sort_values("valid_from")
    joined = pd.merge_asof(df[["_i", "time", "merchant"]].sort_values("time"), m, left_on="time",
                           right_on="valid_from", by="merchant", direction="backward").sort_values("_i")
    df["merchant_risk_tier"] = joined["merchant_risk_tier"].to_numpy()
    df.drop(columns="_i").to_parquet(work / "pandas.parquet")
    return time.perf_counter() - t0


def run_duckdb(work: Path, txns: Path, merchants: Path) -> float:
    """Window functions over RANGE frames [t - w, t - 1] (whole seconds: [t - w, t)), ASOF LEFT JOIN."""
    t0 = time.perf_counter()
    windows = ", ".join(f"w{w} AS (PARTITION BY card ORDER BY time RANGE BETWEEN {s} PRECEDING AND 1 PRECEDING)"
                        for w, s in WINDOWS.items())
    fn = {"count": "count(amount) OVER {w}", "sum": "coalesce(sum(amount) OVER {w}, 0)", "mean": "avg(amount) OVER {w}",
          "max": "max(amount) OVER {w}", "std": "stddev_pop(amount) OVER {w}"}
    cols = ", ".join(f"{fn[a].format(w='w' + w)} AS card_amount_{a}_{w}" for w in WINDOWS for a in AGGS)
    con = duckdb.connect()
    con.execute(f"""
        COPY (
          WITH t AS (SELECT *, row_number() OVER () AS _i FROM read_parquet('{txns}')),
               f AS (SELECT *, {cols} FROM t WINDOW {windows})
          SELECT f.* EXCLUDE (_i), m.risk_tier AS merchant_risk_tier
          FROM f ASOF LEFT JOIN read_parquet('{merchants}') m
            ON f.merchant = m.merchant AND f.time >= m.valid_from
          ORDER BY f._i
        ) TO '{work / "duckdb.parquet"}' (FORMAT parquet)""")
    con.close()
    return time.perf_counter() - t0


ENGINES = {"flowtrain features (Beam FnApiRunner)": run_flowtrain, "pandas groupby rolling + merge_asof": run_pandas,
           "DuckDB window RANGE + ASOF JOIN": run_duckdb}


def compare(work: Path) -> dict:
    """The largest relative difference of each engine's features from flowtrain's (counts: mismatches)."""
    ours = pq.read_table(work / "flowtrain.parquet").to_pandas()
    out = {}
    for name in ("pandas", "duckdb"):
        other = pq.read_table(work / f"{name}.parquet").to_pandas()
        worst, counts = 0.0, 0
        for col in [c for c in ours.columns if c.startswith("card_amount_") or c == "merchant_risk_tier"]:
            a, b = ours[col].to_numpy(float), other[col].to_numpy(float)
            if "_count_" in col:
                counts += int((a != b).sum())
                continue
            both = ~np.isnan(a) & ~np.isnan(b)
            if (np.isnan(a) != np.isnan(b)).any():
                worst = float("inf")
            rel = np.abs(a[both] - b[both]) / np.maximum(np.abs(a[both]), 1e-300)
            worst = max(worst, float(rel.max(initial=0)))
        out[name] = {"max_rel_diff": worst, "count_mismatches": counts}
    return out


# --- state bytes ------------------------------------------------------------------------------------------
def state_bytes(txns: pa.Table) -> dict:
    """The states after the whole data, per card: bytes (mean, p50, p99, max) and per card and window."""
    group = KeyFeatures(declare([AGGREGATE]).by_key(("card",)))
    names, codes, _ = encode_keys(txns.column("card"))
    states: dict = {}
    times = txns.column("time").to_numpy() * 1_000_000
    order = np.argsort(times, kind="stable")
    for block in np.array_split(order, 8):  # eight blocks in time order, as a stream's micro-batches would come
        group.advance(names, codes[block], times[block], {"amount": txns.column("amount").to_numpy()[block]}, states)
    sizes = np.array([len(encode_state(s)) for s in states.values()])
    tails = np.array([len(s.series[0].times) for s in states.values()])
    return {"keys": len(sizes), "mean": float(sizes.mean()), "p50": float(np.median(sizes)),
            "p99": float(np.quantile(sizes, 0.99)), "max": int(sizes.max()), "per_window": float(sizes.mean()) / 4,
            "tail_events_mean": float(tails.mean())}


def memory_at(keys: int) -> dict:
    """``keys`` keys, two payments each a minute apart: the states' bytes and the RSS growth holding them."""
    group = KeyFeatures(declare([AGGREGATE]).by_key(("card",)))
    gc.collect()
    before = _rss_mib()
    states: dict = {}
    names = [f"c{i}" for i in range(keys)]
    codes = np.tile(np.arange(keys), 2)
    times = np.repeat(np.array([0, 60_000_000]), keys)
    amounts = np.round(np.random.default_rng(0).lognormal(3, 1, 2 * keys), 2)
    group.advance(names, codes, times, {"amount": amounts}, states)
    gc.collect()
    grown = _rss_mib() - before
    encoded = sum(len(encode_state(s)) for s in states.values())
    return {"keys": keys, "rss_mib": grown, "encoded_mib": encoded / 2**20, "bytes_per_key": encoded / keys}


# --- AUC with and without --------------------------------------------------------------------------------
def auc(work: Path, events: int) -> dict:
    """``flowtrain batch`` without and with the aggregates and the join: the test AUC of the fraud label."""
    txns, merchants = generate_transactions(events, seed=11)
    pq.write_table(txns, work / "auc.parquet")
    pq.write_table(merchants, work / "auc_merchants.parquet")
    base = dict(input=[str(work / "auc.parquet")], label="fraud", task="classification", numeric=["amount"],
                categorical=["category"], time_column="time", epochs=4, seed=0)
    out = {}
    for name, extra in (("without", {}), ("with", {
            "aggregations": ["card:amount:count,mean,max,std:10m,1d,30d", "card:*:count:10m,1h",
                             "card:merchant:distinct:1d"],
            "joins": [f"{work / 'auc_merchants.parquet'}:merchant:valid_from"]})):
        summary = flowtrain.batch(**base, **extra, out=str(work / f"auc-{name}"), overwrite=True)
        out[name] = summary["test"]["model"]["auc"]
    return out


# --- main ----------------------------------------------------------------------------------------------
def stream(work: Path, events: int, repeats: int, bootstrap: str | None, rate: float, seconds: float,
           out_dir: str | None) -> str:
    """The stream pipeline with and without the aggregations (interleaved), and its freshness at ``rate``."""
    broker = None
    if bootstrap is None:
        broker = LocalKafka(port=free_port(), data_dir=work / "kafka")
        broker.start(quiet=True)
        bootstrap = broker.bootstrap
    try:
        table, plain, agg = features_stream.datasets(work, events)
        raw = f"bfraw-{os.getpid()}-{int(time.time())}"
        features_stream.replay(bootstrap, raw, table)
        counter = iter(range(1 << 30))
        cases = {"without aggregations": lambda: features_stream.throughput(bootstrap, work, raw, plain, events, False,
                                                                             next(counter)),
                 f"with {len(WINDOWS)} windows x {len(AGGS)} aggregations": lambda: features_stream.throughput(
                     bootstrap, work, raw, agg, events, True, next(counter))}
        runs = interleaved(cases, repeats=repeats, on_run=lambda c, r, v: print(
            f"  stream {c}, run {r + 1}: {v:,.0f} events/s", file=sys.stderr, flush=True))
        base = median(runs["without aggregations"])
        rows = [(name, events, median(v), median(v) / base if base else float("nan")) for name, v in runs.items()]
        for delay in (None, FRESH_MAX_DELAY):
            for name, dataset, aggregated in (("without", plain, False), ("with", agg, True)):
                fresh = features_stream.freshness(bootstrap, work, table, dataset, rate, seconds, aggregated, delay)
                setting = "the default --max-delay 1" if delay is None else f"--max-delay {delay:g}"
                rows.append((f"freshness at {rate:,.0f} events/s for {seconds:g} s, {setting}, {name} aggregations: "
                             f"p50 / p99 s", len(fresh),
                             f"{np.percentile(fresh, 50):.3f} / {np.percentile(fresh, 99):.3f}", ""))
    finally:
        close_all_clients()
        if broker is not None:
            broker.stop(quiet=True)
    return report("features-stream", ["stream pipeline (Prism)", "events", "events/s", "/ without"], rows, [
        f"{events:,} generated payments replayed first (keyed by card, 3 partitions); each run a new consumer group; "
        f"events/s from the first commit to the commit of the last event (Prism's start-up not counted); "
        f"`--aggregate {features_stream.AGGREGATE}`, lateness 0; {repeats_note(repeats)}. Freshness: the features "
        f"topic's record time of each event's row minus the raw record's produce time, with the pipeline's defaults (a "
        f"micro-batch closes at 2,000 events or 1 s) and with --max-delay {FRESH_MAX_DELAY:g} (a caught-up raw "
        f"partition's read hands back after a quarter of it)."], out_dir)


def run(events: int = 1_000_000, repeats: int = MIN_REPEATS, keys: int = 1_000_000, auc_events: int = 200_000,
        out_dir: str | None = "bench/results", skip: tuple[str, ...] = (), stream_events: int = 100_000,
        bootstrap: str | None = None, freshness_rate: float = 2000.0, freshness_seconds: float = 10.0) -> str:
    check_repeats(repeats)
    work = Path(tempfile.mkdtemp(prefix="bench-features-"))
    try:
        txns, merchants = generate_transactions(events, seed=0)
        pq.write_table(txns, work / "txns.parquet")
        pq.write_table(merchants, work / "merchants.parquet")
        cases = {name: (lambda fn=fn: fn(work, work / "txns.parquet", work / "merchants.parquet"))
                 for name, fn in ENGINES.items()}
        runs = interleaved(cases, repeats=repeats, warmup=[next(iter(ENGINES))], on_run=lambda c, r, s: print(
            f"  {c}, run {r + 1}: {s:.1f} s ({events / s:,.0f} rows/s)", file=sys.stderr, flush=True))
        diffs = compare(work)
        ours = median(runs[next(iter(ENGINES))])
        rows = []
        for name, secs in runs.items():
            m = median(secs)
            rows.append((name, events, m, events / m, ours and (events / ours) / (events / m)))
        notes = [f"{len(WINDOWS)} windows x {len(AGGS)} aggregations of the amount per card "
                 f"(`--aggregate {AGGREGATE}`) and an as-of join of the merchant's tier, {events:,} generated payments "
                 f"({txns.column('card').unique().__len__():,} cards); read Parquet, write Parquet in input order; "
                 f"{repeats_note(repeats)}; last column: flowtrain's rows/s over the engine's. Largest relative "
                 f"difference from flowtrain's values: pandas {diffs['pandas']['max_rel_diff']:.1e} "
                 f"({diffs['pandas']['count_mismatches']} count mismatches), DuckDB "
                 f"{diffs['duckdb']['max_rel_diff']:.1e} ({diffs['duckdb']['count_mismatches']} count mismatches)."]
        tables = [report("features", ["engine", "rows", "seconds", "rows/s", "flowtrain / engine"], rows, notes,
                         out_dir)]
        if "state" not in skip:
            s = state_bytes(txns)
            m = memory_at(keys)
            tables.append(report("features-state", ["measure", "value"], [
                ("cards", s["keys"]), ("state bytes per card, mean", s["mean"]), ("p50", s["p50"]),
                ("p99", s["p99"]), ("max", s["max"]), ("per card and window (mean / 4)", s["per_window"]),
                ("payments held per card (inside 30 days), mean", s["tail_events_mean"]),
                (f"{m['keys']:,} keys: states, MiB (encoded)", m["encoded_mib"]),
                (f"{m['keys']:,} keys: RSS growth, MiB (Python objects)", m["rss_mib"]),
                ("bytes per key at 1M keys (encoded)", m["bytes_per_key"])], [
                "States of the 20 aggregates after the whole data, fed in 8 time blocks "
                "(`pipelines.features.state.encode_state`): a card holds its payments of the last 30 days "
                "(16 bytes each) plus a fixed part."], out_dir))
        if "auc" not in skip:
            a = auc(work, auc_events)
            tables.append(report("features-auc", ["features", "test AUC"], [
                ("amount, category", a["without"]), ("+ aggregates and the merchant's tier as of each payment",
                                                     a["with"])],
                [f"`flowtrain batch` on {auc_events:,} generated payments (fraud bursts), time split."], out_dir))
        if "stream" not in skip:
            tables.append(stream(work, stream_events, repeats, bootstrap, freshness_rate, freshness_seconds, out_dir))
        return "\n\n".join(tables)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="flowtrain bench features", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--events", type=int, default=1_000_000)
    p.add_argument("--repeats", type=int, default=MIN_REPEATS)
    p.add_argument("--keys", type=int, default=1_000_000, help="keys for the memory measurement")
    p.add_argument("--auc-events", type=int, default=200_000)
    p.add_argument("--skip", default="", help="comma-separated: state, auc, stream")
    p.add_argument("--stream-events", type=int, default=100_000, help="payments of the stream's throughput runs")
    p.add_argument("--freshness-rate", type=float, default=2000.0, help="events/s of the freshness run")
    p.add_argument("--freshness-seconds", type=float, default=10.0, help="how long the freshness run replays")
    p.add_argument("--bootstrap", default=None, help="a running broker for the stream's part (default: its own)")
    p.add_argument("--out-dir", default="bench/results")
    a = p.parse_args(argv)
    run(a.events, a.repeats, a.keys, a.auc_events, a.out_dir, tuple(s for s in a.skip.split(",") if s),
        a.stream_events, a.bootstrap, a.freshness_rate, a.freshness_seconds)


if __name__ == "__main__":
    main()

"""bench etl: the demo dataset's batch ETL on the local Beam runner vs a plain pyarrow script (the anchor), at scale.

The demo is the default dataset preset (``pipelines.presets``): its ``build`` (the Beam ETL) against its
``anchor`` (the same steps with the same feature functions as one pyarrow script: join the reference
tables, reject bad rows, split by date, full-pass statistics on the training split, featurize, write
Parquet). At 1x its real inputs; at 10x and 30x its ``scale`` hook's (the demo's: the year repeated with
shifted dates and tail numbers, the reference tables repeated alike, the split cutoffs at the same place
in the longer span).

Every ETL run is a child process of the benchmark, so its peak RSS is its own (``wait4``'s
``ru_maxrss``); a child that only imports the same modules gives the floor. Cases are
interleaved (every scale and engine once per repeat) and each cell is the median of the repeats.
Goals: Beam >= 0.5x pyarrow rows/s at 10x; Beam's peak RSS at 30x within 1.5x of its RSS at 1x.
30x is opt-in (``--scales 1,10,30``): on 2 cores a run takes minutes. The Beam ETL's memory stays flat
with the data; the pyarrow script's does not (~16 GiB at 30x), so ``--anchor-scales 1,10`` runs the
anchor only where it fits.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.demo import demo, event_rows, hook, scaled_inputs
from bench.table import report
from bench.timing import MIN_REPEATS, check_repeats, interleaved, measure_child, median, repeats_note

ENGINES = ("pyarrow", "beam")
NAMES = {"pyarrow": "plain pyarrow script (anchor)", "beam": "flowtrain batch ETL, Beam FnApiRunner"}


# --- the two ETLs (run inside a child process) ------------------------------------------------------
def _child(engine: str, scale: int, work: Path) -> dict:
    """One ETL run in this (child) process; returns rows and seconds (imports excluded)."""
    import pipelines.tabular.pipeline  # noqa: F401 - Beam's ETL modules in every child alike: the RSS floor
    from flowtrain.local.runners import pipeline_options

    preset = demo()
    anchor, build = hook(preset, "anchor", "etl"), hook(preset, "build", "etl")
    tables, spec = scaled_inputs(preset, scale, "etl")
    rows = event_rows(preset, tables, "etl")
    if engine == "imports":
        return {"rows": 0, "seconds": 0.0}
    t0 = time.perf_counter()
    if engine == "pyarrow":
        anchor(tables, work / "pa", spec)
    else:  # the preset's own build (not build_dataset, which also rewrites the manifest): the ETL alone is timed
        manifest = build(tables, dataset_path=str(work / "beam"), dead_letters_path=str(work / "dead.jsonl"),
                         options=pipeline_options("batch"), spec=spec)
        assert manifest["counts"]["in"] == rows, manifest["counts"]
    return {"rows": rows, "seconds": time.perf_counter() - t0}


# --- the parent: children, peak RSS, medians ------------------------------------------------------
def run_child(engine: str, scale: int, work: Path, *, timeout_s: float = 3600) -> dict:
    """Run one ETL in a child process; its result plus ``rss_mib``, the child's peak RSS."""
    out = Path(tempfile.mkdtemp(prefix=f"{engine}-{scale}x-", dir=work))
    log, answer = out / "child.log", out / "child.json"
    cmd = [sys.executable, "-m", "bench.etl", "--child", engine, "--scale", str(scale), "--work", str(out)]
    result, rss_mib = measure_child(cmd, log=log, answer=answer, timeout_s=timeout_s, what=f"bench etl: {engine} at {scale}x")
    shutil.rmtree(out, ignore_errors=True)
    return {**result, "rss_mib": rss_mib}


def run(out_dir: str | None = "bench/results", scales: tuple[int, ...] = (1, 10), repeats: int = MIN_REPEATS,
        anchor_scales: tuple[int, ...] | None = None) -> str:
    """``anchor_scales``: the scales the pyarrow script runs at (default: all); it holds whole tables,
    so at 30x it needs ~16 GiB, more than a shared machine may have spare."""
    check_repeats(repeats)
    anchored = set(scales if anchor_scales is None else anchor_scales)
    preset = demo()
    for name in ("build", "anchor", "events_input"):  # a missing hook says so before anything runs
        hook(preset, name, "etl")
    for k in scales:  # generated (and cached) before anything is timed
        scaled_inputs(preset, k, "etl")
    work = Path(tempfile.mkdtemp(prefix="flowtrain-bench-etl-"))
    try:
        floor = run_child("imports", 1, work)["rss_mib"]
        cases = {(e, k): (lambda e=e, k=k: run_child(e, k, work)) for k in scales for e in ENGINES
                 if e == "beam" or k in anchored}
        runs = interleaved(cases, repeats=repeats, on_run=lambda case, r, res: print(
            f"bench etl: {case[0]} {case[1]}x run {r + 1}/{repeats}: {res['seconds']:.1f} s, "
            f"{res['rss_mib']:,.0f} MiB", file=sys.stderr, flush=True))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows, summary = [], {}
    for k in scales:
        anchor = median(runs[("pyarrow", k)], key=lambda r: r["rows"] / r["seconds"]) if ("pyarrow", k) in runs else None
        for e in ENGINES:
            if (e, k) not in runs:
                rows.append((NAMES[e], f"{k}x", "", "not run", "", "", "", ""))
                continue
            rs = runs[(e, k)]
            n = rs[0]["rows"]
            rate = median(rs, key=lambda r: r["rows"] / r["seconds"])
            rss = median(rs, key=lambda r: r["rss_mib"])
            summary[(e, k)] = {"rate": rate, "rss": rss}
            rows.append((NAMES[e], f"{k}x", f"{n:,}", median(rs, key=lambda r: r["seconds"]), rate,
                         max(r["rows"] / r["seconds"] for r in rs), rss, rate / anchor if anchor else "no anchor"))
    notes = [f"Each cell the {repeats_note(repeats)} (each run a child process; rows/s over the ETL itself, "
             f"imports excluded; peak RSS of the child, imports included: the floor is {floor:,.0f} MiB). "
             f"Same joins, checks, date split, statistics, features and Parquet output; the Beam ETL also "
             f"writes its dead letters."]
    if ("pyarrow", 10) in summary and ("beam", 10) in summary:
        ratio = summary[("beam", 10)]["rate"] / summary[("pyarrow", 10)]["rate"]
        notes.append(f"Goal Beam >= 0.5x pyarrow at 10x: {ratio:.2f}x, {'met' if ratio >= 0.5 else 'NOT met'}.")
    growth = {}  # engine -> (its largest scale, peak RSS there / at 1x)
    for e in ENGINES:
        ks = [k for k in scales if k > 1 and (e, k) in summary]
        if ks and (e, 1) in summary:
            growth[e] = (max(ks), summary[(e, max(ks))]["rss"] / summary[(e, 1)]["rss"])
    if "beam" in growth:
        k, g = growth["beam"]
        pa_note = f", pyarrow {growth['pyarrow'][1]:.2f} (at {growth['pyarrow'][0]}x)" if "pyarrow" in growth else ""
        notes.append(f"Peak RSS at {k}x / at 1x: Beam {g:.2f}{pa_note} (goal: Beam's at 30x <= 1.5x its RSS at 1x; "
                     f"at {k}x: {'met' if g <= 1.5 else 'NOT met'}).")
    return report("etl", ["ETL", "scale", "rows", "seconds", "rows/s", "best rows/s", "peak RSS MiB", "vs anchor"],
                  rows, notes=notes, out_dir=out_dir)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scales", default="1,10", help="comma-separated factors of the demo's rows (1,10,30)")
    ap.add_argument("--repeats", type=int, default=MIN_REPEATS, help="interleaved runs per cell (>= 3)")
    ap.add_argument("--anchor-scales", default=None,
                    help="scales the pyarrow anchor runs at (default: all of --scales); it holds whole tables: "
                         "~16 GiB at 30x")
    ap.add_argument("--child", choices=[*ENGINES, "imports"], help=argparse.SUPPRESS)
    ap.add_argument("--scale", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(_child(a.child, a.scale, Path(a.work))), flush=True)
        return
    scales = tuple(int(s) for s in a.scales.split(",") if s.strip())
    if not scales or min(scales) < 1:
        raise SystemExit(f"--scales {a.scales!r}: give factors >= 1, e.g. 1,10,30")
    anchors = None if a.anchor_scales is None else tuple(int(s) for s in a.anchor_scales.split(",") if s.strip())
    run(scales=scales, repeats=a.repeats, anchor_scales=anchors)


if __name__ == "__main__":
    main()

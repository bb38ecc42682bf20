"""bench predict: ``flowtrain predict`` (Beam FnApiRunner, RunInference) vs a plain script (the anchor) on the
same files: pyarrow reads the Parquet file batch by batch and the bundle's ``predict`` (``flowtrain.load``) runs
on each batch, predictions written to Parquet.

The input is the demo dataset's events with their reference data joined on (the model's raw columns: the
default dataset preset's ``joined`` hook), at ``--scales`` (1x = the demo's inputs, 10x = its ``scale`` hook's:
the demo's year repeated); ``--rows N`` cuts it for a quick run. The model is ``--model RUN_OR_BUNDLE`` or a short flowtrain batch run on the 1x table
(``--train-steps``). Every timed run is a child process (imports excluded from the time); cases are
interleaved and each cell is the median of the repeats. Goal (issue 45 item 10): predict >= 0.65x the plain script's
rows/s at 10x.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.demo import demo, hook, scaled_inputs
from bench.table import report
from bench.timing import MIN_REPEATS, check_repeats, interleaved, measure_child, median, repeats_note

ENGINES = ("plain", "predict")
#: flowtrain predict's rows/s at 10x over the plain script's, at least (issue 45 item 10).
GOAL = 0.65
NAMES = {"plain": "pyarrow batches + bundle.predict (anchor)", "predict": "flowtrain predict, Beam FnApiRunner"}


def joined_table(scale: int, work: Path, rows: int | None = None) -> Path:
    """The demo's events at ``scale`` joined with their reference data: the columns the model reads."""
    import pyarrow.parquet as pq

    preset = demo()
    out = work / f"{preset.name}-{scale}x{f'-{rows}' if rows else ''}.parquet"
    if out.exists():
        return out
    tables, _spec = scaled_inputs(preset, scale, "predict")
    joined = hook(preset, "joined", "predict")(tables, rows)
    spec = preset.spec
    pq.write_table(joined.select([c for c in spec.input_columns if c in joined.column_names]), out,
                   row_group_size=65_536)
    return out


def train_model(table: Path, work: Path, steps: int) -> str:
    import flowtrain

    S = demo().spec
    out = work / "run"
    flowtrain.batch(input=[str(table)], label=S.label, task=S.task, positive_above=S.positive_above,
                    numeric=S.numeric, optional_numeric=S.optional_numeric, categorical=S.categorical,
                    steps=steps, out=str(out), no_progress=True)
    return str(out)


def _child(engine: str, model: str, table: str, out: str) -> dict:
    """One run in this (child) process; returns rows and seconds (imports excluded)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import flowtrain

    if engine == "predict":
        t0 = time.perf_counter()
        summary = flowtrain.predict(model=model, input=[table], out=out, overwrite=True)
        seconds = time.perf_counter() - t0
        assert summary["counts"]["in"] == pq.read_metadata(table).num_rows, summary["counts"]
        return {"rows": summary["counts"]["in"], "seconds": seconds}
    t0 = time.perf_counter()
    predictor = flowtrain.load(model)
    rows, writer = 0, None
    for batch in pq.ParquetFile(table).iter_batches(batch_size=65_536):
        result = predictor.predict(pa.Table.from_batches([batch]))
        rows += batch.num_rows
        writer = writer or pq.ParquetWriter(out, result.schema)
        writer.write_table(result)
    if writer:
        writer.close()
    return {"rows": rows, "seconds": time.perf_counter() - t0}


def run_child(engine: str, model: str, table: Path, work: Path) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"{engine}-", dir=work))
    cmd = [sys.executable, "-m", "bench.predict", "--child", engine, "--model", model, "--input", str(table),
           "--out", str(out / "pred.parquet")]
    result, _rss = measure_child(cmd, log=out / "child.log", answer=out / "child.json", timeout_s=3600,
                                 what=f"bench predict: {engine} on {table.name}")
    shutil.rmtree(out, ignore_errors=True)
    return result


def run(out_dir: str | None = "bench/results", scales: tuple[int, ...] = (1, 10), repeats: int = MIN_REPEATS,
        model: str | None = None, rows: int | None = None, train_steps: int = 200) -> str:
    check_repeats(repeats)
    work = Path(tempfile.mkdtemp(prefix="flowtrain-bench-predict-"))
    try:
        tables = {k: joined_table(k, work, rows) for k in scales}
        model = model or train_model(joined_table(1, work, rows), work, train_steps)
        cases = {(e, k): (lambda e=e, k=k: run_child(e, model, tables[k], work)) for k in scales for e in ENGINES}
        runs = interleaved(cases, repeats=repeats, on_run=lambda case, r, res: print(
            f"bench predict: {case[0]} {case[1]}x run {r + 1}/{repeats}: {res['rows']:,} rows, "
            f"{res['seconds']:.1f} s", file=sys.stderr, flush=True))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table_rows, summary = [], {}
    for k in scales:
        anchor = median(runs[("plain", k)], key=lambda r: r["rows"] / r["seconds"])
        for e in ENGINES:
            rs = runs[(e, k)]
            rate = median(rs, key=lambda r: r["rows"] / r["seconds"])
            summary[(e, k)] = rate
            table_rows.append((NAMES[e], f"{k}x", f"{rs[0]['rows']:,}", median(rs, key=lambda r: r["seconds"]),
                               rate, rate / anchor))
    notes = [f"Each cell the {repeats_note(repeats)} (each run a child process; imports excluded). Same Parquet "
             f"input, same bundle, Parquet output; flowtrain predict also writes dead letters and counts and "
             f"computes the metrics of the labelled rows."]
    if 10 in scales:
        ratio = summary[("predict", 10)] / summary[("plain", 10)]
        verdict = "met" if ratio >= GOAL else "NOT met"
        notes.append(f"Goal predict >= {GOAL:g}x the plain script at 10x: {ratio:.2f}x, {verdict}.")
    if rows:
        notes.append(f"Cut to the first {rows:,} events of each scale (--rows): a quick run, not the goal's size.")
    return report("predict", ["predictor", "scale", "rows", "seconds", "rows/s", "vs anchor"], table_rows,
                  notes=notes, out_dir=out_dir)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scales", default="1,10", help="comma-separated factors of the demo's rows (default 1,10)")
    ap.add_argument("--repeats", type=int, default=MIN_REPEATS, help="interleaved runs per cell (>= 3)")
    ap.add_argument("--model", default=None, help="a run or bundle to predict with (default: a short batch run)")
    ap.add_argument("--rows", type=int, default=None, help="only the first N events of each scale (a quick run)")
    ap.add_argument("--train-steps", type=int, default=200, help="steps of the default model's training run")
    ap.add_argument("--out-dir", default="bench/results", help="where the table is written (markdown + JSON)")
    ap.add_argument("--child", choices=ENGINES, help=argparse.SUPPRESS)
    ap.add_argument("--input", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(_child(a.child, a.model, a.input, a.out)), flush=True)
        return
    scales = tuple(int(s) for s in a.scales.split(",") if s.strip())
    if not scales or min(scales) < 1:
        raise SystemExit(f"--scales {a.scales!r}: give factors >= 1, e.g. 1,10")
    run(out_dir=a.out_dir, scales=scales, repeats=a.repeats, model=a.model, rows=a.rows, train_steps=a.train_steps)


if __name__ == "__main__":
    main()

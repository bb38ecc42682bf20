"""bench train-scale: one training epoch on the 1x and 10x demo datasets, in memory vs streamed.

The datasets are the demo's ETL output (the default dataset preset's ``build``) on its inputs and on
them at 10x (its ``scale`` hook: the demo's year repeated 10 times), built once by the Beam ETL and cached. Each run is one epoch
of ``fit`` in a child process of the benchmark, so its peak RSS (``wait4``) is its own:

* in memory (the anchor): the whole training split as tensors (``TabularDataset.split``);
* streamed: ``--memory-budget`` smaller than the split, so ``flowtrain.train.shards`` streams the
  shards through a bounded shuffle buffer (every row once per epoch).

Reported: rows/s of the training steps (data waits included), the epoch's wall time (loading
and one validation included), the stall (time waiting on data / step time; goal < 5% on both
paths) and the peak RSS. Cells are medians of interleaved runs.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.demo import build_demo, demo, scaled_inputs
from bench.table import report
from bench.timing import MIN_REPEATS, check_repeats, interleaved, measure_child, median, repeats_note

PATHS = ("memory", "stream")
NAMES = {"memory": "in memory (anchor)", "stream": "streamed shards"}
#: The budget that pushes both datasets onto the streaming path (a split's tensors are ~112 B/row).
STREAM_BUDGET = "64MB"
IN_MEMORY_BUDGET = "100%"


def dataset_for(scale: int) -> Path:
    """The demo dataset at ``scale``, built by the Beam ETL once (in a child process) and cached."""
    from flowtrain.local.paths import cache_root

    preset = demo()  # by its cache name: a smaller preset registered under the demo's name has a folder of its own
    path = cache_root() / "bench" / f"{preset.cache_name or preset.name}-{scale}x-dataset"
    if not (path / "_manifest.json").exists():
        print(f"bench train-scale: building the {scale}x demo dataset with the Beam ETL (once, cached in "
              f"{path})", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "bench.train_scale", "--build", str(scale), "--work", str(path)],
                       check=True, cwd=Path(__file__).resolve().parent.parent)
    return path


def _build(scale: int, path: Path) -> None:
    from flowtrain.local.runners import pipeline_options

    preset = demo()
    tables, spec = scaled_inputs(preset, scale, "train-scale")
    build_demo(preset, "train-scale", dataset_path=path, options=pipeline_options("batch"), spec=spec, inputs=tables)


def _child(path_kind: str, dataset: Path, batch_size: int, steps: int | None, threads: int,
           stream_budget: str = STREAM_BUDGET) -> dict:
    """One epoch (or its first ``steps`` steps) in this (child) process."""
    from flowtrain.train import loop, models, plan
    from flowtrain.train.loader import TabularDataset
    from flowtrain.train.shards import StreamedSplit, open_split

    data = TabularDataset(dataset)
    rows = int(data.manifest["rows"]["train"])
    if path_kind == "imports":
        return {"rows": rows}
    budget = stream_budget if path_kind == "stream" else IN_MEMORY_BUDGET
    streamed = isinstance(open_split(data, "train", memory_budget=budget), StreamedSplit)
    if streamed != (path_kind == "stream"):
        raise SystemExit(f"bench train-scale: the {path_kind} path with --memory-budget {budget} "
                         f"{'streams' if streamed else 'holds the split in memory'}: pass a --memory-budget below the "
                         f"training split's size")
    epoch_steps = -(-rows // batch_size)
    steps = min(steps or epoch_steps, epoch_steps)
    config = plan.TrainConfig(steps=steps, batch_size=batch_size, eval_every=steps, patience=10, no_progress=True,
                         memory_budget=budget, threads=threads)
    t0 = time.perf_counter()
    result = loop.fit(models.build_model("mlp", data, config), data, config, name="bench")
    assert result.steps == steps, (result.steps, steps)
    return {"rows": rows, "trained": min(rows, steps * batch_size), "epoch_s": time.perf_counter() - t0,
            "step_s": result.step_seconds, "wait": result.data_wait_fraction, "steps": result.steps}


def run_child(path_kind: str, dataset: Path, batch_size: int, steps: int | None = None, threads: int = 1, *,
              timeout_s: float = 3600, stream_budget: str = STREAM_BUDGET) -> dict:
    """One epoch in a child process; its result plus ``rss_mib``, the child's peak RSS."""
    with tempfile.TemporaryDirectory(prefix="flowtrain-bench-train-") as work:
        log, answer = Path(work) / "child.log", Path(work) / "child.json"
        cmd = [sys.executable, "-m", "bench.train_scale", "--child", path_kind, "--work", str(dataset),
               "--batch-size", str(batch_size), "--threads", str(threads), "--memory-budget", stream_budget] + \
            (["--steps", str(steps)] if steps else [])
        result, rss_mib = measure_child(cmd, log=log, answer=answer, timeout_s=timeout_s,
                                    what=f"bench train-scale: {path_kind} on {dataset}")
    return {**result, "rss_mib": rss_mib}


def run(out_dir: str | None = "bench/results", scales: tuple[int, ...] = (1, 10), batch_size: int = 2048,
        repeats: int = MIN_REPEATS, steps: int | None = None, threads: int = 1, stream_budget: str = STREAM_BUDGET) -> str:
    """``stream_budget``: the streamed path's ``--memory-budget``, below the training split's size (a smaller
    table, e.g. a tiny preset's, needs a smaller one)."""
    check_repeats(repeats)
    datasets = {k: dataset_for(k) for k in scales}
    floor = run_child("imports", datasets[scales[0]], batch_size)["rss_mib"]
    cases = {(p, k): (lambda p=p, k=k: run_child(p, datasets[k], batch_size, steps, threads,
                                                 stream_budget=stream_budget))
             for k in scales for p in PATHS}
    runs = interleaved(cases, repeats=repeats, on_run=lambda case, r, res: print(
        f"bench train-scale: {case[0]} {case[1]}x run {r + 1}/{repeats}: {res['trained'] / res['step_s']:,.0f} rows/s, "
        f"stall {100 * res['wait']:.1f}%, {res['rss_mib']:,.0f} MiB", file=sys.stderr, flush=True))
    rows, stalls = [], []
    for k in scales:
        anchor = median(runs[("memory", k)], key=lambda r: r["trained"] / r["step_s"])
        for p in PATHS:
            rs = runs[(p, k)]
            rate = median(rs, key=lambda r: r["trained"] / r["step_s"])
            stall = 100 * median(rs, key=lambda r: r["wait"])
            stalls.append(stall)
            rows.append((NAMES[p], f"{k}x", f"{rs[0]['rows']:,}", rate, median(rs, key=lambda r: r["epoch_s"]), stall,
                         median(rs, key=lambda r: r["rss_mib"]), rate / anchor))
    worst = max(stalls)
    return report("train-scale", ["loader", "scale", "train rows", "rows/s", "epoch s", "stall %", "peak RSS MiB",
                                  "vs anchor"], rows,
                  notes=[f"{'One epoch' if not steps else f'The first {steps} steps of an epoch'} of the demo's model "
                         f"(batch {batch_size}, {threads} torch thread(s), one validation at the end) per child "
                         f"process; rows/s over the training steps, data waits included; epoch s includes loading "
                         f"and the validation; streamed with --memory-budget {stream_budget}; each cell the "
                         f"{repeats_note(repeats)}; peak RSS includes the imports (floor {floor:,.0f} MiB).",
                         f"Goal stall < 5% on both paths: worst {worst:.2f}%, {'met' if worst < 5 else 'NOT met'}."],
                  out_dir=out_dir)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scales", default="1,10", help="comma-separated dataset scales (factors of the demo's rows)")
    ap.add_argument("--batch-size", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=MIN_REPEATS, help="interleaved runs per cell (>= 3)")
    ap.add_argument("--steps", type=int, default=None, help="time only the first N steps of the epoch (default: all)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1)")
    ap.add_argument("--memory-budget", default=STREAM_BUDGET, help=f"the streamed path's budget, below the training "
                    f"split's size (default {STREAM_BUDGET})")
    ap.add_argument("--child", choices=[*PATHS, "imports"], help=argparse.SUPPRESS)
    ap.add_argument("--build", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.build:
        _build(a.build, Path(a.work))
        return
    if a.child:
        print(json.dumps(_child(a.child, Path(a.work), a.batch_size, a.steps, a.threads, a.memory_budget)), flush=True)
        return
    scales = tuple(int(s) for s in a.scales.split(",") if s.strip())
    if not scales or min(scales) < 1:
        raise SystemExit(f"--scales {a.scales!r}: give factors >= 1, e.g. 1,10")
    run(scales=scales, batch_size=a.batch_size, repeats=a.repeats, steps=a.steps, threads=a.threads,
        stream_budget=a.memory_budget)


if __name__ == "__main__":
    main()

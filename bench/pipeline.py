"""bench pipeline: flowtrain's GPipe and 1F1B vs torch.distributed.pipelining (the anchors).

One run, 2 stages (2 workers, gloo on CPU, 1 thread each), the same MLP cut the same way, the
same global batch and number of micro-batches M, SGD: samples/s of flowtrain GPipe / 1F1B
against ``ScheduleGPipe`` / ``Schedule1F1B`` (goal >= 1.0x). Then flowtrain's measured bubble
fraction per stage (idle time / step time) next to the theory (S-1)/(M+S-1) for M = 4, 8, 16,
and the peak activation memory a stage holds under 1F1B vs GPipe.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from bench.table import report
from bench.timing import MIN_REPEATS, best, check_repeats, interleaved, median, repeats_note
from flowtrain.parallel import DistContext
from flowtrain.parallel.launch import spawn
from flowtrain.parallel.pipeline import StageWorker, grid_position
from flowtrain.parallel.schedules import SCHEDULES, bubble_fraction
from flowtrain.parallel.stages import plan_with_bounds, stage_module

#: Workers send no heartbeats while timing (that would be timed too): the launcher's stall bound
#: is set past the longest run on a busy machine instead of its 60 s default.
WORKER_TIMEOUT_S = 900.0

WIDTH, DEPTH, IN = 512, 8, 64


def build() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(IN, WIDTH), nn.ReLU()]
    for _ in range(DEPTH - 2):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    layers += [nn.Linear(WIDTH, 1), nn.Flatten(0)]
    return nn.Sequential(*layers)


def _data(steps: int, batch: int):
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(batch, IN, generator=gen), torch.randn(batch, generator=gen)) for _ in range(steps)]


def worker(ctx: DistContext, job: dict) -> None:
    model = build()
    stages, micro = ctx.world_size, job["microbatches"]
    n = len(list(model))
    bounds = [(0, n // 2), (n // 2, n)]  # the same cut for both engines
    plan = plan_with_bounds(model, bounds, torch.zeros(2, IN))
    module = stage_module(model, plan, ctx.rank)
    data = _data(job["steps"] + 3, job["batch"])
    opt = torch.optim.SGD(module.parameters(), lr=1e-3)
    loss_fn = nn.MSELoss()
    stats = []
    if job["engine"] == "torch":
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        mb = job["batch"] // micro
        example = torch.zeros(mb, IN) if ctx.rank == 0 else torch.zeros(mb, *plan.out_shapes[0])
        stage = PipelineStage(module, ctx.rank, stages, torch.device("cpu"), input_args=(example,))
        cls = ScheduleGPipe if job["schedule"] == "gpipe" else Schedule1F1B
        schedule = cls(stage, n_microbatches=micro, loss_fn=loss_fn)

        def step(x, y):
            opt.zero_grad(set_to_none=True)
            if ctx.rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=y, losses=[])
            opt.step()
    else:
        pos, group = grid_position(ctx, stages)
        runner = StageWorker(module, pos, group, SCHEDULES[job["schedule"]](stages, micro), micro,
                             plan.out_shapes[0] if ctx.rank else (IN,), loss_fn)

        def step(x, y):
            opt.zero_grad(set_to_none=True)
            stats.append(runner.step(x if ctx.rank == 0 else None, y if ctx.rank == stages - 1 else None, len(y)))
            opt.step()
    for x, y in data[:3]:  # warm-up
        step(x, y)
    stats.clear()
    dist.barrier()
    t0 = time.perf_counter()
    for x, y in data[3:]:
        step(x, y)
    dist.barrier()
    seconds = time.perf_counter() - t0
    mine = {"idle": sum(s.total_s - s.busy_s for s in stats) / max(sum(s.total_s for s in stats), 1e-9),
            "peak_bytes": max((s.peak_activation_bytes for s in stats), default=0)} if stats else {}
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    if ctx.is_main:
        Path(job["out"]).write_text(json.dumps({"samples_per_s": job["steps"] * job["batch"] / seconds,
                                                "stages": everyone}))


def _run(work: Path, **job) -> dict:
    out = work / f"{job['engine']}-{job['schedule']}-{job['microbatches']}-{time.monotonic_ns()}.json"
    spawn(2, "bench.pipeline:worker", {**job, "out": str(out)}, threads_per_worker=1, workdir=work / "w",
          failure_timeout_s=WORKER_TIMEOUT_S)
    return json.loads(out.read_text())


#: The micro-batch counts of the bubble table.
BUBBLE_MICROBATCHES = (4, 8, 16)


def run(out_dir: str | None = "bench/results", steps: int = 40, batch: int = 512, repeats: int = MIN_REPEATS,
        bubble_microbatches: tuple[int, ...] = BUBBLE_MICROBATCHES) -> str:
    check_repeats(repeats)
    work = Path(tempfile.mkdtemp(prefix="flowtrain-bench-pp-"))
    rows = []
    cases = {(engine, schedule): (lambda e=engine, s=schedule: _run(work, engine=e, schedule=s, microbatches=8,
                                                                   steps=steps, batch=batch))
             for schedule in ("gpipe", "1f1b") for engine in ("flowtrain", "torch")}
    runs = interleaved(cases, repeats=repeats)
    rate = {key: median(r, key=lambda res: res["samples_per_s"]) for key, r in runs.items()}
    top = {key: best(r, key=lambda res: res["samples_per_s"], higher_is_better=True) for key, r in runs.items()}
    names = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}
    for schedule in ("gpipe", "1f1b"):
        ours, theirs = rate[("flowtrain", schedule)], rate[("torch", schedule)]
        rows.append((f"flowtrain {schedule.upper()}", "M=8", ours, top[("flowtrain", schedule)], ours / theirs))
        rows.append((f"torch.distributed.pipelining {names[schedule]} (anchor)", "M=8", theirs,
                     top[("torch", schedule)], 1.0))
    bubble_cases = {(micro, schedule): (lambda m=micro, s=schedule: _run(
        work, engine="flowtrain", schedule=s, microbatches=m, steps=steps // 2, batch=batch))
        for micro in bubble_microbatches for schedule in ("gpipe", "1f1b")}
    bubble_runs = interleaved(bubble_cases, repeats=repeats)
    bubble_rows = []
    for (micro, schedule), results in bubble_runs.items():
        stages = range(len(results[0]["stages"]))
        idle = [median(results, key=lambda res, i=i: res["stages"][i]["idle"]) for i in stages]
        peak = [median(results, key=lambda res, i=i: res["stages"][i]["peak_bytes"]) for i in stages]
        bubble_rows.append((schedule, micro, " / ".join(f"{i:.3f}" for i in idle), bubble_fraction(2, micro),
                            " / ".join(f"{p / 1024:,.0f}" for p in peak)))
    text = report("pipeline", ["engine", "micro-batches", "samples/s", "best samples/s", "vs anchor"], rows,
                  notes=[f"2 stages of an MLP ({IN}-{WIDTH}x{DEPTH - 1}-1, "
                         f"{sum(p.numel() for p in build().parameters()) / 1e6:.2f}M params), global batch {batch}, "
                         f"SGD, gloo on CPU, 1 thread per stage, {steps} timed steps; samples/s, ratios, idle "
                         f"fractions and peaks are the {repeats_note(repeats)}."],
                  out_dir=None)
    text += "\n\n" + report("pipeline-bubble", ["schedule", "M", "measured idle fraction (stage 0 / 1)",
                                                "theory (S-1)/(M+S-1)", "peak activations KiB (stage 0 / 1)"],
                            bubble_rows, out_dir=None)
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "pipeline.md").write_text(text + "\n")
    return text


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=MIN_REPEATS, help="interleaved runs (>= 3); medians reported")
    ap.add_argument("--bubble-microbatches", default=",".join(map(str, BUBBLE_MICROBATCHES)),
                    help="comma-separated micro-batch counts of the bubble table (default 4,8,16)")
    a = ap.parse_args(argv)
    micro = tuple(int(m) for m in a.bubble_microbatches.split(",") if m.strip())
    if not micro or min(micro) < 1:
        raise SystemExit(f"--bubble-microbatches {a.bubble_microbatches!r}: give counts >= 1, e.g. 4,8,16")
    run(steps=a.steps, batch=a.batch, repeats=a.repeats, bubble_microbatches=micro)


if __name__ == "__main__":
    main()

"""bench dataparallel: flowtrain's map/reduce reducer vs DistributedDataParallel (the anchor).

One run, 2 workers on 127.0.0.1, gloo on CPU, 1 thread each, the same global batch and
optimizer (Adam) for both, on two models: the demo dataset's model (embeddings + MLP) and an MLP of
~1M parameters. Also: one process with 2 threads on the same global batches (what data
parallelism buys on this machine), and an uneven case where rank 1 runs dry after 60% of the
steps (a Kafka partition with no more data): flowtrain keeps going with a count of 0 there;
DDP needs ``torch.distributed.algorithms.Join``. Goal: flowtrain >= 0.95x DDP.
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
from flowtrain.parallel import DistContext, make_reducer, shard_bounds, sum_loss
from flowtrain.parallel.launch import spawn
from flowtrain.train.models import TabularMLP

#: Workers send no heartbeats while timing (that would be timed too): the launcher's stall bound
#: is set past the longest run on a busy machine instead of its 60 s default.
WORKER_TIMEOUT_S = 900.0

# Cardinalities of the demo dataset's categoricals (carrier, origin, dest, weekday, hour, maker).
DEMO_CARDS = [17, 4, 102, 8, 21, 30]
DEMO_NUMERIC = 15


def build(name: str) -> tuple[nn.Module, callable]:
    torch.manual_seed(0)
    if name == "demo":
        model = TabularMLP(DEMO_NUMERIC, DEMO_CARDS, hidden=(128, 64), dropout=0.0)

        def batch(n, gen):
            x_num = torch.randn(n, DEMO_NUMERIC, generator=gen)
            x_cat = torch.stack([torch.randint(0, c, (n,), generator=gen) for c in DEMO_CARDS], 1)
            return (x_num, x_cat), torch.randint(0, 2, (n,), generator=gen).float()
        return model, batch
    model = nn.Sequential(nn.Linear(128, 1024), nn.ReLU(), nn.Linear(1024, 768), nn.ReLU(),
                          nn.Linear(768, 128), nn.ReLU(), nn.Linear(128, 1), nn.Flatten(0))

    def batch(n, gen):
        x = torch.randn(n, 128, generator=gen)
        return (x,), torch.randint(0, 2, (n,), generator=gen).float()
    return model, batch


def _batches(job, world: int, rank: int):
    """This rank's inputs for every step (made up front: the benchmark times training only)."""
    _, make = build(job["model"])
    gen = torch.Generator().manual_seed(1)
    out = []
    for step in range(job["steps"]):
        inputs, y = make(job["global_batch"], gen)
        lo, hi = shard_bounds(job["global_batch"], rank, world)
        if job.get("uneven") and rank == 1 and step >= int(0.6 * job["steps"]):
            lo = hi  # this rank has run dry
        out.append(([t[lo:hi] for t in inputs], y[lo:hi]))
    return out


def worker(ctx: DistContext, job: dict) -> None:
    model, _ = build(job["model"])
    loss_fn = nn.BCEWithLogitsLoss()
    data = _batches(job, ctx.world_size, ctx.rank)
    if job["engine"] == "ddp":
        from torch.distributed.algorithms.join import Join
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model)
        opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
        # DDP cannot take a step with no examples: a dry rank leaves the loop, Join shadows it.
        mine = [b for b in data if len(b[1])]
        dist.barrier()
        t0 = time.perf_counter()
        with Join([ddp]):
            for inputs, y in mine:
                opt.zero_grad(set_to_none=True)
                loss_fn(ddp(*inputs), y).backward()
                opt.step()
        dist.barrier()
    else:
        reducer = make_reducer(model, ctx, bucket_mb=job.get("bucket_mb", 1.0))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        dist.barrier()
        t0 = time.perf_counter()
        for inputs, y in data:
            loss_sum = sum_loss(loss_fn, model(*inputs), y) if len(y) else None
            opt.zero_grad(set_to_none=True)
            reducer.backward(loss_sum, len(y))
            opt.step()
        dist.barrier()
    seconds = time.perf_counter() - t0
    samples = torch.tensor([float(sum(len(y) for _, y in data))])
    dist.all_reduce(samples)
    if ctx.is_main:
        Path(job["out"]).write_text(json.dumps({"seconds": seconds, "samples": int(samples.item())}))


def single_process(model_name: str, steps: int, global_batch: int, threads: int = 2) -> float:
    torch.set_num_threads(threads)
    model, _ = build(model_name)
    data = _batches({"model": model_name, "steps": steps, "global_batch": global_batch}, 1, 0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.BCEWithLogitsLoss()
    t0 = time.perf_counter()
    for inputs, y in data:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(*inputs), y).backward()
        opt.step()
    return steps * global_batch / (time.perf_counter() - t0)


MODELS = ("demo", "mlp1m")


def run(out_dir: str | None = "bench/results", steps: int = 300, global_batch: int = 1024,
        repeats: int = MIN_REPEATS, models: tuple[str, ...] = MODELS) -> str:
    check_repeats(repeats)
    work = Path(tempfile.mkdtemp(prefix="flowtrain-bench-dp-"))
    rows = []

    def spawned(model_name: str, case: str, engine: str) -> float:
        out = work / f"{model_name}-{case}-{engine}-{time.monotonic_ns()}.json"
        job = {"model": model_name, "engine": engine, "steps": steps, "global_batch": global_batch,
               "uneven": case == "uneven", "out": str(out)}
        spawn(2, "bench.dataparallel:worker", job, threads_per_worker=1, workdir=work / "w",
              failure_timeout_s=WORKER_TIMEOUT_S)
        res = json.loads(out.read_text())
        return res["samples"] / res["seconds"]

    for model_name in models:
        n_params = sum(p.numel() for p in build(model_name)[0].parameters())
        cases = {f"{case}-{engine}": (lambda c=case, e=engine: spawned(model_name, c, e))  # noqa: B023 - run now
                 for case in ("even", "uneven") for engine in ("flowtrain", "ddp")}
        cases["single"] = lambda: single_process(model_name, steps, global_batch)  # noqa: B023 - run now
        runs = interleaved(cases, repeats=repeats)
        rates = {name: median(r) for name, r in runs.items()}
        top = {name: best(r, higher_is_better=True) for name, r in runs.items()}
        label = f"{model_name} ({n_params / 1e6:.2f}M params)"

        def row(case_label, engine_label, key, anchor, label=label, rates=rates, top=top):
            return (label, case_label, engine_label, rates[key], top[key], rates[key] / rates[anchor])

        rows += [
            row("even shards", "flowtrain map/reduce, 2 workers", "even-flowtrain", "even-ddp"),
            row("even shards", "DDP, 2 workers (anchor)", "even-ddp", "even-ddp"),
            row("even shards", "one process, 2 threads", "single", "even-ddp"),
            row("rank 1 dry after 60%", "flowtrain map/reduce (count 0 on rank 1)", "uneven-flowtrain", "uneven-ddp"),
            row("rank 1 dry after 60%", "DDP + Join (anchor)", "uneven-ddp", "uneven-ddp"),
        ]
    return report("dataparallel", ["model", "case", "engine", "samples/s", "best samples/s", "vs anchor"], rows,
                  notes=[f"gloo on CPU, 1 thread per worker, global batch {global_batch}, Adam, {steps} timed steps; "
                         f"samples/s and ratios are the {repeats_note(repeats)}; goal flowtrain >= 0.95x DDP."],
                  out_dir=out_dir)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--global-batch", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=MIN_REPEATS, help="interleaved runs (>= 3); medians reported")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    a = ap.parse_args(argv)
    models = tuple(m for m in a.models.split(",") if m)
    if not models or set(models) - set(MODELS):
        raise SystemExit(f"--models {a.models!r}: use {', '.join(MODELS)} (comma-separated)")
    run(steps=a.steps, global_batch=a.global_batch, repeats=a.repeats, models=models)


if __name__ == "__main__":
    main()

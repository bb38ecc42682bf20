"""bench memory: per-rank bytes of training state and step time, ZeRO stages vs torch FSDP2 (the anchor).

For each N (``--workers 1,2,4``) one spawned group of N ranks (gloo on CPU, 1 thread each) trains
the same MLP (``d -> 4d -> d`` blocks) with Adam on the same global batches under every engine,
each built fresh per repeat, engines interleaved inside a repeat: plain map/reduce data
parallelism (``--shard-states none``), ZeRO-1/2/3 (``flowtrain.parallel.zero``) and FSDP2
(``torch.distributed.fsdp.fully_shard`` per layer, then the root). Per rank: the bytes of the
distinct tensor storages of parameters, gradients and optimizer state held after a step (FSDP2's
local shards), the planned bytes (``flowtrain.train.memory_plan``), and seconds per step; the
table is the median of the repeats (at least 3). Pipeline stages and tensor shards are listed from
the plan (an even split of the parameters), against one device. Goals (issue 31): ZeRO-3 per-rank
state <= 1.1x (one device / N) and <= 1.1x FSDP2's; ZeRO-3 step time within 1/0.9 of FSDP2's;
ZeRO-1 within 1/0.95 of plain DP.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from bench.table import report
from bench.timing import MIN_REPEATS, check_repeats, median
from flowtrain.parallel import DistContext, local_rows, make_reducer, sum_loss
from flowtrain.parallel.launch import heartbeat, spawn
from flowtrain.parallel.zero import ZeroSharder
from flowtrain.parallel.zero_units import storage_bytes
from flowtrain.train.memory_plan import plan_memory

D_MODEL, HIDDEN, BLOCKS = 256, 1024, 2
BUCKET_MB = 25  # DDP's default bucket: the plain reducer's and ZeRO-1/2's
ENGINES = ("none", "optimizer", "gradients", "parameters", "fsdp2")


def build(d_model: int = D_MODEL, hidden: int = HIDDEN, blocks: int = BLOCKS) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(d_model, hidden), nn.ReLU(), nn.Linear(hidden, d_model)]
    return nn.Sequential(*layers)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _run_engine(ctx: DistContext, engine: str, job: dict, data) -> dict:
    import torch.distributed as dist

    model = build(job["d_model"], job["hidden"], job["blocks"])
    loss_fn = nn.MSELoss()
    if engine == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (ctx.world_size,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)

        def step(x, y):
            lo, hi = local_rows(len(y), ctx)
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x[lo:hi]), y[lo:hi]).backward()
            opt.step()

        def held() -> int:
            params = [_local(p) for p in model.parameters()]
            return (storage_bytes(params) + storage_bytes([_local(p.grad) for p in model.parameters()
                                                           if p.grad is not None])
                    + storage_bytes([_local(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]))
    elif engine == "none":
        reducer = make_reducer(model, ctx, bucket_mb=BUCKET_MB)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)

        def step(x, y):
            lo, hi = local_rows(len(y), ctx)
            opt.zero_grad(set_to_none=True)
            reducer.backward(sum_loss(loss_fn, model(x[lo:hi]), y[lo:hi]), hi - lo)
            opt.step()

        def held() -> int:
            return (storage_bytes(list(model.parameters())) + storage_bytes([p.grad for p in model.parameters()])
                    + storage_bytes([v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)])
                    + storage_bytes([b.buffer for b in getattr(reducer, "buckets", [])]))
    else:
        zero = ZeroSharder(model, ctx, stage=engine, make_optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-4),
                           bucket_mb=BUCKET_MB)  # the plain reducer's buckets (ZeRO-3 gathers per layer)

        def step(x, y):
            lo, hi = local_rows(len(y), ctx)
            zero.zero_grad()
            zero.backward(sum_loss(loss_fn, model(x[lo:hi]), y[lo:hi]), hi - lo)
            zero.step()

        def held() -> int:
            return zero.state_bytes()["total"]
    planned = plan_memory(build(job["d_model"], job["hidden"], job["blocks"]), workers=ctx.world_size,
                          shard_states=engine if engine != "fsdp2" else "parameters", bucket_mb=BUCKET_MB).state
    for x, y in data[:2]:  # warm-up
        step(x, y)
    if ctx.distributed:
        dist.barrier()
    t0 = time.perf_counter()
    for x, y in data[2:]:
        step(x, y)
        heartbeat()  # alive: a loaded machine's run of every engine takes longer than the launcher's bound
    if ctx.distributed:
        dist.barrier()
    seconds = (time.perf_counter() - t0) / (len(data) - 2)
    out = {"bytes": held(), "planned": planned, "step_s": seconds}
    if engine != "fsdp2" and engine != "none":
        zero.close()
    return out


def worker(ctx: DistContext, job: dict) -> None:
    gen = torch.Generator().manual_seed(3)
    data = [(torch.randn(job["batch"], job["d_model"], generator=gen),
             torch.randn(job["batch"], job["d_model"], generator=gen)) for _ in range(job["steps"] + 2)]
    engines = [e for e in job["engines"] if ctx.world_size > 1 or e in ("none",)]
    results: dict[str, list[dict]] = {e: [] for e in engines}
    for _ in range(job["repeats"]):  # interleaved: every engine once per repeat
        for engine in engines:
            results[engine].append(_run_engine(ctx, engine, job, data))
    everyone = [None] * ctx.world_size
    if ctx.distributed:
        import torch.distributed as dist

        dist.all_gather_object(everyone, results)
    else:
        everyone = [results]
    if ctx.is_main:
        Path(job["out"]).write_text(json.dumps(everyone))


def run(workers=(1, 2, 4), steps: int = 10, batch: int = 256, repeats: int = MIN_REPEATS, d_model: int = D_MODEL,
        hidden: int = HIDDEN, blocks: int = BLOCKS, out_dir: str | None = "bench/results") -> str:
    check_repeats(repeats)
    work = Path(tempfile.mkdtemp(prefix="flowtrain-bench-memory-"))
    shape = dict(steps=steps, batch=batch, d_model=d_model, hidden=hidden, blocks=blocks, repeats=repeats)
    model = build(d_model, hidden, blocks)
    one_device = plan_memory(model, workers=1).state
    rows, per_n = [], {}
    for n in workers:
        out = work / f"n{n}.json"
        spawn(n, "bench.memory:worker", {**shape, "engines": list(ENGINES), "out": str(out)}, threads_per_worker=1,
              workdir=work / f"w{n}")
        ranks = json.loads(out.read_text())
        per_n[n] = {}
        for engine in ranks[0]:
            worst = max(median(r[engine], key=lambda m: m["bytes"]) for r in ranks)  # the busiest rank
            step_s = median(ranks[0][engine], key=lambda m: m["step_s"])
            planned = ranks[0][engine][0]["planned"]
            per_n[n][engine] = (worst, step_s)
            rows.append((n, engine if engine != "none" else "none (plain map/reduce)", worst / 2**20,
                         f"{worst / (one_device / n):.2f}", f"{planned / 2**20:.2f}", step_s * 1000))
    for n in workers:
        if "fsdp2" in per_n[n] and "parameters" in per_n[n]:
            z, f = per_n[n]["parameters"], per_n[n]["fsdp2"]
            rows.append((n, "ZeRO-3 / FSDP2", f"{z[0] / f[0]:.2f}x bytes", "", "", f"{f[1] / z[1]:.2f}x speed"))
        if "optimizer" in per_n[n] and "none" in per_n[n]:
            z, d = per_n[n]["optimizer"], per_n[n]["none"]
            rows.append((n, "ZeRO-1 / plain DP", f"{z[0] / d[0]:.2f}x bytes", "", "", f"{d[1] / z[1]:.2f}x speed"))
    layout_rows = [("one device", f"{one_device / 2**20:.2f}", "1.00")]
    for stages, tensor in ((2, 1), (1, 2), (2, 2)):
        p = plan_memory(model, stages=stages, tensor_parallel=tensor).state
        layout_rows.append((f"--stages {stages} --tensor-parallel {tensor} (planned, even split)",
                            f"{p / 2**20:.2f}", f"{p / one_device:.2f}"))
    params = sum(p.numel() for p in model.parameters())
    text = report("memory", ["N", "engine", "state MiB per rank (busiest, median)", "vs one device / N",
                             "planned MiB", "ms per step (median)"], rows,
                  notes=[f"MLP of {blocks} blocks {d_model}->{hidden}->{d_model} ({params / 1e6:.2f}M params), global "
                         f"batch {batch}, Adam, gloo on CPU, 1 thread per rank, {steps} timed steps per run, median of "
                         f"{repeats} interleaved runs. State: distinct tensor storages of parameters, gradients, "
                         f"optimizer state (and the plain reducer's buckets) held after a step."], out_dir=None)
    text += "\n\n" + report("memory-layouts", ["layout", "state MiB per rank", "vs one device"], layout_rows,
                            out_dir=None)
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "memory.md").write_text(text + "\n")
    return text


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workers", default="1,2,4", help="comma-separated N")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=MIN_REPEATS, help="interleaved runs (median; at least 3)")
    ap.add_argument("--d-model", type=int, default=D_MODEL)
    ap.add_argument("--hidden", type=int, default=HIDDEN)
    ap.add_argument("--blocks", type=int, default=BLOCKS)
    a = ap.parse_args(argv)
    run(workers=tuple(int(n) for n in a.workers.split(",")), steps=a.steps, batch=a.batch, repeats=a.repeats,
        d_model=a.d_model, hidden=a.hidden, blocks=a.blocks)


if __name__ == "__main__":
    main()

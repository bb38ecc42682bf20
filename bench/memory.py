"""bench memory: per-rank bytes of training state and step time, ZeRO stages vs torch FSDP2 (the anchor).

For each N (``--workers 1,2,4``) one spawned group of N ranks (gloo on CPU, 1 thread each) trains
the same MLP (``d -> 4d -> d`` blocks) with Adam on the same global batches under every engine,
each built fresh per repeat, engines interleaved inside a repeat: plain map/reduce data
parallelism (``--shard-states none``), ZeRO-1/2/3 (``flowtrain.parallel.zero.sharder``) and FSDP2
(``torch.distributed.fsdp.fully_shard`` per layer, then the root). Per rank: the bytes of the
distinct tensor storages of parameters, gradients and optimizer state held after a step (FSDP2's
local shards), the planned bytes (``flowtrain.train.memory_plan``), and seconds per step; the
table is the median of the repeats (at least 3). Pipeline stages and tensor shards are listed from
the plan (an even split of the parameters), against one device. Goals (issue 31): ZeRO-3 per-rank
state <= 1.1x (one device / N) and <= 1.1x FSDP2's; ZeRO-3 step time within 1/0.9 of FSDP2's;
ZeRO-1 within 1/0.95 of plain DP. Issue 49: also where the memory wall is met (``--size 100m``: ~100M
parameters) and with deferred construction (``--deferred``: every engine's model built on the meta device;
ZeRO makes only each rank's shards, FSDP2 ``fully_shard``s the meta model, then ``to_empty`` and the same
initial values, parameter by parameter), ZeRO-1 >= 0.95x plain DP and ZeRO-3 >= 1x FSDP2.

    flowtrain bench memory --size 100m --deferred --workers 2,4 --steps 3 --batch 64
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import json
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import distribute_tensor

from bench.table import report
from bench.timing import MIN_REPEATS, check_repeats, median
from flowtrain.parallel import DistContext, local_rows, make_reducer, sum_loss
from flowtrain.parallel.deferred import Materializer, deferred, materialize
from flowtrain.parallel.launch import heartbeat, spawn
from flowtrain.parallel.zero.sharder import ZeroSharder
from flowtrain.parallel.zero.units import storage_bytes
from flowtrain.train.memory_plan import plan_memory

D_MODEL, HIDDEN, BLOCKS = 256, 1024, 2
#: glibc's malloc_trim (None on a C library without it: nothing is trimmed there)
_MALLOC_TRIM = getattr(ctypes.CDLL(ctypes.util.find_library("c")), "malloc_trim", None)
#: ``--size``: the MLP's (d_model, hidden, blocks); 100m is where the memory wall is met (the capped demo's size)
SIZES = {"1m": (256, 1024, 2), "100m": (1024, 4096, 12)}
BUCKET_MB = 25  # DDP's default bucket: the plain reducer's and ZeRO-1/2's
ENGINES = ("none", "optimizer", "gradients", "parameters", "fsdp2")
PREFETCH = "parameters+prefetch"  # --prefetch: ZeRO-3 with the next layer's gather under this one's compute


def _layers(d_model: int, hidden: int, blocks: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(d_model, hidden), nn.ReLU(), nn.Linear(hidden, d_model)]
    return nn.Sequential(*layers)


def build(d_model: int = D_MODEL, hidden: int = HIDDEN, blocks: int = BLOCKS, *,
          on_meta: bool = False) -> nn.Sequential:
    """The MLP; ``on_meta``: built on the meta device (``flowtrain.parallel.deferred``), its values made later, the
    same as ``materialize`` gives the whole model."""
    torch.manual_seed(0)
    model = deferred(lambda: _layers(d_model, hidden, blocks), seed=0)
    return model if on_meta else materialize(model)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _run_engine(ctx: DistContext, engine: str, job: dict, data) -> dict:
    import torch.distributed as dist

    on_meta = bool(job.get("deferred")) and engine != "none"  # plain DP holds the whole model: made whole
    model = build(job["d_model"], job["hidden"], job["blocks"], on_meta=on_meta)
    loss_fn = nn.MSELoss()
    if engine == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (ctx.world_size,))
        source = Materializer(model) if on_meta else None
        metas = dict(model.named_parameters()) if on_meta else {}
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if source is not None:  # FSDP2's deferred initialisation: to_empty, then each parameter's values
            _fsdp2_initialise(model, source, metas)
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
        stage = "parameters" if engine == PREFETCH else engine  # ZeRO-3 with each layer's gather started ahead
        zero = ZeroSharder(model, ctx, stage=stage, make_optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-4),
                           bucket_mb=BUCKET_MB, prefetch=engine == PREFETCH)  # the plain reducer's buckets

        def step(x, y):
            lo, hi = local_rows(len(y), ctx)
            zero.zero_grad()
            zero.backward(sum_loss(loss_fn, model(x[lo:hi]), y[lo:hi]), hi - lo)
            zero.step()

        def held() -> int:
            return zero.state_bytes()["total"]
    planned = plan_memory(build(job["d_model"], job["hidden"], job["blocks"], on_meta=True), workers=ctx.world_size,
                          shard_states=engine if engine in ENGINES[:4] else "parameters", bucket_mb=BUCKET_MB).state
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
    if engine == "none":
        reducer.close()  # its gradient hooks hold it, and it the model: removed, the model is freed
    elif engine != "fsdp2":
        zero.close()
    return out


def _fsdp2_initialise(model: nn.Module, source: Materializer, metas: dict) -> None:
    """A meta-device model ``fully_shard``ed: storage for each rank's shards (``to_empty``), then each parameter's
    whole initial value, distributed as FSDP2 shards it (the local shard kept): what FSDP2 documents for deferred
    initialisation, with the values ``materialize`` gives."""
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(distribute_tensor(source.value(metas[name]), p.device_mesh, p.placements))


def worker(ctx: DistContext, job: dict) -> None:
    gen = torch.Generator().manual_seed(3)
    data = [(torch.randn(job["batch"], job["d_model"], generator=gen),
             torch.randn(job["batch"], job["d_model"], generator=gen)) for _ in range(job["steps"] + 2)]
    engines = [e for e in job["engines"] if ctx.world_size > 1 or e in ("none",)]
    results: dict[str, list[dict]] = {e: [] for e in engines}
    for _ in range(job["repeats"]):  # interleaved: every engine once per repeat
        for engine in engines:
            results[engine].append(_run_engine(ctx, engine, job, data))
            # the engine's model, optimizer and hooks freed before the next one is built (its hooks' reference
            # cycles by the collector), and the freed heap given back (glibc keeps a freed 16 MB tensor's memory in
            # its heap once its mmap threshold has risen): at ~100M parameters, 5 engines x 3 repeats left a rank at
            # 12 GB resident and the kernel killed it; with this each engine starts from the same ~0.8 GB
            gc.collect()
            if _MALLOC_TRIM is not None:
                _MALLOC_TRIM(0)
    everyone = [None] * ctx.world_size
    if ctx.distributed:
        import torch.distributed as dist

        dist.all_gather_object(everyone, results)
    else:
        everyone = [results]
    if ctx.is_main:
        Path(job["out"]).write_text(json.dumps(everyone))


def run(workers=(1, 2, 4), steps: int = 10, batch: int = 256, repeats: int = MIN_REPEATS, d_model: int = D_MODEL,
        hidden: int = HIDDEN, blocks: int = BLOCKS, out_dir: str | None = "bench/results",
        on_meta: bool = False, engines: tuple[str, ...] = ENGINES) -> str:
    check_repeats(repeats)
    work = Path(tempfile.mkdtemp(prefix="flowtrain-bench-memory-"))
    shape = dict(steps=steps, batch=batch, d_model=d_model, hidden=hidden, blocks=blocks, repeats=repeats,
                 deferred=on_meta)
    model = build(d_model, hidden, blocks, on_meta=True)  # its shapes (no memory)
    one_device = plan_memory(model, workers=1).state
    rows, per_n = [], {}
    for n in workers:
        out = work / f"n{n}.json"
        spawn(n, "bench.memory:worker", {**shape, "engines": list(engines), "out": str(out)}, threads_per_worker=1,
              workdir=work / f"w{n}", failure_timeout_s=600)  # a ~100M-parameter step on a shared 2-core machine
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
        for zero3 in ("parameters", PREFETCH):
            if "fsdp2" in per_n[n] and zero3 in per_n[n]:
                z, f = per_n[n][zero3], per_n[n]["fsdp2"]
                rows.append((n, "ZeRO-3 / FSDP2" + (" (prefetch)" if zero3 == PREFETCH else ""),
                             f"{z[0] / f[0]:.2f}x bytes", "", "", f"{f[1] / z[1]:.2f}x speed"))
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
                         f"{repeats} interleaved runs"
                         + (", every engine's model built on the meta device (deferred construction: ZeRO and FSDP2 "
                            "make only each rank's shards)" if on_meta else "")
                         + ". State: distinct tensor storages of parameters, gradients, optimizer state (and the plain "
                           "reducer's buckets) held after a step."], out_dir=None)
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
    ap.add_argument("--size", choices=sorted(SIZES), help="the MLP's d_model, hidden and blocks at once (100m: ~100M "
                    "parameters, where the memory wall is met); overrides --d-model, --hidden, --blocks")
    ap.add_argument("--deferred", action="store_true", help="build every engine's model on the meta device (each rank "
                    "makes only its shards)")
    ap.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {', '.join(ENGINES)}, {PREFETCH}")
    a = ap.parse_args(argv)
    d_model, hidden, blocks = SIZES[a.size] if a.size else (a.d_model, a.hidden, a.blocks)
    engines = tuple(a.engines.split(","))
    unknown = set(engines) - {*ENGINES, PREFETCH}
    if unknown:
        raise SystemExit(f"--engines: {', '.join(sorted(unknown))} unknown; use {', '.join(ENGINES)}, {PREFETCH}")
    run(workers=tuple(int(n) for n in a.workers.split(",")), steps=a.steps, batch=a.batch, repeats=a.repeats,
        d_model=d_model, hidden=hidden, blocks=blocks, on_meta=a.deferred, engines=engines)


if __name__ == "__main__":
    main()

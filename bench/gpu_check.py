"""GPU check: the engine's equivalence checks and benchmarks on CUDA, as one prepared script.

    python -m bench.gpu_check                 # on a machine with GPUs (--device cuda)
    python -m bench.gpu_check --device cpu    # the same checks on the CPU: a smoke test anywhere

It prints the machine (torch, CUDA, GPUs), then

1. equivalence: data parallelism (map/reduce of gradient sums), pipeline parallelism (2 stages,
   1F1B), tensor parallelism (T = 2, and T = 3 where 3 GPUs are there) and the 3-D grid
   (2 x 2 x 2 on 8 GPUs, else the largest D x S x T the GPUs allow), each through the real
   worker entry point (NCCL, one GPU per worker, ``cuda:LOCAL_RANK``), against one process on
   one device after 20 Adam steps: max abs difference of the parameters;
2. benchmarks: the data-parallel reducer against DDP and tensor parallelism against DTensor's
   ``parallelize_module``, samples/s and peak GPU memory per rank.

A check that needs more GPUs than the machine has is listed as skipped, with the number it
needs. Exit status 1 when an equivalence check fails. Tables are Markdown, for the README.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from bench.table import markdown_table
from flowtrain.parallel import DistContext, make_reducer, shard_bounds, sum_loss
from flowtrain.parallel.grid import Grid, build_groups
from flowtrain.parallel.launch import spawn
from flowtrain.parallel.pipeline import StageWorker, replica_rows
from flowtrain.parallel.schedules import SCHEDULES
from flowtrain.parallel.stages import merge_stage_states, plan_stages, stage_module
from flowtrain.parallel.tensor.plan import TensorGroup, plan_tensor_parallel, shard_module

STEPS, BATCH, WIDTH = 20, 48, 64


def build() -> nn.Sequential:
    torch.manual_seed(0)
    # smooth activations: a ReLU kink flips on a rounding difference, and Adam magnifies it
    return nn.Sequential(nn.Linear(16, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                         nn.Linear(WIDTH, 2 * WIDTH), nn.Tanh(), nn.Linear(2 * WIDTH, WIDTH), nn.Tanh(),
                         nn.Linear(WIDTH, 1), nn.Flatten(0))


def batches(device: torch.device):
    gen = torch.Generator().manual_seed(11)
    out = []
    for _ in range(STEPS):
        x = torch.randn(BATCH, 16, generator=gen)
        y = x[:, 0] * x[:, 1] - x[:, 2] + 0.1 * torch.randn(BATCH, generator=gen)
        out.append((x.to(device), y.to(device)))
    return out


def reference(device: torch.device) -> dict:
    model = build().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.003)
    for x, y in batches(device):
        opt.zero_grad(set_to_none=True)
        nn.MSELoss()(model(x), y).backward()
        opt.step()
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def dp_job(ctx: DistContext, job: dict) -> None:
    """Data parallelism: the map/reduce reducer (bucketed, overlapped with backward)."""
    device = torch.device(ctx.device)
    model = build().to(device)
    reducer = make_reducer(model, ctx, bucket_mb=0.01)
    opt = torch.optim.Adam(model.parameters(), lr=0.003)
    for x, y in batches(device):
        lo, hi = shard_bounds(len(y), ctx.rank, ctx.world_size)
        opt.zero_grad(set_to_none=True)
        reducer.backward(sum_loss(nn.MSELoss(), model(x[lo:hi]), y[lo:hi]) if hi > lo else None, hi - lo)
        opt.step()
    reducer.close()
    if ctx.is_main:
        torch.save({k: v.cpu() for k, v in model.state_dict().items()}, job["out"])


def grid_job(ctx: DistContext, job: dict) -> None:
    """D x S x T: pipeline stages, tensor shards and replicas, on this rank's device."""
    device = torch.device(ctx.device)
    stages, tensor = job["stages"], job["tensor"]
    grid = Grid.from_world(ctx.world_size, stages=stages, tensor=tensor)
    groups = build_groups(grid, ctx.rank)
    pos = groups.pos
    model = build()
    plan = plan_stages(model, stages, torch.zeros(2, 16), measure=False)
    tplans = [plan_tensor_parallel(stage_module(model, plan, s), tensor) for s in range(stages)]
    tg = TensorGroup(groups.tensor, pos.tensor, tensor)
    module = shard_module(stage_module(model, plan, pos.stage), tplans[pos.stage], tg).to(device)
    micro = 3 if stages > 1 else 1
    worker = StageWorker(module, pos, groups.data, SCHEDULES["1f1b"](stages, micro), micro,
                         plan.out_shapes[pos.stage - 1] if pos.stage else (16,), nn.MSELoss(),
                         p2p_groups=(groups.forward, groups.backward), device=device)
    opt = torch.optim.Adam(module.parameters(), lr=0.003)
    for x, y in batches(device):
        lo, hi = replica_rows(len(y), pos)
        opt.zero_grad(set_to_none=True)
        worker.step(x[lo:hi] if pos.is_first else None, y[lo:hi] if pos.is_last else None, hi - lo)
        opt.step()
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, {k: v.cpu() for k, v in module.state_dict().items()})
    if ctx.is_main:
        shards = [[everyone[grid.rank_of(0, s, t)] for t in range(tensor)] for s in range(stages)]
        torch.save(merge_stage_states([tplans[s].merge(shards[s]) for s in range(stages)]), job["out"])
    worker.close()
    dist.barrier()
    groups.close()


def dp_bench_job(ctx: DistContext, job: dict) -> None:
    """Samples/s and peak memory of the map/reduce reducer or DDP on an MLP of ~8M parameters."""
    device = torch.device(ctx.device)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                          nn.Linear(2048, 512), nn.ReLU(), nn.Linear(512, 1), nn.Flatten(0)).to(device)
    n = job["batch"] // ctx.world_size
    gen = torch.Generator().manual_seed(ctx.rank)
    data = [(torch.randn(n, 512, generator=gen).to(device), torch.randn(n, generator=gen).to(device))
            for _ in range(job["steps"] + 3)]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if job["engine"] == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        net = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        opt = torch.optim.Adam(net.parameters(), lr=1e-4)

        def step(x, y):
            opt.zero_grad(set_to_none=True)
            nn.MSELoss()(net(x), y).backward()
            opt.step()
    else:
        reducer = make_reducer(model, ctx)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)

        def step(x, y):
            opt.zero_grad(set_to_none=True)
            reducer.backward(sum_loss(nn.MSELoss(), model(x), y), len(y))
            opt.step()
    for x, y in data[:3]:
        step(x, y)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    t0 = time.perf_counter()
    for x, y in data[3:]:
        step(x, y)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    seconds = time.perf_counter() - t0
    if ctx.is_main:
        Path(job["out"]).write_text(json.dumps({
            "samples_per_s": job["steps"] * n * ctx.world_size / seconds,
            "peak_mib": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None}))


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in b)


def _spawn(world: int, target: str, job: dict, work: Path, device: str) -> None:
    spawn(world, target, {**job, "device": device}, workdir=work / f"w-{time.monotonic_ns()}",
          failure_timeout_s=180, threads_per_worker=1 if device == "cpu" else None,
          extra_env={"PYTHONPATH": str(Path(__file__).resolve().parent.parent)})


def _equivalence(device: str, gpus: int, work: Path) -> tuple[list, bool]:
    capacity = gpus if device == "cuda" else 8
    ref = reference(torch.device("cuda", 0) if device == "cuda" else torch.device("cpu"))
    tol = 1e-5 if device == "cpu" else 1e-4  # GPU kernels sum in other orders than the CPU's
    checks = [("data parallel (map/reduce)", 2, "dp", {}),
              ("pipeline 2 stages, 1F1B", 2, "grid", {"stages": 2, "tensor": 1}),
              ("tensor parallel T = 2", 2, "grid", {"stages": 1, "tensor": 2}),
              ("tensor parallel T = 3 (uneven shards)", 3, "grid", {"stages": 1, "tensor": 3}),
              ("data x tensor 2 x 2", 4, "grid", {"stages": 1, "tensor": 2}),
              ("3-D grid 2 x 2 x 2", 8, "grid", {"stages": 2, "tensor": 2})]
    rows, ok = [], True
    for name, world, kind, extra in checks:
        if world > capacity:
            rows.append((name, world, device, "-", f"{tol:g}", f"skipped: needs {world} GPUs, {capacity} here"))
            continue
        out = work / f"{kind}-{world}-{time.monotonic_ns()}.pt"
        t0 = time.perf_counter()
        _spawn(world, f"bench.gpu_check:{kind}_job", {**extra, "out": str(out)}, work, device)
        diff = _max_diff(torch.load(out, weights_only=True), ref)
        passed = diff <= tol
        ok &= passed
        rows.append((name, world, device, f"{diff:.2e}", f"{tol:g}",
                     f"{'pass' if passed else 'FAIL'} ({time.perf_counter() - t0:.0f} s)"))
    return rows, ok


def _benchmarks(device: str, gpus: int, work: Path, repeats: int) -> list:
    from bench.tensor import run_once as tensor_run

    rows = []
    if device == "cuda" and gpus < 2:
        return [("data parallel / tensor parallel", "-", "-", "-", "skipped: needs 2 GPUs")]
    steps = 50 if device == "cuda" else 5
    dp: dict[str, list] = {"flowtrain": [], "ddp": []}
    for _ in range(repeats):
        for engine in dp:
            out = work / f"dpb-{engine}-{time.monotonic_ns()}.json"
            _spawn(2, "bench.gpu_check:dp_bench_job", {"engine": engine, "steps": steps, "batch": 1024,
                                                       "out": str(out)}, work, device)
            dp[engine].append(json.loads(out.read_text()))
    tp: dict[str, list] = {"flowtrain": [], "torch": []}
    shape = dict(steps=steps, batch=512 if device == "cuda" else 64, d_model=1024 if device == "cuda" else 128,
                 hidden=4096 if device == "cuda" else 512, blocks=2, device=device)
    for _ in range(repeats):
        for engine in tp:
            tp[engine].append(tensor_run(work, engine=engine, **shape))

    def med(results, key):
        values = [r[key] for r in results if r.get(key) is not None]
        return statistics.median(values) if values else None

    def mib(value):
        return f"{value:,.0f}" if value is not None else "-"

    for label, results, anchor in (("data parallel, 2 ranks", dp, "ddp"), ("tensor parallel T = 2", tp, "torch")):
        base = med(results[anchor], "samples_per_s")
        for engine, rs in results.items():
            sps = med(rs, "samples_per_s")
            name = {"flowtrain": "flowtrain", "ddp": "DDP (anchor)", "torch": "DTensor parallelize_module (anchor)"}
            rows.append((label, name[engine], f"{sps:,.0f}", f"{sps / base:.3f}", mib(med(rs, "peak_mib"))))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved benchmark runs (median)")
    ap.add_argument("--skip-bench", action="store_true", help="equivalence checks only")
    a = ap.parse_args(argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if a.device == "cuda" and gpus == 0:
        print("gpu_check: --device cuda but torch sees no GPU (torch.cuda.is_available() is False); run it on a "
              "machine with CUDA, or --device cpu for the smoke test", file=sys.stderr)
        return 2
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(gpus)) if gpus else "none"
    print(f"### gpu_check ({time.strftime('%Y-%m-%d')}, {platform.machine()}, torch {torch.__version__}, CUDA "
          f"{torch.version.cuda}, {gpus} GPU(s): {names}; device {a.device})\n", flush=True)
    work = Path(tempfile.mkdtemp(prefix="flowtrain-gpu-check-"))
    rows, ok = _equivalence(a.device, gpus, work)
    print(markdown_table(["equivalence after 20 Adam steps", "workers", "device", "max abs diff", "tolerance",
                          "result"], rows) + "\n", flush=True)
    if not a.skip_bench:
        bench = _benchmarks(a.device, gpus, work, a.repeats)
        print(markdown_table(["benchmark", "engine", "samples/s (median)", "vs anchor", "peak MiB per rank"], bench),
              flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""bench tensor: flowtrain's tensor parallelism vs torch's DTensor ``parallelize_module`` (the anchor).

One run, T = 2 workers on 127.0.0.1, gloo on CPU, 1 thread each, the same MLP (two Megatron
blocks ``d -> 4d -> d`` with the hidden width 4d >= 2048, so the split matters), the same global
batches and Adam: samples/s of flowtrain's column/row pairs (``flowtrain.parallel.tensor.plan``)
against ``torch.distributed.tensor.parallel.parallelize_module`` with ``ColwiseParallel`` /
``RowwiseParallel`` on a 1-D ``DeviceMesh``; goal >= 1.0x. Also: bytes flowtrain all-reduces
per step against the theory (per pair, one all-reduce of batch x d forward and one backward),
the collectives per step each engine issues (DTensor's counted by ``CommDebugMode``), and the
parameter memory each rank holds (1/T of the sharded layers). Median of interleaved repeats.
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
from bench.timing import MIN_REPEATS, check_repeats, interleaved, median
from flowtrain.parallel import DistContext
from flowtrain.parallel.launch import spawn
from flowtrain.parallel.tensor.plan import TensorGroup, plan_tensor_parallel, shard_module

D_MODEL, HIDDEN, BLOCKS = 512, 2048, 2


def build(d_model: int = D_MODEL, hidden: int = HIDDEN, blocks: int = BLOCKS) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for b in range(blocks):
        layers += [nn.Linear(d_model, hidden), nn.ReLU(), nn.Linear(hidden, d_model)]
        if b < blocks - 1:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


def _data(steps: int, batch: int, d_model: int):
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(batch, d_model, generator=gen), torch.randn(batch, d_model, generator=gen))
            for _ in range(steps)]


def _param_bytes(params) -> int:
    total = 0
    for p in params:
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def worker(ctx: DistContext, job: dict) -> None:
    d_model, hidden, blocks = job["d_model"], job["hidden"], job["blocks"]
    device = torch.device(ctx.device)
    model = build(d_model, hidden, blocks).to(device)
    full_bytes = _param_bytes(model.parameters())
    loss_fn = nn.MSELoss()
    data = [(x.to(device), y.to(device)) for x, y in _data(job["steps"] + 3, job["batch"], d_model)]
    tg = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if job["engine"] == "torch":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh(device.type, (ctx.world_size,))
        plan = {}
        for i, layer in enumerate(model):
            if isinstance(layer, nn.Linear):
                plan[str(i)] = ColwiseParallel() if layer.out_features == hidden else RowwiseParallel()
        module = parallelize_module(model, mesh, plan)
    else:
        tg = TensorGroup(None, ctx.rank, ctx.world_size)  # the tensor group is the whole world here
        module = shard_module(model, plan_tensor_parallel(model, ctx.world_size), tg)
    opt = torch.optim.Adam(module.parameters(), lr=1e-4)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(module(x), y)
        loss.backward()
        opt.step()
        return float(loss.detach())

    for x, y in data[:3]:  # warm-up
        step(x, y)
    comm_per_step = None
    if job["engine"] == "torch":
        from torch.distributed.tensor.debug import CommDebugMode

        counter = CommDebugMode()
        with counter:
            step(*data[0])
        comm_per_step = int(counter.get_total_counts())
    else:
        before = tg.all_reduces
        step(*data[0])
        comm_per_step = tg.all_reduces - before
        tg.bytes = tg.all_reduces = 0
    dist.barrier()
    t0 = time.perf_counter()
    loss = 0.0
    for x, y in data[3:]:
        loss = step(x, y)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    seconds = time.perf_counter() - t0
    if ctx.is_main:
        Path(job["out"]).write_text(json.dumps({
            "peak_mib": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
            "samples_per_s": job["steps"] * job["batch"] / seconds, "seconds": seconds, "loss": loss,
            "collectives_per_step": comm_per_step,
            "bytes_per_step": tg.bytes / job["steps"] if tg is not None else None,
            "param_bytes_rank": _param_bytes(module.parameters()), "param_bytes_full": full_bytes}))


def run_once(work: Path, **job) -> dict:
    """One spawned run of ``worker`` (2 ranks); its rank 0 results."""
    out = work / f"{job['engine']}-{time.monotonic_ns()}.json"
    # spawn puts every worker on 127.0.0.1 itself (GLOO_SOCKET_IFNAME=lo): passing it again was a TypeError
    spawn(2, "bench.tensor:worker", {**job, "out": str(out)}, threads_per_worker=1, workdir=work / "w")
    return json.loads(out.read_text())


def run(out_dir: str | None = "bench/results", steps: int = 20, batch: int = 256, repeats: int = MIN_REPEATS,
        d_model: int = D_MODEL, hidden: int = HIDDEN, blocks: int = BLOCKS, device: str = "cpu") -> str:
    check_repeats(repeats)
    work = Path(tempfile.mkdtemp(prefix="flowtrain-bench-tp-"))
    shape = dict(steps=steps, batch=batch, d_model=d_model, hidden=hidden, blocks=blocks, device=device)
    results = interleaved({engine: (lambda e=engine: run_once(work, engine=e, **shape))
                           for engine in ("flowtrain", "torch")}, repeats=repeats)
    med = {e: median(rs, key=lambda r: r["samples_per_s"]) for e, rs in results.items()}
    ft, tt = results["flowtrain"][0], results["torch"][0]
    # per pair: batch x d forward (after the row layer) and backward (before the column layer); the
    # first column layer's input is the data, which needs no gradient: one backward all-reduce fewer
    theory_count = 2 * blocks - 1
    theory_bytes = theory_count * batch * d_model * 4
    rows = [
        ("flowtrain ColumnParallelLinear/RowParallelLinear", med["flowtrain"], med["flowtrain"] / med["torch"],
         ft["collectives_per_step"], f"{ft['param_bytes_rank'] / 2**20:.2f} / {ft['param_bytes_full'] / 2**20:.2f}"),
        ("DTensor parallelize_module Colwise/Rowwise (anchor)", med["torch"], 1.0, tt["collectives_per_step"],
         f"{tt['param_bytes_rank'] / 2**20:.2f} / {tt['param_bytes_full'] / 2**20:.2f}"),
    ]
    params = sum(p.numel() for p in build(d_model, hidden, blocks).parameters())
    where = "NCCL on CUDA" if device == "cuda" else "gloo on CPU, 1 thread per rank"
    text = report("tensor", ["engine (T = 2)", "samples/s (median)", "vs anchor", "collectives per step",
                             "parameter MiB per rank / whole model"], rows,
                  notes=[f"MLP of {blocks} blocks {d_model}->{hidden}->{d_model} ({params / 1e6:.2f}M params), global "
                         f"batch {batch}, Adam, {where}, {steps} timed steps, median of {repeats} interleaved runs "
                         f"(each engine's runs: "
                         + ", ".join(f"{e} " + "/".join(f"{r['samples_per_s']:,.0f}" for r in rs)
                                     for e, rs in results.items()) + " samples/s).",
                         f"final loss flowtrain {ft['loss']:.6f}, DTensor {tt['loss']:.6f} (same model, data and "
                         f"optimizer)."], out_dir=None)
    comm_rows = [("flowtrain measured", f"{ft['bytes_per_step']:,.0f}", ft["collectives_per_step"]),
                 ("theory: 2 all-reduces of batch x d per pair, less the first pair's backward (its input "
                  "is the data: no gradient)", f"{theory_bytes:,}", theory_count)]
    text += "\n\n" + report("tensor-communication", ["all-reduced per step", "bytes", "all-reduces"], comm_rows,
                            out_dir=None)
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "tensor.md").write_text(text + "\n")
    return text


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=MIN_REPEATS, help="interleaved runs (median; at least 3)")
    ap.add_argument("--d-model", type=int, default=D_MODEL)
    ap.add_argument("--hidden", type=int, default=HIDDEN)
    ap.add_argument("--blocks", type=int, default=BLOCKS)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cpu (gloo, the README's table) or "
                    "cuda (NCCL, one GPU per rank)")
    a = ap.parse_args(argv)
    run(steps=a.steps, batch=a.batch, repeats=a.repeats, d_model=a.d_model, hidden=a.hidden, blocks=a.blocks,
        device=a.device)


if __name__ == "__main__":
    main()

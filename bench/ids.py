"""ID tables (flowtrain.train.ids) against torch.nn.EmbeddingBag on one process, and the bytes of a
published version.

* lookups/s: ``IdEmbedding`` at inference (the 64-bit keys' map to rows and the rows' gather in one
  compiled pass, ``IdTable.vectors``) vs ``EmbeddingBag`` over the same rows (its indices already rows:
  the hashing trick's cost, no map); each right after its own training case on the same batches.
* rows trained/s: a training step's forward, backward and per-row Adam (``IdEmbedding``: observe,
  one fused gather, the rows' gradients summed per row, sparse lazy Adam by ``index_select`` /
  ``index_copy_``) vs ``EmbeddingBag(sparse=True)`` + ``torch.optim.SparseAdam``. Goals (issue 49):
  lookups/s >= 0.5x and rows trained/s >= 0.9x EmbeddingBag's.
* bytes per version: a snapshot of a table of ``--ids`` rows and a delta with ``--touched`` of them
  updated (``flowtrain.train.ids.publish``).
* memory (issue 32 item 5): one rank's share of a ``--memory-ids`` table at ``--dim`` with Adam state
  sharded over ``--memory-workers`` ranks (the keys that hash to rank 0), built from empty in batches
  of keys, in a fresh subprocess: the table's state (``IdTable.state_bytes``) and how far the
  process's peak RSS rose over its size before the build (VmHWM), for a table sized to its
  rows (as a checkpoint reloads it), one grown from empty under ``--max-ids`` (a shard: straight to
  its share of the bound) and one grown from empty without a bound (doubling to 1,048,576 rows, then
  1.25x), beside the memory plan's bytes.

Cases interleaved, medians of ``--repeats`` runs (bench.timing).

    flowtrain bench ids --ids 1000000 --dim 16 --batch 4096 --touched 0.01 --memory-ids 10000000
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from bench.timing import MIN_REPEATS, check_repeats, interleaved, median, time_it
from connectors.id_keys import NO_KEY
from flowtrain.parallel.zero.units import peak_rss_bytes
from flowtrain.train.ids import IdEmbedding, IdTable, owner_of
from flowtrain.train.ids.publish import IdPublisher
from flowtrain.train.memory_plan import grown_capacity, id_table_bytes, id_table_transient


def _filled(ids: int, dim: int, optimizer: str, keys: np.ndarray | None = None) -> IdEmbedding:
    """A table holding ``keys`` (default: 0 .. ids - 1) in rows 0 .. ids - 1."""
    emb = IdEmbedding(dim, optimizer=optimizer, capacity=ids)
    emb.table.observe(np.arange(ids, dtype=np.int64) if keys is None else keys)
    return emb


def run(ids: int = 1_000_000, dim: int = 16, batch: int = 4096, steps: int = 20, touched: float = 0.01,
        repeats: int = MIN_REPEATS, seed: int = 0) -> dict:
    torch.set_num_threads(1)
    rng = np.random.default_rng(seed)
    batches = [np.minimum(rng.zipf(1.2, size=batch), ids) - 1 for _ in range(steps)]
    # the IDs' 64-bit keys as connectors.id_keys makes them (hashes): the table maps them to rows, EmbeddingBag takes
    # the rows themselves (the hashing trick's cost: no map)
    keys = _keys(0, ids)
    emb = _filled(ids, dim, "adam", keys)
    emb.train()
    bag = nn.EmbeddingBag(ids, dim, mode="sum", sparse=True)
    bag_opt = torch.optim.SparseAdam(bag.parameters(), lr=0.01)
    head = torch.ones(dim)
    offsets = torch.arange(batch)
    as_tensors = [torch.as_tensor(b) for b in batches]
    as_keys = [torch.as_tensor(keys[b]) for b in batches]

    def ids_lookup():
        emb.eval()
        with torch.no_grad():
            for k in as_keys:
                emb(k)

    def bag_lookup():
        with torch.no_grad():
            for b in as_tensors:
                bag(b, offsets)

    def ids_train():
        emb.train()
        for k in as_keys:
            (emb(k) @ head).sum().backward()
            emb.step(batch, 0.01)

    def bag_train():
        for b in as_tensors:
            bag_opt.zero_grad()
            (bag(b, offsets) @ head).sum().backward()
            bag_opt.step()

    # each lookup right after its own training, the same batches: both find in the cache what their training left
    # there (in the order lookups, then trainings, the anchor's lookup came two cases after its training with only
    # the ID table's small lookup between, the table's right after the anchor's training: warm against cold)
    runs = interleaved({"ids train": lambda: time_it(ids_train), "ids lookup": lambda: time_it(ids_lookup),
                        "bag train": lambda: time_it(bag_train), "bag lookup": lambda: time_it(bag_lookup)},
                       repeats=repeats)
    rows = steps * batch
    out = {"ids": ids, "dim": dim, "batch": batch, "steps": steps, "repeats": repeats,
           "lookups_per_s": {"flowtrain IdEmbedding": rows / median(runs["ids lookup"]),
                             "torch EmbeddingBag": rows / median(runs["bag lookup"])},
           "rows_trained_per_s": {"flowtrain IdEmbedding (Adam per row)": rows / median(runs["ids train"]),
                                  "torch EmbeddingBag + SparseAdam": rows / median(runs["bag train"])}}
    # bytes per version: a snapshot, then a delta with `touched` of the rows updated
    model = nn.Module()
    model.user = _filled(ids, dim, "sgd")
    pub = IdPublisher(model, snapshot_every=1000)
    snapshot, _ = pub.publish(1)
    n = max(1, int(ids * touched))
    rows_touched = rng.choice(ids, size=n, replace=False)
    model.user.table.apply_gradients(rows_touched, torch.ones(n, dim), 0.01)
    delta, meta = pub.publish(2)
    out["bytes_per_version"] = {"snapshot": len(snapshot), "delta": len(delta), "rows_in_delta": len(meta.tables["user"].keys),
                                "touched": touched}
    return out


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm_bytes() -> int:
    """This process's peak resident set (VmHWM: its own address space's; ``ru_maxrss`` keeps a parent's across
    fork and exec, so a subprocess of a big benchmark would report the parent's size)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return peak_rss_bytes()


def _keys(lo: int, hi: int) -> np.ndarray:
    """64-bit keys of IDs lo..hi-1 (splitmix64 of the number: spread as connectors.id_keys' hashes are)."""
    x = np.arange(lo, hi, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    keys = (x ^ (x >> np.uint64(31))).view(np.int64)
    keys[keys == NO_KEY] += 1
    return keys


GROWTH = ("sized", "max_ids", "unbounded")  # build_rank_table's tables


def build_rank_table(ids: int, dim: int, workers: int, growth: str, chunk: int = 1 << 16) -> dict:
    """In this process: rank 0's share of an ``ids``-ID table (Adam) over ``workers`` ranks, built by
    ``IdTable.observe`` on batches of the keys it owns (``chunk`` IDs of the whole table at a time), in a table
    ``growth``: "sized" to its rows (as a checkpoint reloads it), grown from empty under "max_ids" ``ids`` (the whole
    table's bound, as a shard of ``workers`` keeps it) or "unbounded"; its state, the plan's and the rise of the
    process's peak RSS."""
    share = sum(int((owner_of(_keys(lo, min(ids, lo + chunk)), workers) == 0).sum()) for lo in range(0, ids, chunk))
    before = _rss_bytes()
    table = {"sized": lambda: IdTable(dim, optimizer="adam", capacity=share),
             "max_ids": lambda: IdTable(dim, optimizer="adam", max_ids=ids, shards=workers),
             "unbounded": lambda: IdTable(dim, optimizer="adam")}[growth]()
    planned = id_table_bytes(grown_capacity(share, table.capacity, table.max_ids, table.shards), dim)  # its rows' plan
    # and its busiest moment beside them: the last growth's old tensor, or a chunk's new keys being admitted
    transient = id_table_transient(share, dim, table.capacity, table.max_ids, table.shards, -(-chunk // workers))
    t0 = time.perf_counter()
    for lo in range(0, ids, chunk):
        keys = _keys(lo, min(ids, lo + chunk))
        table.observe(keys[owner_of(keys, workers) == 0])
    seconds = time.perf_counter() - t0
    return {"ids": ids, "dim": dim, "workers": workers, "growth": growth, "sized": growth == "sized",
            "rows": len(table), "planned": planned, "planned_peak": planned + transient,
            "capacity": table.capacity, "state_bytes": table.state_bytes(), "peak_rise": _hwm_bytes() - before,
            "rss_rise": _rss_bytes() - before, "seconds": seconds}


def memory(ids: int, dim: int, workers: int, timeout: float = 1800) -> list[dict]:
    """``build_rank_table`` sized, grown under --max-ids and grown without a bound, each in a fresh subprocess (its
    own peak RSS)."""
    out = []
    for growth in GROWTH:
        code = (f"import json; from bench.ids import build_rank_table; "
                f"print(json.dumps(build_rank_table({ids}, {dim}, {workers}, {growth!r})))")
        done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1],
                              capture_output=True, text=True, timeout=timeout)
        if done.returncode:
            raise SystemExit(f"the memory build failed: {done.stderr.strip().splitlines()[-1:]}")
        out.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return out


def _memory_table(rows: list[dict]) -> str:
    r0 = rows[0]
    whole = r0["ids"] * (r0["dim"] * 2 + 1) * 4  # the rows, exp_avg and a row-wise exp_avg_sq
    lines = [f"Memory: rank 0's share of a {r0['ids']:,}-ID table at dimension {r0['dim']} with Adam state (the "
             f"whole table's rows and moments: {whole / 1e9:.2f} GB) over {r0['workers']} ranks, built from empty",
             "", "| rank 0's table | rows | capacity | planned (GB) | table state (GB) | planned peak (GB) | "
             "peak RSS rise (GB) | peak / planned | RSS rise after (GB) | seconds |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        kind = {"sized": "sized to its rows (as a checkpoint reloads it)",
                "max_ids": f"grown from empty under --max-ids {r['ids']:,} (straight to its share)",
                "unbounded": "grown from empty without --max-ids (x2 to 1,048,576 rows, then x1.25)"}[r["growth"]]
        lines.append(f"| {kind} | {r['rows']:,} | {r['capacity']:,} | {r['planned'] / 1e9:.3f} | "
                     f"{r['state_bytes'] / 1e9:.3f} | {r['planned_peak'] / 1e9:.3f} | {r['peak_rise'] / 1e9:.3f} | "
                     f"{r['peak_rise'] / r['planned_peak']:.2f} | {r['rss_rise'] / 1e9:.3f} | {r['seconds']:.1f} |")
    return "\n".join(lines)


def _table(res: dict) -> str:
    lines = [f"ID table of {res['ids']:,} rows, dimension {res['dim']}, batches of {res['batch']:,} Zipf(1.2) IDs, "
             f"{res['steps']} steps, median of {res['repeats']} interleaved runs, one process, one thread",
             "", "| case | flowtrain IdEmbedding | torch.nn.EmbeddingBag |", "|---|---:|---:|"]
    lk, tr = res["lookups_per_s"], res["rows_trained_per_s"]
    lines.append(f"| lookups/s | {lk['flowtrain IdEmbedding']:,.0f} | {lk['torch EmbeddingBag']:,.0f} |")
    lines.append(f"| rows trained/s (Adam) | {tr['flowtrain IdEmbedding (Adam per row)']:,.0f} | "
                 f"{tr['torch EmbeddingBag + SparseAdam']:,.0f} |")
    b = res["bytes_per_version"]
    lines += ["", "| version | rows | bytes |", "|---|---:|---:|",
              f"| snapshot | {res['ids']:,} | {b['snapshot']:,} |",
              f"| delta ({b['touched']:.0%} touched) | {b['rows_in_delta']:,} | {b['delta']:,} |"]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ids", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--touched", type=float, default=0.01)
    ap.add_argument("--repeats", type=int, default=MIN_REPEATS)
    ap.add_argument("--memory-ids", type=int, default=10_000_000,
                    help="the table whose per-rank memory is measured (0: skip)")
    ap.add_argument("--memory-workers", type=int, default=4)
    args = ap.parse_args(argv)
    res = run(args.ids, args.dim, args.batch, args.steps, args.touched, check_repeats(args.repeats))
    print(_table(res), flush=True)
    if args.memory_ids:
        print()
        print(_memory_table(memory(args.memory_ids, args.dim, args.memory_workers)))


if __name__ == "__main__":
    main()

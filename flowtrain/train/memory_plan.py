"""Memory per rank, planned before training (plain data, printable) and checked against a cap.

``plan_memory(model, ...)`` computes, for one layout (data-parallel workers with a ZeRO stage,
pipeline stages, tensor shards), the bytes of state one rank holds between steps: parameters,
gradients and optimizer state (Adam: two float32 moments and a step per parameter), plus the
reducer's buffers and an activation estimate for the batch size. For data parallelism the numbers
are exact for flowtrain's layouts (``flowtrain.parallel.mapreduce``: whole copies and one all-reduce
buffer per bucket; ``flowtrain.parallel.zero.sharder``: per-layer flat buffers padded to a multiple of N,
each rank's shard); for pipeline stages and tensor shards they assume an even split of the
parameters (an estimate; with ``--shard-states`` on the grid, each layer's share of a (stage, shard)
sharded over the replicas, and a step's transient from its layers whole over the tensor shards). ``fit`` prints the plan before step 0 and writes it beside what was
measured (``summary.json``'s ``training.memory``).

ID tables (``flowtrain.train.ids``: an ``IdEmbedding`` per ID column) are planned beside the dense
state: each table's rows (``--max-ids``, else ``id_rows``: the training rows, every example a new ID,
an upper bound), split evenly over the data-parallel workers (row-wise sharding), in the capacity
the table grows to (``IdTable``'s growth: it doubles from its start up to 1,048,576 rows, then grows
by 1.25x; under ``--max-ids`` straight to the rank's share of it, never past it), times the bytes of a row as ``IdTable`` lays it out: the row and
its first Adam moment (float32 each), its row-wise second moment (one float32), its Adam step, last
sight and changed flag, its key and the key index's hash slots (``KeyIndex``).
What a step gathers of them (the batch's rows and their gradients) counts with the activations. The
plan of a table equals ``IdTable.state_bytes`` of a table grown to that many rows in batches smaller
than its capacity (tests/unit/test_id_memory_plan.py).

``smallest_fit(model, cap, ...)`` is the smallest data-parallel layout (fewest workers, then the
least sharding) whose plan fits ``cap`` bytes per rank: what the "does not fit" line proposes.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch
from torch import nn

from flowtrain.parallel.deferred import is_deferred
from flowtrain.parallel.zero.sharder import STAGES
from flowtrain.parallel.zero.units import GLOO_COLLECTIVES, ZeroCollectives, shard_units
from flowtrain.train.ids.key_index import REBUILD_CHUNK, KeyIndex
from flowtrain.train.ids.table import IdTable, next_capacity
from flowtrain.train.precision import model_dtype
from flowtrain.train.preload import import_training
from flowtrain.train.shards import open_split

__all__ = ["MemoryPlan", "plan_memory", "smallest_fit", "fits_line", "gib", "worker_overhead_bytes",
           "id_table_bytes", "id_table_transient", "id_tables_held", "grown_capacity"]

ADAM_MOMENTS = 2  # exp_avg, exp_avg_sq
FLOAT = 4  # bytes of a float32
STEP = 4  # bytes of Adam's step per parameter (a float32 scalar, also under --dtype float64)
ACTIVATION_COPIES = 3  # each layer's output, what autograd saves of it and its gradient


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes one rank holds (the busiest rank) for a layout."""

    workers: int
    shard_states: str
    stages: int
    tensor_parallel: int
    parameters: int
    gradients: int
    optimizer: int
    buffers: int  # the reducer's communication buffers
    activations: int  # an estimate for the batch size
    exact: bool  # False: pipeline stages / tensor shards, estimated from an even split
    id_tables: int = 0  # the ID tables' state on this rank (rows, Adam moments and steps, bookkeeping, key index)
    id_rows: int = 0  # the ID tables' rows on this rank, all tables
    id_bound: str = ""  # where id_rows comes from: "--max-ids", "training rows" (an upper bound), "held now"
    # ZeRO-2/3 during a step, on top of ``state``: the layer gathered for its backward (ZeRO-3), its whole gradients
    # and reduce-scatter buffer, and the previous layer's buffer still in flight (the step's peak, not held between)
    transient: int = 0
    # ``fit``'s copy of the best weights so far (``keeps_best``): the whole model, or a ZeRO-3 rank's shard of it
    best_weights: int = 0

    @property
    def state(self) -> int:
        """Parameters + gradients + optimizer state + buffers + ID tables: what ``measured.total`` counts."""
        return self.parameters + self.gradients + self.optimizer + self.buffers + self.id_tables

    @property
    def total(self) -> int:
        return self.state + self.best_weights + self.transient + self.activations

    @property
    def layout(self) -> str:
        parts = [f"--workers {self.workers}"]
        if self.shard_states != "none":
            parts.append(f"--shard-states {self.shard_states}")
        if self.stages > 1:
            parts.append(f"--stages {self.stages}")
        if self.tensor_parallel > 1:
            parts.append(f"--tensor-parallel {self.tensor_parallel}")
        return " ".join(parts)

    def as_dict(self) -> dict:
        return {**asdict(self), "state": self.state, "total": self.total, "layout": self.layout}

    def describe(self) -> str:
        kind = "" if self.exact else " (estimate: an even split of the parameters)"
        ids = (f", ID tables {gib(self.id_tables)} ({self.id_rows:,} rows with Adam state and key index, "
               f"{self.id_bound})" if self.id_rows or self.id_tables else "")
        step = f", during a step {gib(self.transient)} (its busiest moment: a gathered layer, its gradients, " \
            f"buffers in flight, an ID table's growth)" if self.transient else ""
        step += f", best weights {gib(self.best_weights)}" if self.best_weights else ""
        return (f"memory plan per rank, {self.layout}{kind}: parameters {gib(self.parameters)}, gradients "
                f"{gib(self.gradients)}, optimizer state {gib(self.optimizer)}, reduce buffers {gib(self.buffers)}"
                f"{ids}{step}, activations ~{gib(self.activations)}; total {gib(self.total)}")


def id_table_bytes(rows: int, dim: int, optimizer: str = "adam") -> int:
    """Bytes of an ``IdTable`` of ``rows`` rows at ``dim``: what its ``state_bytes`` says when it holds them."""
    rows = max(1, int(rows))
    # a row's bytes as the table lays them out (the row, exp_avg, its row-wise exp_avg_sq; Adam step, last sight,
    # changed flag): a one-row table's, less its key index
    per_row = IdTable(dim, optimizer=optimizer, capacity=1).state_bytes() - KeyIndex.planned_bytes(1)
    return rows * per_row + KeyIndex.planned_bytes(rows)


ADMIT_BYTES_PER_ELEMENT = 64  # the float64 temporaries of a new row's initial values, per element (16,384 keys a chunk)
ADMIT_BYTES_PER_KEY = 96  # a batch's per-key bookkeeping (unique keys, positions, counts, rows), int64
REBUILD_BYTES_PER_KEY = 240  # the key index's rebuild after a growth: its probing temporaries per key of a chunk


def id_table_transient(rows: int, dim: int, start: int, bound: int | None = None, shards: int = 1,
                       new_keys: int = 4096, dtype_bytes: int = FLOAT) -> int:
    """Bytes a table of ``rows`` rows holds on top of its state at its busiest moment (measured with tracemalloc:
    ``tests/unit/test_id_memory_plan.py``): the larger of its last growth (``IdTable._grow`` pads one tensor at a
    time: the old copy of a ``[capacity, dim]`` tensor beside the new ones) and a batch admitting ``new_keys`` new
    IDs (their initial rows drawn in float64, 16,384 keys at a time, and the batch's bookkeeping)."""
    capacity, previous = max(1, int(start)), 0
    while capacity < rows and (bound is None or capacity < bound):
        previous, capacity = capacity, next_capacity(capacity, bound, shards)
    # a growth: the old copy of one [capacity, dim] tensor beside the new ones, then the key index rebuilt a chunk of
    # keys at a time
    growth = max(previous * dim * dtype_bytes, min(previous, REBUILD_CHUNK) * REBUILD_BYTES_PER_KEY) if previous else 0
    admit = min(new_keys, 16_384) * dim * ADMIT_BYTES_PER_ELEMENT + new_keys * ADMIT_BYTES_PER_KEY
    return max(growth, admit)


def grown_capacity(rows: int, start: int, bound: int | None = None, shards: int = 1) -> int:
    """The capacity a table that starts at ``start`` rows reaches holding ``rows`` (``IdTable._grow``: the steps of
    ``next_capacity``; under ``bound``, straight to a shard's share of it, never past it)."""
    capacity = max(1, int(start))
    while capacity < rows and (bound is None or capacity < bound):
        capacity = next_capacity(capacity, bound, shards)
    return capacity


def _id_tables(model: nn.Module) -> list[tuple[IdTable, int]]:
    """Each ID table of ``model`` and the number of ranks it is already sharded over (1: whole)."""
    return [(m.table, int(getattr(m, "world", 1))) for m in model.modules() if isinstance(getattr(m, "table", None),
                                                                                          IdTable)]


def id_tables_held(model: nn.Module) -> int:
    """Bytes of the ID tables this rank holds now (``IdTable.state_bytes``, all tables)."""
    return sum(t.state_bytes() for t, _ in _id_tables(model))


def _plan_ids(model: nn.Module, workers: int, id_rows: int | None, batch_size: int) -> tuple[int, int, str, int]:
    """(bytes, rows, where the rows come from, a step's gathered rows and gradients, the tables' growth or a batch's
    admission: the largest of one table's, ``id_table_transient``) of the ID tables per rank."""
    total = rows_all = step = transient = 0
    sources = set()
    for table, world in _id_tables(model):
        if table.max_ids is not None:
            whole, source = table.max_ids, "--max-ids"
        elif id_rows is not None:
            whole, source = id_rows, "training rows: an upper bound"
        else:
            whole, source = len(table) * world, "held now"
        split = max(world, workers)
        rows = -(-int(whole) // split)
        sources.add(source)
        total += id_table_bytes(grown_capacity(rows, table.capacity, table.max_ids, split), table.dim,
                                table.optimizer)
        rows_all += rows
        step += 2 * min(rows, -(-batch_size // split)) * table.dim * FLOAT  # the gathered rows and their gradients
        transient = max(transient, id_table_transient(rows, table.dim, table.capacity, table.max_ids, split,
                                                      min(rows, batch_size), table.weight.element_size()))
    return total, rows_all, ", ".join(sorted(sources)), step, transient


def _units(model: nn.Module, stage: str = "parameters", bucket_mb: float = 1.0) -> list[list[int]]:
    """Parameter sizes per unit, as ``flowtrain.parallel.zero.units`` lays them out for ``stage``."""
    return [[p.numel() for p in params] for _, params in shard_units(model, stage, bucket_mb)]


def _activation_widths(model: nn.Module) -> int:
    width = 0
    for m in model.modules():
        if isinstance(m, nn.Linear):
            width += m.out_features
        elif isinstance(m, nn.Embedding):
            width += m.embedding_dim
    return width


def _owned(sizes: list[int], rank: int, world: int) -> tuple[int, int, int]:
    """(shard length, owned parameter elements, owned pieces) of ``rank`` in a unit."""
    numel = sum(sizes)
    shard = -(-numel // world)
    lo, hi = rank * shard, (rank + 1) * shard
    owned = pieces = off = 0
    for n in sizes:
        a, b = max(off, lo), min(off + n, hi)
        if b > a:
            owned += b - a
            pieces += 1
        off += n
    return shard, owned, pieces


def plan_memory(model: nn.Module, *, workers: int = 1, shard_states: str = "none", stages: int = 1,
                tensor_parallel: int = 1, batch_size: int = 256, bucket_mb: float = 1.0,
                id_rows: int | None = None, dtype: torch.dtype | None = None, backend: str = "gloo",
                keeps_best: bool = False) -> MemoryPlan:
    """The plan of one layout (module doc); ``workers`` are the data-parallel replicas; ``id_rows``: the rows an
    ID table without ``--max-ids`` is planned for (default: what it holds now); ``dtype``: the training's floating
    type (``--dtype``; default: the model's); ``backend``: the collectives' (gloo's all-to-alls have receive
    buffers and temporary copies that NCCL's reduce-scatter and all-gather do not); ``keeps_best``: ``fit``'s copy of
    the best weights so far counts (the whole model, a stage's share of it; ZeRO-3 over data-parallel workers keeps
    none: its best weights stay in their checkpoint)."""
    fb = (dtype or model_dtype(model)).itemsize
    plan = _plan_dense(model, workers, shard_states, stages, tensor_parallel, batch_size, bucket_mb, fb, backend)
    if keeps_best and not (shard_states == "parameters" and workers > 1 and stages * tensor_parallel == 1):
        # ZeRO-3 on data parallelism keeps its best weights in their own checkpoint, not in memory
        whole = sum(p.numel() for p in model.parameters()) * fb
        plan = replace(plan, best_weights=-(-whole // (stages * tensor_parallel)))
    ids, rows, source, step, growth = _plan_ids(model, workers, id_rows, batch_size)
    if not rows and not ids:
        return plan
    # a table's growth or a batch's admissions (forward) and the dense step's transient (backward): never at once
    return replace(plan, id_tables=ids, id_rows=rows, id_bound=source, activations=plan.activations + step,
                   transient=max(plan.transient, growth))


def _plan_dense(model: nn.Module, workers: int, shard_states: str, stages: int, tensor_parallel: int,
                batch_size: int, bucket_mb: float, fb: int = FLOAT, backend: str = "gloo") -> MemoryPlan:
    units = _units(model, shard_states if shard_states != "none" else "parameters", bucket_mb)
    sizes = [n for u in units for n in u]
    total, count = sum(sizes), len(sizes)
    rows = -(-batch_size // max(1, workers))
    activations = rows * _activation_widths(model) * fb * ACTIVATION_COPIES
    ways = _collectives(workers, backend)
    # a deferred construction (a model still on the meta device) makes one parameter whole at a time: its values
    largest = max(sizes, default=0) if is_deferred(model) else 0
    if stages > 1 or tensor_parallel > 1:
        split = stages * tensor_parallel
        if shard_states != "none" and workers > 1:  # ZeRO over each (stage, shard)'s replicas: of an even split
            share = [[-(-n // split) for n in u] for u in units]
            widest = [[-(-n // tensor_parallel) for n in u] for u in units]  # a stage gathers its layers whole
            plan = _plan_zero(share, workers, shard_states, -(-activations // stages), False, widest, fb, ways, 0)
            return replace(plan, stages=stages, tensor_parallel=tensor_parallel, exact=False)
        p = -(-total // split)
        buffers = p * fb if workers > 1 else 0
        return MemoryPlan(workers, shard_states, stages, tensor_parallel, p * fb, p * fb,
                          ADAM_MOMENTS * p * fb + -(-count // split) * STEP, buffers,
                          -(-activations // stages), exact=False)
    if shard_states == "none":
        buffers = (total + 2 + count) * fb if workers > 1 else 0  # every bucket's all-reduce buffer
        return MemoryPlan(workers, shard_states, 1, 1, total * fb, total * fb,
                          ADAM_MOMENTS * total * fb + count * STEP, buffers, activations, exact=True)
    return _plan_zero(units, workers, shard_states, activations, _has_own_parameters(model), units, fb, ways,
                      largest)


def _collectives(workers: int, backend: str) -> ZeroCollectives:
    """The ways of ZeRO's collectives a run on ``workers`` ranks of ``backend`` takes (``choose_collectives``)."""
    if backend != "gloo" or workers < 2:
        return ZeroCollectives()
    return GLOO_COLLECTIVES[min(workers, max(GLOO_COLLECTIVES))]


def _plan_zero(units: list[list[int]], workers: int, shard_states: str, activations: int, root_unit: bool,
               step_units: list[list[int]], fb: int = FLOAT, ways: ZeroCollectives | None = None,
               largest: int = 0) -> MemoryPlan:
    """The busiest rank's ZeRO state over ``units`` (parameter sizes per unit); ``step_units``: the units a step
    gathers and reduces (the transient; on the grid a stage's layers whole over its tensor shards); ``largest``: the
    largest parameter (made whole for a moment by a deferred construction)."""
    best = None
    ways = ways or ZeroCollectives()
    for rank in range(workers):
        shard = owned = pieces = padded = 0
        for u in units:
            s, o, k = _owned(u, rank, workers)
            shard, owned, pieces, padded = shard + s, owned + o, pieces + k, padded + s * workers
        optimizer = ADAM_MOMENTS * owned * fb + pieces * STEP
        if shard_states == "parameters":
            params, grads, buffers = shard * fb, shard * fb, 0
        elif shard_states == "gradients":
            params, grads, buffers = (padded + shard) * fb, shard * fb, 0
        else:  # optimizer: whole gradients (views of each bucket's padded flat buffer) stay until the next step
            params, grads, buffers = (padded + shard) * fb, (padded + shard) * fb, 0
        transient = max(_step_transient(step_units, shard_states, workers, root_unit, ways), largest) * fb
        plan = MemoryPlan(workers, shard_states, 1, 1, params, grads, optimizer, buffers, activations, exact=True,
                          transient=transient)
        if best is None or plan.state > best.state:
            best = plan
    return best


def _has_own_parameters(model: nn.Module) -> bool:
    return any(p.requires_grad for p in model.parameters(recurse=False))


def _step_transient(units: list[list[int]], stage: str, workers: int, root_unit: bool,
                    ways: ZeroCollectives | None = None) -> int:
    """Elements a ZeRO rank holds during a step on top of its state, at its peak (``flowtrain.parallel.zero.sharder``; the
    reduce-scatters run in reverse unit order, at most one still in flight when the next is launched):

    - unit k's reduce-scatter buffer filled: its whole gradients and that buffer (padded), the one launched before
      it still in flight (N > 1), and with ZeRO-3 unit k gathered plus the root's own parameters (gathered from
      forward until backward);
    - unit k launched: its buffer, with gloo's all-to-all reduce-scatter its receive buffer (padded: the N slices
      summed when it is waited on), and the one before it in flight with its own;
    - ZeRO-3, a unit gathered (before its forward, an evaluation's, its backward's regather while the unit after it
      is in flight): the unit, and with the all-to-all gather its temporary (the shard repeated N times, padded);
    - ZeRO-1: the gradients are the buckets' flat buffers (in its state); the all-to-all's receive buffers of the
      two buckets in flight."""
    ways = ways or ZeroCollectives()
    multi = workers > 1
    padded = [-(-sum(u) // workers) * workers for u in units]
    recv = 1 if multi and ways.reduce_scatter == "all_to_all" else 0
    temp = 1 if multi and ways.gather(stage) == "all_to_all" else 0
    root = padded[0] if stage == "parameters" and root_unit and units else 0

    def in_flight(j: int) -> int:
        return padded[j] * (1 + recv) if multi and 0 <= j < len(units) else 0
    worst = 0
    for k in range(len(units)):
        if stage == "optimizer":
            worst = max(worst, recv * (padded[k] + (padded[k + 1] if k + 1 < len(units) else 0)))
            continue
        filled = sum(units[k]) + padded[k] + in_flight(k + 1)
        launched = padded[k] * (1 + recv) + in_flight(k + 1)
        if stage == "parameters":
            others = root if k > 0 else 0
            held = max(filled + padded[k], launched) + others
            held = max(held, padded[k] * (1 + temp) + others)  # its gather (forward, evaluation)
            if k > 0:  # the unit before it regathered for its backward while unit k's collective is in flight
                held = max(held, padded[k - 1] * (1 + temp) + in_flight(k) + (root if k > 1 else 0))
        else:
            held = max(filled, launched)
        worst = max(worst, held)
    return worst


def smallest_fit(model: nn.Module, cap: int, *, batch_size: int = 256, bucket_mb: float = 1.0,
                 max_workers: int = 64, id_rows: int | None = None, dtype: torch.dtype | None = None,
                 keeps_best: bool = False) -> MemoryPlan | None:
    """The fewest data-parallel workers, then the least sharding, whose plan fits ``cap`` bytes."""
    workers = 1
    while workers <= max_workers:
        for stage in STAGES if workers > 1 else ("none",):
            plan = plan_memory(model, workers=workers, shard_states=stage, batch_size=batch_size, bucket_mb=bucket_mb,
                               id_rows=id_rows, dtype=dtype, keeps_best=keeps_best)
            if plan.total <= cap:
                return plan
        workers *= 2
    return None


def worker_overhead_bytes(data=None) -> int:
    """A worker's fixed overhead, calibrated on this process (the interpreter, torch and flowtrain's imports:
    what every worker loads before its first tensor): its resident set now. With ``data`` (a ``TabularDataset``) its
    training and validation splits are opened first, as a training worker opens them before it is capped (the
    reader's buffers and threads are part of a worker's fixed overhead)."""
    import os

    if data is not None:  # a training worker imports training's lazy libraries before it is capped (loop.fit)
        import_training()
    opened = [open_split(data, split) for split in ("train", "valid")] if data is not None else []
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    finally:
        del opened  # measured with them open


def fits_line(plan: MemoryPlan, model: nn.Module, cap: int, *, batch_size: int = 256, overhead: int = 0,
              id_rows: int | None = None, dtype: torch.dtype | None = None, bucket_mb: float = 1.0,
              keeps_best: bool = False) -> str | None:
    """None when ``plan`` (plus a worker's fixed ``overhead``) fits ``cap`` bytes per rank, else the one line
    that stops the run: what it needs per rank and the smallest data-parallel layout that fits."""
    if cap <= overhead:
        return (f"--worker-memory {gib(cap)} is below a worker's fixed overhead ({gib(overhead)}: the interpreter, "
                f"torch and flowtrain's imports, measured in this process): give more than that")
    if plan.total + overhead <= cap:
        return None
    fit = smallest_fit(model, cap - overhead, batch_size=batch_size, id_rows=id_rows, dtype=dtype, bucket_mb=bucket_mb,
                       keeps_best=keeps_best)
    proposal = (f"`{fit.layout}`: {gib(fit.total + overhead)}" if fit
                else "no data-parallel layout up to 64 workers fits")
    return (f"does not fit --worker-memory {gib(cap)}: {plan.layout} needs {gib(plan.total + overhead)} per rank "
            f"(a worker's fixed {gib(overhead)} included); {proposal}")

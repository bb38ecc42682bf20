"""ID embeddings as a model input: ``IdEmbedding`` (one process) and ``ShardedIdEmbedding`` (row-wise
across the data-parallel ranks).

``emb(keys)`` maps int64 keys ``[N]`` to vectors ``[N, dim]``. In training (``emb.training`` and
grad enabled) the table observes the keys (counts, admits, expires: ``IdTable.observe``) and
the vectors are leaves of autograd; after the backward pass ``emb.step(global_n, lr)`` applies
the table's optimizer to the rows used, with their gradient divided by the global example count
(as ``flowtrain.parallel``'s reducer divides the dense ones). The fallback vector is a dense
``nn.Parameter``: the dense optimizer and reducer train it like any other weight. At inference an
unknown ID uses the fallback vector and is counted (``table.stats.unknown``).

The table rides in the module's ``state_dict`` as flat tensors (``<name>.table.<part>``), so a checkpoint and a bundle
carry the whole table, with its optimizer state and counters.

Sharding: the rank that owns a key is ``key mod N`` (as unsigned). A forward pass sends each
occurrence's (global position, key) to its owner (``torch.distributed.all_to_all_single`` with
split sizes: gloo's alltoallv, in this torch), the owner observes them in global order, exactly as one process would,
and sends the rows back; ``step`` sends each occurrence's gradient to the owner, which sums them
per row. So the parameters equal one process's on the same data (to float summation order).

``--max-ids`` bounds the whole table, as in one process, not each shard: a batch that would take the
table past it evicts the globally least recently seen IDs (``_GlobalBound``: the ranks gather how many
IDs each admits and holds, then, only when the bound is reached, each rank's least recently seen
candidates and the first positions of its new IDs), and the new IDs that still find no row wait in
first-occurrence order, the same IDs one process would evict and admit (the events' positions, and
so every row's last sight, are global and distinct). A shard holds at most ``max_ids`` rows.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from connectors.id_keys import NO_KEY, is_key
from flowtrain.train.ids.table import Delta, IdTable, table_from_tensors, table_tensors

TABLE = "table."  # the state_dict keys of an ID table: <module>.table.<part>


def packed_state(base: dict, keys: torch.Tensor, weight: torch.Tensor, *, last_seen: torch.Tensor | None = None,
                 row_step: torch.Tensor | None = None, exp_avg: torch.Tensor | None = None,
                 exp_avg_sq: torch.Tensor | None = None, pending_keys: torch.Tensor | None = None,
                 pending: torch.Tensor | None = None, stats: dict | None = None) -> dict:
    """An ``IdTable.state_dict`` holding exactly these rows, packed into rows ``0..n-1`` (no free row, nothing
    dirty or evicted), its configuration, clock and prune point from ``base`` (another table's state):
    what a shard keeps of a whole table, the whole table gathered from its shards, a published snapshot.
    Without ``last_seen``/``row_step`` the rows are unseen (0); without ``pending`` nothing waits."""
    n = len(keys)
    none = torch.zeros(0, dtype=torch.int64)
    return {**base, "capacity": max(1, n), "rows": torch.arange(n), "keys": keys, "weight": weight,
            "last_seen": torch.zeros(n, dtype=torch.int64) if last_seen is None else last_seen,
            "row_step": torch.zeros(n, dtype=torch.int64) if row_step is None else row_step,
            "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "free": none, "dirty": none, "evicted": none,
            "pending_keys": none if pending_keys is None else pending_keys,
            "pending": torch.zeros((0, 2), dtype=torch.int64) if pending is None else pending,
            "stats": {} if stats is None else stats}


class _TableState:
    """An ID table in the module's ``state_dict`` as flat tensors (``<prefix>table.<part>``): checkpoints,
    ``torch.load(weights_only=True)`` and safetensors bundles carry it like any weight."""

    table: IdTable

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for k, v in table_tensors(self.table).items():
            destination[prefix + TABLE + k] = v

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        mine = {k[len(prefix + TABLE):]: v for k, v in state_dict.items() if k.startswith(prefix + TABLE)}
        if mine:
            self._load_table(mine)
        elif strict:
            missing_keys.append(prefix + TABLE + "config")
        rest = {k: v for k, v in state_dict.items() if not k.startswith(prefix + TABLE)}
        super()._load_from_state_dict(rest, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def _load_table(self, tensors: dict) -> None:
        dtype = self.table.dtype
        self.table = table_from_tensors(tensors)
        self.table.to_dtype(dtype)  # the model's type (--dtype), whatever the state was saved in

    def _apply(self, fn, recurse=True):
        """``.to(dtype)``, ``.double()``, ``.float()`` convert the table's rows and moments too (it stays on the CPU)."""
        out = super()._apply(fn, recurse)
        want = fn(torch.zeros(0, dtype=self.table.dtype)).dtype
        if want != self.table.dtype and want.is_floating_point:
            self.table.to_dtype(want)
        return out


class IdEmbedding(_TableState, nn.Module):
    def __init__(self, dim: int, **table_options):
        super().__init__()
        self.dim = int(dim)
        self.table = IdTable(self.dim, **table_options)
        self.fallback = nn.Parameter(torch.zeros(self.dim))
        self.grow = True  # training observes (the stream trainer and the batch run); False: a fixed table
        self._pending: tuple[np.ndarray, torch.Tensor] | None = None

    def forward(self, keys: torch.Tensor) -> torch.Tensor:
        """One row per key, the fallback vector where there is none. In training: the rows' map
        (``IdTable.observe``: counts, admits, expires), then one gather (``_IdRows``), each occurrence's gradient kept
        for ``step``, which sums them per row; else ``IdTable.vectors`` (the map and the gather, one compiled pass
        where built)."""
        keys_np = keys.detach().to("cpu", torch.int64).numpy()
        train = self.training and self.grow and torch.is_grad_enabled()
        if not train:  # a lookup: the rows' vectors, the fallback vector where there is no row
            return self.table.vectors(keys_np, self.fallback)[1]
        rows = self.table.observe(keys_np, self.fallback)
        self._pending = (rows, _Sink())
        return _IdRows.apply(self.fallback, self.table.weight, rows, self._pending[1])

    def step(self, global_n: int, lr: float) -> None:
        """The table's optimizer step for the rows the last training forward used: each occurrence's gradient
        summed per row (one sort of the batch's rows, as a sparse gradient's coalesce), then ``apply_gradients``."""
        if self._pending is None:
            return
        rows, sink = self._pending
        self._pending = None
        if sink.grad is None or not global_n:
            return
        grad = sink.grad
        if (rows < 0).any():  # occurrences on the fallback vector: not the table's
            at = np.flatnonzero(rows >= 0)
            if not len(at):
                return
            rows, grad = rows[at], grad.index_select(0, torch.from_numpy(at))
        used, inv = torch.unique(torch.from_numpy(rows), return_inverse=True)
        summed = torch.zeros(len(used), self.dim, dtype=grad.dtype).index_add_(0, inv, grad)
        self.table.apply_gradients(used.numpy(), summed.div_(global_n), lr)


class _Sink:
    """Where ``_IdRows``' backward leaves each occurrence's gradient (``grad``: ``[n, dim]``)."""
    grad: torch.Tensor | None = None


class _IdRows(torch.autograd.Function):
    """``weight[rows]``, the fallback vector where a row is -1: one ``index_select`` and, for the few without a
    row, one ``index_copy_``. Backward: the fallback's gradient (the sum over the occurrences without a row) to
    autograd, every occurrence's gradient to ``sink`` (the table's rows are not autograd's: ``IdEmbedding.step``
    applies them), no copy of a gradient per row."""

    @staticmethod
    def forward(ctx, fallback, weight, rows, sink):
        out = weight.index_select(0, torch.from_numpy(np.maximum(rows, 0)))
        none = torch.from_numpy(np.flatnonzero(rows < 0))
        if len(none):
            out.index_copy_(0, none, fallback.detach().to(out.dtype).expand(len(none), -1))
        ctx.none, ctx.sink = none, sink
        return out

    @staticmethod
    def backward(ctx, grad):
        if ctx.sink is not None:
            ctx.sink.grad = grad
        g_fallback = grad.index_select(0, ctx.none).sum(0) if len(ctx.none) else grad.new_zeros(grad.shape[1:])
        return g_fallback, None, None, None


def owner_of(keys: np.ndarray, world: int) -> np.ndarray:
    """The rank that owns each key: the key (as unsigned 64 bits) mod ``world``."""
    return (np.asarray(keys, dtype=np.int64).view(np.uint64) % np.uint64(world)).astype(np.int64)


def _exchange(tensors: list[torch.Tensor], group=None) -> list[torch.Tensor]:
    """All-to-all of tensors of any first dimension: the sizes first (``all_to_all`` of one number
    per peer), then the rows in one ``all_to_all_single`` with split sizes (gloo's ``all_to_all`` of a
    tensor list needs equal shapes; its ``alltoallv`` does not)."""
    world = len(tensors)
    sizes = [torch.tensor([t.shape[0]], dtype=torch.int64) for t in tensors]
    got_sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_to_all(got_sizes, sizes, group=group)
    tail, dtype = tuple(tensors[0].shape[1:]), tensors[0].dtype
    send = [int(s) for s in sizes]
    recv = [int(s) for s in got_sizes]
    out = torch.empty((sum(recv), *tail), dtype=dtype)
    dist.all_to_all_single(out, torch.cat([t.contiguous() for t in tensors]), output_split_sizes=recv,
                           input_split_sizes=send, group=group)
    return list(torch.split(out, recv))


class _GlobalBound:
    """``IdTable.observe``'s ``bound`` for a table sharded over a group: ``--max-ids`` over all the shards (a
    collective; every rank's table calls it once per training batch)."""

    def __init__(self, group=None):
        self.group = group

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        out = [torch.empty_like(t) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(out, t.contiguous(), group=self.group)
        return torch.stack(out)

    def __call__(self, table: IdTable, firsts: np.ndarray, start: int) -> int:
        mine = len(firsts)
        sizes = self._gather(torch.tensor([mine, len(table)], dtype=torch.int64))
        admits, held = int(sizes[:, 0].sum()), int(sizes[:, 1].sum())
        free = max(0, table.max_ids - held)
        short = admits - free
        if short <= 0:  # under the bound: every new ID gets a row
            return mine
        # the `short` least recently seen rows of the whole table (last sights are global positions, distinct)
        cand = table.lru_candidates(short, start)
        last = np.full(short, np.iinfo(np.int64).max, dtype=np.int64)
        last[: len(cand)] = table.last_seen[cand]
        every = self._gather(torch.from_numpy(last)).reshape(-1)
        every = torch.sort(every[every < np.iinfo(np.int64).max]).values
        evicted = min(short, len(every))
        if evicted:
            table.evict_lru(cand[table.last_seen[cand] <= int(every[evicted - 1])])
        # the rows freed go to the new IDs in the order one process admits them: first occurrence in the batch
        width = int(sizes[:, 0].max())
        pos = np.full(width, np.iinfo(np.int64).max, dtype=np.int64)
        pos[:mine] = firsts
        order = self._gather(torch.from_numpy(pos)).reshape(-1)
        order = torch.sort(order[order < np.iinfo(np.int64).max]).values
        slots = free + evicted
        if slots <= 0:
            return 0
        cutoff = int(order[min(slots, len(order)) - 1])
        return int((firsts <= cutoff).sum())


class ShardedIdEmbedding(_TableState, nn.Module):
    """The rows of the keys this rank owns (``key mod world == rank``); see the module docstring."""

    def __init__(self, dim: int, rank: int, world: int, group=None, *, max_ids: int | None = None,
                 **table_options):
        super().__init__()
        self.dim, self.rank, self.world, self.group = int(dim), int(rank), int(world), group
        # the bound of the whole table; under it, this rank's table grows straight to its share (max_ids / world)
        self.table = IdTable(self.dim, max_ids=max_ids, shards=self.world, **table_options)
        self.fallback = nn.Parameter(torch.zeros(self.dim))
        self.grow = True
        self._pending = None

    def _offset(self, n_local: int) -> tuple[int, int]:
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(sizes, torch.tensor([n_local], dtype=torch.int64), group=self.group)
        sizes = [int(s) for s in sizes]
        return sum(sizes[: self.rank]), sum(sizes)

    def forward(self, keys: torch.Tensor) -> torch.Tensor:
        """A collective: every rank calls it, with its own (possibly empty) keys."""
        keys_np = keys.detach().to("cpu", torch.int64).numpy()
        n = len(keys_np)
        train = self.training and self.grow and torch.is_grad_enabled()
        offset, total = self._offset(n)
        has_key = is_key(keys_np)
        owners = owner_of(keys_np, self.world)
        sent_idx = [np.nonzero(has_key & (owners == d))[0] for d in range(self.world)]
        requests = [torch.as_tensor(np.stack([idx + offset, keys_np[idx]], axis=1).reshape(-1, 2))
                    for idx in sent_idx]
        asked = _exchange(requests, self.group)  # per source rank: [m, 2] (global position, key)
        # the owner: every occurrence of its keys in the global batch, in global order
        if train:
            seq = np.full(total, NO_KEY, dtype=np.int64)
            for a in asked:
                seq[a[:, 0].numpy()] = a[:, 1].numpy()
            bound = _GlobalBound(self.group) if self.table.max_ids is not None else None
            rows_seq = self.table.observe(seq, self.fallback, bound)
            # counted as one process counts: the owner its keys without a row (not the others' positions), the
            # reader its values without a key (they go to no owner)
            self.table.stats.fallback_lookups += int((~has_key).sum()) - int((seq == NO_KEY).sum())
            answers_rows = [rows_seq[a[:, 0].numpy()] for a in asked]
        else:
            answers_rows = [self.table.rows_of(a[:, 1].numpy()) for a in asked]
        replies = []
        for rows in answers_rows:
            vec = torch.zeros(len(rows), self.dim + 1, dtype=self.table.dtype)
            known = rows >= 0
            if known.any():
                vec[torch.as_tensor(known), : self.dim] = self.table.weight[torch.as_tensor(rows[known])]
            vec[:, self.dim] = torch.as_tensor(known, dtype=self.table.dtype)
            replies.append(vec)
        got = _exchange(replies, self.group)  # per owner: [m, dim + 1] in the order this rank asked
        vectors = torch.zeros(n, self.dim, dtype=self.table.dtype)
        found = np.zeros(n, dtype=bool)
        for d, idx in enumerate(sent_idx):
            if len(idx):
                vectors[torch.as_tensor(idx)] = got[d][:, : self.dim]
                found[idx] = got[d][:, self.dim].numpy() > 0.5
        if train:
            self._pending = (sent_idx, answers_rows, found)
            vectors.requires_grad_(True)
            self._vectors = vectors
        mask = torch.as_tensor(found)[:, None]
        return torch.where(mask, vectors, self.fallback[None, :].expand(n, self.dim))

    def step(self, global_n: int, lr: float) -> None:
        """A collective after backward: each occurrence's gradient to its owner, summed per row."""
        if self._pending is None:
            return
        sent_idx, answers_rows, found = self._pending
        vectors, self._pending, self._vectors = self._vectors, None, None
        grad = vectors.grad if vectors.grad is not None else torch.zeros_like(vectors)
        grads = _exchange([grad[torch.as_tensor(idx)].reshape(-1, self.dim) for idx in sent_idx], self.group)
        rows = np.concatenate([r for r in answers_rows]) if answers_rows else np.zeros(0, np.int64)
        g = torch.cat(grads) if grads else torch.zeros(0, self.dim, dtype=self.table.dtype)
        keep = rows >= 0
        if keep.any() and global_n:
            used, inv = np.unique(rows[keep], return_inverse=True)
            summed = torch.zeros(len(used), self.dim, dtype=g.dtype).index_add_(0, torch.as_tensor(inv),
                                                                               g[torch.as_tensor(keep)])
            self.table.apply_gradients(used, summed / global_n, lr)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + TABLE + "shard"] = torch.tensor([self.rank, self.world], dtype=torch.int64)

    def _load_table(self, tensors: dict) -> None:
        """A shard written by this rank of this world, or a whole table (``full_table_tensors``: a checkpoint
        of any number of workers), of which this rank keeps the keys it owns."""
        shard = tensors.pop("shard", None)
        if shard is not None:
            rank, world = (int(x) for x in shard.tolist())
            if (rank, world) != (self.rank, self.world):
                raise ValueError(f"this ID table shard was written by rank {rank} of {world} workers: resume with "
                                 f"--workers {world}")
            dtype = self.table.dtype
            self.table = table_from_tensors(tensors)
            self.table.shards = self.world
            self.table.to_dtype(dtype)
            return
        whole = table_from_tensors(tensors)
        state = whole.state_dict()
        mine = owner_of(state["keys"].numpy(), self.world) == self.rank
        pmine = owner_of(state["pending_keys"].numpy(), self.world) == self.rank
        sel, psel = torch.as_tensor(mine), torch.as_tensor(pmine)
        state = packed_state(
            state, state["keys"][sel], state["weight"][sel], last_seen=state["last_seen"][sel],
            row_step=state["row_step"][sel], exp_avg=None if state["exp_avg"] is None else state["exp_avg"][sel],
            exp_avg_sq=None if state["exp_avg_sq"] is None else state["exp_avg_sq"][sel],
            pending_keys=state["pending_keys"][psel], pending=state["pending"][psel],
            stats=state["stats"] if self.rank == 0 else {})  # the counters once: gather_full_table sums them
        dtype = self.table.dtype
        self.table = IdTable.from_state(state)
        self.table.shards = self.world
        self.table.to_dtype(dtype)

    def full_table_tensors(self) -> dict[str, torch.Tensor]:
        """The whole table's flat tensors on every rank (a collective)."""
        return table_tensors(gather_full_table(self, dst=None))


def gather_full_table(emb: ShardedIdEmbedding, dst: int | None = 0) -> IdTable | None:
    """The whole table on rank ``dst`` (every rank when None; a collective): every shard's rows, bookkeeping
    and optimizer state in one ``IdTable`` (what a bundle and ``flowtrain.load`` carry); None on the others."""
    from flowtrain.parallel.context import gather_json

    # small metadata by JSON, rows by all_gather of padded tensors
    state = emb.table.state_dict()
    n = len(state["keys"])
    counts = gather_json({"n": n, "pending": len(state["pending_keys"]), "clock": state["clock"],
                          "stats": state["stats"]})
    width = max(c["n"] for c in counts)
    pw = max(c["pending"] for c in counts)
    cols = 2 * emb.dim + 1 if state["exp_avg"] is not None else emb.dim  # the row, exp_avg, a row's exp_avg_sq

    def pad(t: torch.Tensor, rows: int) -> torch.Tensor:
        return torch.cat([t, torch.zeros((rows - t.shape[0], *t.shape[1:]), dtype=t.dtype)])
    dense = state["weight"] if state["exp_avg"] is None else torch.cat(
        [state["weight"], state["exp_avg"], state["exp_avg_sq"]], dim=1)
    ints = torch.stack([state["keys"], state["last_seen"], state["row_step"]], dim=1) if n else \
        torch.zeros(0, 3, dtype=torch.int64)
    pend = torch.cat([state["pending_keys"][:, None], state["pending"]], dim=1) if len(state["pending_keys"]) else \
        torch.zeros(0, 3, dtype=torch.int64)
    all_dense = [torch.zeros(width, cols, dtype=dense.dtype) for _ in range(emb.world)]
    all_ints = [torch.zeros(width, 3, dtype=torch.int64) for _ in range(emb.world)]
    all_pend = [torch.zeros(pw, 3, dtype=torch.int64) for _ in range(emb.world)]
    dist.all_gather(all_dense, pad(dense.reshape(-1, cols), width), group=emb.group)
    dist.all_gather(all_ints, pad(ints, width), group=emb.group)
    dist.all_gather(all_pend, pad(pend, pw), group=emb.group)
    if dst is not None and emb.rank != dst:
        return None
    d = torch.cat([all_dense[r][: counts[r]["n"]] for r in range(emb.world)])
    i = torch.cat([all_ints[r][: counts[r]["n"]] for r in range(emb.world)])
    p = torch.cat([all_pend[r][: counts[r]["pending"]] for r in range(emb.world)])
    order = torch.argsort(i[:, 0])
    d, i = d[order], i[order]
    config = dict(state["config"])
    config["max_ids"] = emb.table.max_ids  # the bound of the whole table
    full = packed_state(
        {**state, "config": config, "clock": counts[0]["clock"]}, i[:, 0], d[:, : emb.dim], last_seen=i[:, 1],
        row_step=i[:, 2], exp_avg=None if state["exp_avg"] is None else d[:, emb.dim: 2 * emb.dim],
        exp_avg_sq=None if state["exp_avg"] is None else d[:, 2 * emb.dim:], pending_keys=p[:, 0], pending=p[:, 1:],
        stats={k: sum(int(c["stats"].get(k, 0)) for c in counts) for k in state["stats"]})  # every shard's
    return IdTable.from_state(full)


def gather_changes(emb: ShardedIdEmbedding, snapshot: bool, dst: int | None = 0) -> Delta | None:
    """What a published version carries of a sharded table, on rank ``dst`` (every rank when None; a collective,
    every rank calls it at the same step): the rows added or updated and the keys evicted since the last call on
    every shard (``IdTable.take_delta``), or with ``snapshot`` every row of the whole table (the interval starts
    again), in key order, as one process's table gives them; None on the others. A key has one owner, so the
    shards' changes never overlap; only the changed rows travel (a delta's cost is the rows touched)."""
    table = emb.table
    d = table.snapshot() if snapshot else table.take_delta()
    if snapshot:
        table.take_delta()  # the interval starts again at the snapshot
    sizes = [torch.zeros(2, dtype=torch.int64) for _ in range(emb.world)]
    dist.all_gather(sizes, torch.tensor([len(d.keys), len(d.evicted)], dtype=torch.int64), group=emb.group)
    n, m = [int(s[0]) for s in sizes], [int(s[1]) for s in sizes]
    width, rows_width = max(1, max(a + b for a, b in zip(n, m))), max(1, max(n))  # gloo: no empty tensors

    def pad(t: torch.Tensor, rows: int) -> torch.Tensor:
        return torch.cat([t, torch.zeros((rows - t.shape[0], *t.shape[1:]), dtype=t.dtype)])
    ints = torch.cat([torch.from_numpy(np.asarray(d.keys, dtype=np.int64)),
                      torch.from_numpy(np.asarray(d.evicted, dtype=np.int64))])
    all_ints = [torch.zeros(width, dtype=torch.int64) for _ in range(emb.world)]
    all_rows = [torch.zeros(rows_width, emb.dim) for _ in range(emb.world)]
    dist.all_gather(all_ints, pad(ints, width), group=emb.group)
    dist.all_gather(all_rows, pad(d.rows.reshape(-1, emb.dim).to(torch.float32), rows_width), group=emb.group)
    if dst is not None and emb.rank != dst:
        return None
    keys = torch.cat([all_ints[r][: n[r]] for r in range(emb.world)]).numpy()
    evicted = torch.cat([all_ints[r][n[r]: n[r] + m[r]] for r in range(emb.world)]).numpy()
    rows = torch.cat([all_rows[r][: n[r]] for r in range(emb.world)])
    order = np.argsort(keys, kind="stable")
    return Delta(keys[order].copy(), rows[torch.as_tensor(order)] if len(order) else torch.zeros(0, emb.dim),
                 np.sort(evicted))

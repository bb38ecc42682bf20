"""A dynamic, collisionless embedding table: a key -> row map with a free list (Monolith's design).

* **Frequency filtering**: an ID gets a row once it has been seen ``min_count`` times; until then
  (and for a value with no key) it uses the fallback vector, a dense parameter shared by all.
  The count is reached per batch: once an ID's count reaches ``min_count`` in a batch, the row is
  used for all of that batch's occurrences.
* **Expiry**: a row not seen for ``ttl`` events (rows of data given to ``observe``) is evicted
  and its row goes back to the free list; an ID seen fewer than ``min_count`` times and not for
  ``ttl`` events forgets its count.
* **Bound**: at most ``max_ids`` rows; a new ID past the bound takes the row of the least recently
  seen ID (never one seen in the same batch; when every row was seen in it the new ID waits, on the
  fallback vector, and its count is kept).
* **No collisions**: a row belongs to one key at a time (``key_to_row`` and ``row_key`` are each
  other's inverse); a reused row starts afresh: new initial values and zero optimizer state.
  ``key_to_row`` is a ``KeyIndex`` (``flowtrain.train.ids.key_index``): numpy arrays, no Python
  object per ID, every lookup and admission vectorized.
* **Optimizer per row**: lazy Adam (each row's own step count, moments updated only when the row
  gets a gradient, torch.optim.Adam's formula otherwise) with a row-wise second moment (FBGEMM's
  partial row-wise Adam: ``exp_avg_sq`` is ``[capacity, 1]``, one float per row, not per element),
  or SGD.
* **Growth**: the capacity doubles up to ``GROW_FINE_FROM`` rows, then grows by ``GROW_FINE``
  (1.25x), never past ``max_ids``, one tensor at a time: a table grown from empty holds at most a
  quarter more rows than it uses past a million rows, not twice as many. Under ``max_ids`` a shard's
  first growth goes straight to its share of the bound (``share_capacity``: ``max_ids / shards`` and a
  margin for the hash's imbalance; ``shards``: the ranks the keys are split over), what the memory
  plan counts: a big table is never copied while it grows to its share; one process's table (one shard)
  grows as an unbounded one does, never past the bound (its first growth does not allocate the whole
  bound).
* **Deltas**: the keys added or updated, and those evicted, since the last ``take_delta``.

A new row starts at the fallback vector plus small noise fixed by the key and the seed
(``initial_rows``), so the same ID starts the same in any process, on any rank, at any time.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from connectors.id_keys import is_key
from flowtrain.train.ids.key_index import KeyIndex

_MASK = (1 << 64) - 1
_INIT_CHUNK = 1 << 14  # keys whose initial rows are drawn at a time
GROW_FINE_FROM = 1 << 20  # capacity past which the table grows by GROW_FINE instead of doubling
GROW_FINE = 1.25


def share_capacity(max_ids: int, shards: int = 1) -> int:
    """The rows of one shard's share of a ``max_ids`` bound over ``shards`` ranks: ``max_ids / shards`` and six
    standard deviations of the hash's split (a binomial count) on top, never past ``max_ids``."""
    share = -(-int(max_ids) // max(1, int(shards)))
    return int(max_ids) if shards <= 1 else min(int(max_ids), share + 6 * math.isqrt(share) + 64)


def next_capacity(capacity: int, max_ids: int | None = None, shards: int = 1) -> int:
    """The capacity a full table of ``capacity`` rows grows to: doubles up to ``GROW_FINE_FROM`` rows, then grows
    by ``GROW_FINE`` (a finer step keeps a big table within a quarter of its rows' bytes); under ``max_ids``,
    below its share (``share_capacity``) it goes straight to it, and never past ``max_ids``."""
    capacity = max(1, int(capacity))
    new = min(capacity * 2, GROW_FINE_FROM) if capacity < GROW_FINE_FROM else int(capacity * GROW_FINE)
    if max_ids is not None:
        # a shard (shards > 1) goes straight to its share; one process's table grows as an unbounded one does, to
        # the bound (its first growth must not allocate a --max-ids of rows it may never see)
        share = share_capacity(max_ids, shards) if shards > 1 else 0
        new = min(max(new, share) if capacity < share else new, int(max_ids))
    return new


def _splitmix(x: np.ndarray) -> np.ndarray:
    x = (x + np.uint64(0x9E3779B97F4A7C15)) & np.uint64(_MASK)
    x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & np.uint64(_MASK)
    x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & np.uint64(_MASK)
    return x ^ (x >> np.uint64(31))


def initial_rows(keys: np.ndarray, dim: int, seed: int, std: float) -> torch.Tensor:
    """``[len(keys), dim]`` normal(0, std) noise that depends on (key, seed, column) only."""
    keys = np.asarray(keys, dtype=np.int64)
    if len(keys) > _INIT_CHUNK:  # a chunk at a time: the float64 temporaries are ~40x the rows' bytes
        return torch.cat([initial_rows(keys[i: i + _INIT_CHUNK], dim, seed, std)
                          for i in range(0, len(keys), _INIT_CHUNK)])
    keys = keys.view(np.uint64)
    with np.errstate(over="ignore"):
        base = _splitmix(keys ^ _splitmix(np.full_like(keys, seed, dtype=np.uint64)))
        cols = np.arange(2 * dim, dtype=np.uint64)
        bits = _splitmix(base[:, None] * np.uint64(0x100000001B3) + cols[None, :])
    u = ((bits >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)  # (0, 1)
    u1, u2 = u[:, :dim], u[:, dim:]
    z = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)  # Box-Muller
    return torch.from_numpy((z * std).astype(np.float32))


def _first_occurrences(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``np.unique(keys, return_index=True, return_inverse=True, return_counts=True)`` by ``torch.unique`` (one sort,
    4x faster than numpy's on a batch) and a scatter of the positions' minimum."""
    t = torch.from_numpy(keys)
    uniq, inv, counts = torch.unique(t, return_inverse=True, return_counts=True)
    first = torch.full((len(uniq),), len(keys), dtype=torch.int64).scatter_reduce_(
        0, inv, torch.arange(len(keys)), "amin")
    return uniq.numpy(), first.numpy(), inv.numpy(), counts.numpy()


@dataclass
class TableStats:
    admitted: int = 0  # rows created
    expired: int = 0  # rows evicted by --id-ttl
    evicted_lru: int = 0  # rows evicted by --max-ids
    fallback_lookups: int = 0  # occurrences that used the fallback vector (not yet admitted, or no key)
    unknown: int = 0  # lookups (inference) of an ID the table does not hold
    waiting: int = 0  # new IDs that found every row busy in their batch

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Delta:
    """The rows changed since the previous delta: ``keys``/``rows`` added or updated, ``evicted`` keys."""
    keys: np.ndarray
    rows: torch.Tensor
    evicted: np.ndarray
    extra: dict = field(default_factory=dict)


class IdTable:
    def __init__(self, dim: int, *, min_count: int = 1, ttl: int | None = None, max_ids: int | None = None,
                 capacity: int = 1024, optimizer: str = "adam", betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, init_std: float = 0.01, seed: int = 0, shards: int = 1,
                 dtype: torch.dtype = torch.float32):
        if dim < 1:
            raise ValueError(f"an ID table needs a dimension >= 1, not {dim}")
        if min_count < 1:
            raise ValueError(f"--min-id-count {min_count}: must be at least 1")
        if ttl is not None and ttl < 1:
            raise ValueError(f"--id-ttl {ttl}: must be at least 1 event (or leave it out: rows never expire)")
        if max_ids is not None and max_ids < 1:
            raise ValueError(f"--max-ids {max_ids}: must be at least 1")
        if optimizer not in ("adam", "sgd"):
            raise ValueError(f"ID table optimizer {optimizer!r}: adam or sgd")
        self.dim, self.min_count, self.ttl, self.max_ids = int(dim), int(min_count), ttl, max_ids
        self.optimizer, self.betas, self.eps, self.init_std, self.seed = optimizer, betas, eps, init_std, seed
        self.shards = max(1, int(shards))  # the ranks this table's keys are split over (growth only, not saved)
        capacity = max(1, min(int(capacity), max_ids or capacity))
        # on the CPU always (the key index is numpy), also when its model is built on the meta device; float32, or
        # float64 under --dtype float64 (``to_dtype``: its module's ``.to(dtype)``)
        self.weight = torch.zeros(capacity, dim, dtype=dtype, device="cpu")
        self.exp_avg = torch.zeros(capacity, dim, dtype=dtype, device="cpu") if optimizer == "adam" else None
        self.exp_avg_sq = torch.zeros(capacity, 1, dtype=dtype, device="cpu") if optimizer == "adam" else None
        self.row_step = np.zeros(capacity, dtype=np.int32)  # each row's Adam step (lazy Adam)
        self.last_seen = np.zeros(capacity, dtype=np.int64)
        self.key_to_row = KeyIndex(capacity)  # key <-> row, the free rows (the lowest first)
        self._row_dirty = np.zeros(capacity, dtype=bool)  # rows added or updated since the last delta
        self.pending: dict[int, list[int]] = {}  # key -> [count, last seen] below min_count
        self.clock = 0  # events observed
        self._next_prune = 0
        self.stats = TableStats()
        self._evicted: set[int] = set()

    # --- size ---------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.key_to_row)

    @property
    def capacity(self) -> int:
        return self.weight.shape[0]

    @property
    def row_key(self) -> np.ndarray:
        """Each row's key (``NO_KEY``: free)."""
        return self.key_to_row.row_key

    @property
    def occupied(self) -> np.ndarray:
        return self.key_to_row.occupied

    @property
    def free(self) -> list[int]:
        """The free rows as a stack (the last one is used first)."""
        return self.key_to_row.free_list()

    def state_bytes(self) -> int:
        """Bytes of this table's state (rows, optimizer moments, bookkeeping arrays, the key index)."""
        tensors = [t for t in (self.weight, self.exp_avg, self.exp_avg_sq) if t is not None]
        arrays = (self.row_step, self.last_seen, self._row_dirty)
        return (sum(t.numel() * t.element_size() for t in tensors) + sum(a.nbytes for a in arrays)
                + self.key_to_row.nbytes)

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    def to_dtype(self, dtype: torch.dtype) -> None:
        """The rows and their optimizer state in ``dtype`` (``--dtype``)."""
        self.weight = self.weight.to(dtype)
        if self.exp_avg is not None:
            self.exp_avg, self.exp_avg_sq = self.exp_avg.to(dtype), self.exp_avg_sq.to(dtype)

    def _grow(self, need: int) -> None:
        old = self.capacity
        new = max(next_capacity(old, self.max_ids, self.shards), old + need)
        if self.max_ids is not None:
            new = min(new, self.max_ids)
        if new <= old:
            return

        def pad(t):
            if t is None:
                return None
            out = t.new_empty((new, *t.shape[1:]))  # the new rows zeroed in place: no third, zero tensor
            out[:old] = t
            out[old:] = 0
            return out
        # one tensor at a time: the old copy of one, not of all three, lives beside the new ones
        self.weight = pad(self.weight)
        self.exp_avg = pad(self.exp_avg)
        self.exp_avg_sq = pad(self.exp_avg_sq)
        self.row_step = np.concatenate([self.row_step, np.zeros(new - old, np.int32)])
        self.last_seen = np.concatenate([self.last_seen, np.zeros(new - old, np.int64)])
        self._row_dirty = np.concatenate([self._row_dirty, np.zeros(new - old, bool)])
        self.key_to_row.grow(new)

    # --- rows ---------------------------------------------------------------------------------------
    def rows_of(self, keys: np.ndarray) -> np.ndarray:
        """The rows of ``keys`` (-1: none), changing nothing; unknown IDs are counted (inference)."""
        keys = np.asarray(keys, dtype=np.int64)
        rows = self.key_to_row.lookup(keys)
        none = rows < 0
        if none.any():
            self.stats.unknown += int((none & is_key(keys)).sum())
        return rows

    def vectors(self, keys: np.ndarray, fallback: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
        """Each key's row (-1: none) and vector, ``fallback`` where there is none, changing nothing; unknown IDs are
        counted (inference). One compiled pass where built (``KeyIndex.lookup_gather``), else ``rows_of`` and one
        ``index_select``."""
        keys = np.asarray(keys, dtype=np.int64)
        fused = self.key_to_row.lookup_gather(keys, self.weight, fallback) if len(keys) and len(self.key_to_row) else None
        if fused is None:
            rows = self.rows_of(keys)
            out = self.weight.index_select(0, torch.from_numpy(np.maximum(rows, 0)))
            none = np.flatnonzero(rows < 0)
            if len(none):
                out.index_copy_(0, torch.from_numpy(none), fallback.detach().to(out.dtype).expand(len(none), -1))
            return rows, out
        rows, out, missing = fused
        if missing:
            self.stats.unknown += int(((rows < 0) & is_key(keys)).sum())
        return rows, out

    def observe(self, keys: np.ndarray, fallback: torch.Tensor | None = None,
                bound: Callable[[IdTable, np.ndarray, int], int] | None = None) -> np.ndarray:
        """One batch of events in order (training): counts, admits, expires, bounds; returns each
        event's row (-1: the fallback vector). ``fallback``: the current fallback vector, the centre
        of new rows. ``bound``: where the bound on rows is kept elsewhere (a table sharded over ranks keeps
        ``--max-ids`` over all of them: ``ShardedIdEmbedding``), ``bound(table, first_positions, start)`` is
        called once per batch, even without new IDs, with the event positions of the IDs to admit (in
        first-occurrence order); it evicts what it must (``evict_lru``) and returns how many of them get a
        row (the first ones); this table then only takes free rows."""
        keys = np.asarray(keys, dtype=np.int64)
        start, n = self.clock, len(keys)
        self.clock += n
        valid = is_key(keys)  # a value without a key (its reason's reserved key) uses the fallback vector
        # every event's row at once (most keys have one): a known key's last sight is its last event of the batch;
        # only the keys without a row are counted and admitted, in order of first occurrence
        out = self.key_to_row.lookup(keys)
        seen = np.flatnonzero(out >= 0)
        if len(seen):
            np.maximum.at(self.last_seen, out[seen], seen + start)
        pos = np.flatnonzero(valid & (out < 0))
        if not len(pos):
            self._expire(protect_since=start)
            if bound is not None:
                bound(self, np.zeros(0, dtype=np.int64), start)
        else:
            uniq, first, inv, counts = _first_occurrences(keys[pos])
            last = np.zeros(len(uniq), dtype=np.int64)
            np.maximum.at(last, inv, pos)
            last += start
            rows_u = np.full(len(uniq), -1, dtype=np.int64)
            new = np.argsort(first, kind="stable")  # first occurrence order
            count = counts[new]
            if self.pending:  # counts of IDs seen fewer than min_count times before
                count = count + np.fromiter((self.pending.get(k, (0,))[0] for k in uniq[new].tolist()),
                                            dtype=np.int64, count=len(new))
            ripe = count >= self.min_count
            for k, c, seen_at in zip(uniq[new[~ripe]].tolist(), count[~ripe].tolist(), last[new[~ripe]].tolist()):
                self.pending[k] = [c, seen_at]
            admit = new[ripe].tolist()
            self._expire(protect_since=start)
            if bound is not None:
                allowed = bound(self, pos[first[admit]] + start, start)
                got = self._allocate(allowed, protect_since=start, evict=False)
            elif admit:
                got = self._allocate(len(admit), protect_since=start)
            if admit:
                keys_new = uniq[admit[:len(got)]]
                if got:
                    rows = np.asarray(got, dtype=np.int64)
                    centre = torch.zeros(self.dim, dtype=self.dtype) if fallback is None else \
                        fallback.detach().to("cpu", self.dtype)
                    self.weight[rows] = centre + initial_rows(keys_new, self.dim, self.seed, self.init_std)
                    if self.exp_avg is not None:
                        self.exp_avg[rows] = 0.0
                        self.exp_avg_sq[rows] = 0.0
                    self.row_step[rows] = 0
                    self.key_to_row.assign(keys_new, rows)
                    self.last_seen[rows] = last[admit[:len(got)]]
                    self._row_dirty[rows] = True
                    if self.pending or self._evicted:
                        for k in keys_new.tolist():
                            self.pending.pop(k, None)
                            self._evicted.discard(k)
                    rows_u[admit[:len(got)]] = rows
                    self.stats.admitted += len(got)
                for j in admit[len(got):]:  # every row busy this batch: the ID waits, its count kept
                    self.pending[int(uniq[j])] = [self.min_count - 1, int(last[j])]
                    self.stats.waiting += 1
            out[pos] = rows_u[inv]
        self.stats.fallback_lookups += int((out < 0).sum())
        return out

    def _evict(self, rows: np.ndarray) -> None:
        rows = np.asarray(rows, dtype=np.int64)
        self._evicted.update(self.key_to_row.release(rows).tolist())
        self._row_dirty[rows] = False

    def _expire(self, protect_since: int) -> None:
        """Evict the rows not seen for ``--id-ttl`` events, never one seen since ``protect_since`` (this batch:
        with a TTL shorter than the batch, a key seen early in it keeps the row its events already point to)."""
        if self.ttl is None:
            return
        horizon = min(self.clock - self.ttl, protect_since)
        stale = np.nonzero(self.occupied & (self.last_seen < horizon))[0]
        if len(stale):
            self._evict(stale[np.argsort(self.last_seen[stale], kind="stable")])
            self.stats.expired += len(stale)
        if self.clock >= self._next_prune:  # counts of IDs below min_count expire too
            self.pending = {k: v for k, v in self.pending.items() if v[1] >= horizon}
            self._next_prune = self.clock + max(1, self.ttl // 4)

    def _allocate(self, n: int, protect_since: int, evict: bool = True) -> list[int]:
        if self.key_to_row.free_count() < n:
            self._grow(n - self.key_to_row.free_count())
        short = n - self.key_to_row.free_count()
        if short > 0 and evict:  # at --max-ids: the least recently seen rows, never one seen in this batch
            self.evict_lru(self.lru_candidates(short, protect_since))
        return self.key_to_row.allocate(n).tolist()

    def lru_candidates(self, n: int, protect_since: int) -> np.ndarray:
        """The rows of the ``n`` least recently seen IDs (fewer if fewer rows qualify), least recent first, never
        one seen since the event ``protect_since`` (the current batch)."""
        cand = np.nonzero(self.occupied & (self.last_seen < protect_since))[0]
        if n <= 0:
            return cand[:0]
        if len(cand) > n:
            cand = cand[np.argpartition(self.last_seen[cand], n - 1)[:n]]
        return cand[np.argsort(self.last_seen[cand], kind="stable")]

    def evict_lru(self, rows: np.ndarray) -> None:
        """Evict ``rows`` for the bound (``--max-ids``), counted as ``evicted_lru``."""
        self._evict(rows)
        self.stats.evicted_lru += len(rows)

    # --- training -----------------------------------------------------------------------------------
    def apply_gradients(self, rows: np.ndarray, grads: torch.Tensor, lr: float) -> None:
        """One optimizer step for ``rows`` (distinct) with their gradients ``grads`` [len(rows), dim]."""
        if len(rows) == 0:
            return
        rows = np.asarray(rows, dtype=np.int64)
        idx = torch.from_numpy(rows)
        g = grads.detach().to(self.dtype)
        if self.optimizer == "sgd":
            self.weight.index_add_(0, idx, g, alpha=-lr)
        else:
            b1, b2 = self.betas
            self.row_step[rows] += 1
            step = torch.from_numpy(self.row_step[rows].astype(np.float64))
            # fused gathers and scatters (index_select / index_copy_), the rows distinct
            m = self.exp_avg.index_select(0, idx).mul_(b1).add_(g, alpha=1 - b1)
            # Row-wise second moment (FBGEMM's partial row-wise Adam, the usual optimizer of large embedding
            # tables): one mean of g**2 per row. Per element, a component whose gradient is rounding noise
            # below eps (sums that cancel) would step by lr * noise / eps, so a re-ordered sum (N workers'
            # all-to-all vs one process) would move the row by ~1e-5 at once; per row it moves by noise / |row|.
            # Stored once per row ([capacity, 1]): the same ops as the dim copies it replaces, the same numbers.
            v = self.exp_avg_sq.index_select(0, idx).mul_(b2).add_((g * g).mean(dim=1, keepdim=True), alpha=1 - b2)
            self.exp_avg.index_copy_(0, idx, m)
            self.exp_avg_sq.index_copy_(0, idx, v)
            bc1 = (1 - b1 ** step).to(self.dtype)[:, None]
            bc2 = (1 - b2 ** step).to(self.dtype)[:, None]
            denom = v.sqrt() / bc2.sqrt() + self.eps
            self.weight.index_copy_(0, idx, self.weight.index_select(0, idx) - (lr / bc1) * m / denom)
        self._row_dirty[rows] = True

    # --- deltas -------------------------------------------------------------------------------------
    def take_delta(self) -> Delta:
        """The rows added or updated and the keys evicted since the last call; starts a new interval."""
        rows = np.nonzero(self._row_dirty)[0]
        order = np.argsort(self.row_key[rows], kind="stable")
        rows = rows[order]
        keys = self.row_key[rows].copy()
        delta = Delta(keys, self.weight[torch.as_tensor(rows)].clone() if len(rows) else torch.zeros(0, self.dim),
                      np.asarray(sorted(self._evicted), dtype=np.int64))
        self._row_dirty[:] = False
        self._evicted = set()
        return delta

    def snapshot(self) -> Delta:
        """Every row the table holds (a full snapshot), in key order."""
        rows = np.nonzero(self.occupied)[0]
        rows = rows[np.argsort(self.row_key[rows], kind="stable")]
        keys = self.row_key[rows].copy()
        return Delta(keys, self.weight[torch.as_tensor(rows)].clone() if len(rows) else torch.zeros(0, self.dim),
                     np.zeros(0, dtype=np.int64))

    # --- state --------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything a resume needs (tensors and plain values: ``torch.load(weights_only=True)`` opens it)."""
        occ = np.nonzero(self.occupied)[0]
        pend = sorted(self.pending.items())
        return {
            "config": {"dim": self.dim, "min_count": self.min_count, "ttl": self.ttl, "max_ids": self.max_ids,
                       "optimizer": self.optimizer, "betas": list(self.betas), "eps": self.eps,
                       "init_std": self.init_std, "seed": self.seed},
            "capacity": self.capacity, "clock": self.clock, "next_prune": self._next_prune,
            "rows": torch.as_tensor(occ), "keys": torch.as_tensor(self.row_key[occ]),
            "last_seen": torch.as_tensor(self.last_seen[occ]),
            "row_step": torch.as_tensor(self.row_step[occ].astype(np.int64)),
            "weight": self.weight[torch.as_tensor(occ)].clone(),
            "exp_avg": None if self.exp_avg is None else self.exp_avg[torch.as_tensor(occ)].clone(),
            "exp_avg_sq": None if self.exp_avg_sq is None else self.exp_avg_sq[torch.as_tensor(occ)].clone(),
            "free": torch.as_tensor(np.asarray(self.free, dtype=np.int64)),
            "pending_keys": torch.as_tensor(np.asarray([k for k, _ in pend], dtype=np.int64)),
            "pending": torch.as_tensor(np.asarray([v for _, v in pend], dtype=np.int64).reshape(-1, 2)),
            "stats": self.stats.as_dict(),
            "dirty": torch.as_tensor(np.sort(self.row_key[self._row_dirty])),
            "evicted": torch.as_tensor(np.asarray(sorted(self._evicted), dtype=np.int64)),
        }

    @classmethod
    def from_state(cls, state: dict) -> IdTable:
        c = dict(state["config"])
        c["betas"] = tuple(c["betas"])
        table = cls(c.pop("dim"), capacity=int(state["capacity"]), dtype=state["weight"].dtype, **c)
        table.load_state_dict(state)
        return table

    def load_state_dict(self, state: dict) -> None:
        cap = int(state["capacity"])
        if cap != self.capacity:
            self.max_ids, saved = None, self.max_ids
            self._grow(cap - self.capacity)
            self.max_ids = saved
        self.weight.zero_()
        if self.exp_avg is not None:
            self.exp_avg.zero_()
            self.exp_avg_sq.zero_()
        self.row_step[:] = 0
        self.last_seen[:] = 0
        self._row_dirty[:] = False
        rows = state["rows"].numpy()
        idx = torch.as_tensor(rows)
        self.weight[idx] = state["weight"]
        if self.exp_avg is not None and state.get("exp_avg") is not None:
            self.exp_avg[idx] = state["exp_avg"]
            self.exp_avg_sq[idx] = row_second_moment(state["exp_avg_sq"])
        self.last_seen[rows] = state["last_seen"].numpy()
        self.row_step[rows] = state["row_step"].numpy()
        self.key_to_row.load(rows, state["keys"].numpy(), state["free"].numpy())
        self.pending = {int(k): [int(a), int(b)] for k, (a, b) in zip(state["pending_keys"].tolist(),
                                                                       state["pending"].tolist())}
        self.clock, self._next_prune = int(state["clock"]), int(state["next_prune"])
        self.stats = TableStats(**state.get("stats", {}))
        dirty = self.key_to_row.lookup(state.get("dirty", torch.zeros(0, dtype=torch.int64)).numpy())
        self._row_dirty[dirty[dirty >= 0]] = True
        self._evicted = set(state.get("evicted", torch.zeros(0, dtype=torch.int64)).tolist())


def row_second_moment(exp_avg_sq: torch.Tensor) -> torch.Tensor:
    """``[n, 1]``: a row-wise second moment as the table stores it, from ``[n, 1]``, ``[n]`` or an older state's
    per-element ``[n, dim]`` (its row mean, taken in float64: ``dim`` equal copies give back their value exactly)."""
    v = exp_avg_sq[:, None] if exp_avg_sq.dim() == 1 else exp_avg_sq.flatten(1)
    if not len(v):
        return torch.zeros(0, 1, dtype=v.dtype)
    if v.shape[1] == 1:
        return v
    return v.to(torch.float64).mean(dim=1, keepdim=True).to(v.dtype)


_CONFIG = ("dim", "min_count", "ttl", "max_ids", "optimizer", "beta1", "beta2", "eps", "init_std", "seed",
           "capacity", "clock", "next_prune")
_STATS = ("admitted", "expired", "evicted_lru", "fallback_lookups", "unknown", "waiting")


def table_tensors(table: IdTable) -> dict[str, torch.Tensor]:
    """The table's state as flat tensors (what a ``state_dict``, a checkpoint and a safetensors bundle hold)."""
    s = table.state_dict()
    c = s["config"]
    config = [c["dim"], c["min_count"], -1 if c["ttl"] is None else c["ttl"],
              -1 if c["max_ids"] is None else c["max_ids"], 0 if c["optimizer"] == "adam" else 1, c["betas"][0],
              c["betas"][1], c["eps"], c["init_std"], c["seed"], s["capacity"], s["clock"], s["next_prune"]]
    out = {"config": torch.tensor(config, dtype=torch.float64),
           "stats": torch.tensor([s["stats"][k] for k in _STATS], dtype=torch.int64)}
    empty = torch.zeros(0, table.dim, dtype=table.dtype)
    for k in ("rows", "keys", "last_seen", "row_step", "weight", "exp_avg", "exp_avg_sq", "free", "pending_keys",
              "pending", "dirty", "evicted"):
        v = s[k]
        out[k] = (empty if v is None else v).contiguous()
    return out


def table_from_tensors(t: dict[str, torch.Tensor]) -> IdTable:
    c = dict(zip(_CONFIG, t["config"].tolist()))
    state = {
        "config": {"dim": int(c["dim"]), "min_count": int(c["min_count"]),
                   "ttl": None if c["ttl"] < 0 else int(c["ttl"]),
                   "max_ids": None if c["max_ids"] < 0 else int(c["max_ids"]),
                   "optimizer": "adam" if c["optimizer"] == 0 else "sgd", "betas": [c["beta1"], c["beta2"]],
                   "eps": c["eps"], "init_std": c["init_std"], "seed": int(c["seed"])},
        "capacity": int(c["capacity"]), "clock": int(c["clock"]), "next_prune": int(c["next_prune"]),
        "stats": dict(zip(_STATS, t["stats"].tolist())),
        **{k: t[k] for k in ("rows", "keys", "last_seen", "row_step", "weight", "free", "pending_keys", "pending",
                             "dirty", "evicted")},
        "exp_avg": t["exp_avg"] if int(c["optimizer"]) == 0 else None,
        "exp_avg_sq": t["exp_avg_sq"] if int(c["optimizer"]) == 0 else None,
    }
    state["pending"] = state["pending"].reshape(-1, 2)
    return IdTable.from_state(state)

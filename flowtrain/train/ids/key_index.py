"""An ID table's key <-> row bijection in numpy arrays: no Python object per ID.

``KeyIndex`` holds, for a table of ``capacity`` rows:

* ``row_key``: each row's key (``NO_KEY`` for a free row), int64;
* a hash index from key to row: open addressing with linear probing over int32 slots that hold a
  row number (the key is read back from ``row_key``, so a slot costs 4 bytes, not 12), at most
  ``LOAD`` full; a removed entry leaves a tombstone, and the slots are rebuilt once tombstones
  pass an eighth of them;
* the free rows: rows never used (``[high_water, capacity)``, handed out lowest first) below a
  stack of released rows (handed out last released first): the order a Python free list
  ``[capacity-1, ..., high_water] + released`` pops in, which ``free_list`` returns.

Every operation is vectorized over a batch of keys (``lookup``, ``assign``, ``release``). A table of
2,500,000 rows spends 8 bytes per row on ``row_key`` and about 5.7 on the slots, where a Python
``dict`` of int keys costs about 100 (docs/benchmarks.md, ``flowtrain bench ids --memory``).

``lookup``, the hot one (every batch of an ID table, in training and inference), runs compiled where the install
built ``probe.c`` (``compiled.AVAILABLE``) and in numpy otherwise (``lookup_numpy``): the same rows
(tests/unit/test_id_key_index.py checks the two against each other), several times slower.

For reading it is a mapping like the ``dict`` it replaces: ``len``, ``in``, ``index[key]``, ``get``,
iteration over keys (in row order), ``items``, ``values``.
"""
from __future__ import annotations

import numpy as np

from connectors.id_keys import NO_KEY
from flowtrain.train.ids import compiled

__all__ = ["KeyIndex", "LOAD", "REBUILD_CHUNK"]

LOAD = 0.7  # slots per row: 1 / LOAD
EMPTY, TOMB = -1, -2  # a slot never used; a slot whose entry was removed
REBUILD_CHUNK = 1 << 16  # keys placed at a time when the slots are rebuilt (its temporaries: ~240 bytes a key)
_WINDOW = 8  # slots a probe reads at a time
_STEPS = np.arange(_WINDOW, dtype=np.int64)
_FIND_STEPS = np.arange(4 * _WINDOW, dtype=np.int64)
_PAIR = np.arange(2, dtype=np.int64)  # a lookup's slots a round past its home (one round, mostly)
_MASK = (1 << 64) - 1


def _mix(keys: np.ndarray) -> np.ndarray:
    """The keys' hash (as unsigned 64 bits; its high 32 bits place a key): the high half folded into the low, then
    Fibonacci hashing (one multiply by 2**64 / golden ratio), which spreads sequential keys as well as the 64-bit
    hashes of ``connectors.id_keys``; three array operations, where splitmix64's finalizer takes eight."""
    x = np.asarray(keys, dtype=np.int64).view(np.uint64)
    with np.errstate(over="ignore"):
        return (x ^ (x >> np.uint64(32))) * np.uint64(0x9E3779B97F4A7C15)


def _slots_for(capacity: int) -> int:
    return max(8, -(-int(capacity) * 10 // int(LOAD * 10)))


class KeyIndex:
    def __init__(self, capacity: int):
        capacity = max(1, int(capacity))
        self.row_key = np.full(capacity, NO_KEY, dtype=np.int64)
        self._slots = np.full(_slots_for(capacity), EMPTY, dtype=np.int32 if capacity < 2**31 else np.int64)
        self._count = 0
        self._tombs = 0
        self.high_water = 0  # rows >= high_water were never used
        self._released = np.zeros(0, dtype=np.int64)  # a stack: the last released on top
        self._n_released = 0
        self._probe = None  # (slots, row_key, their probe.c arguments): ``_probe_tables``

    def __getstate__(self):
        # a copy (copy.deepcopy, pickle) has arrays of its own: their addresses are found again, not copied
        return {**self.__dict__, "_probe": None}

    def _probe_tables(self) -> tuple:
        """``(slots, row_key, args)``: probe.c's ``(slots, n_slots, row_key)`` arguments (addresses) for these arrays
        as ``args``, None where it does not run (not built; 64-bit slots). Found again only when ``_slots`` or
        ``row_key`` is a new array (``.ctypes`` costs a microsecond an array, a hot batch's lookup a few dozen); a
        caller keeps the tuple while C reads, so the arrays outlive the call even if another thread grows the index."""
        p = self.__dict__.get("_probe")  # absent in an index unpickled from before it existed
        if p is None or p[0] is not self._slots or p[1] is not self.row_key:
            args = ((self._slots.ctypes.data, len(self._slots), self.row_key.ctypes.data)
                    if compiled.AVAILABLE and self._slots.dtype == np.int32 else None)
            p = self._probe = (self._slots, self.row_key, args)
        return p

    # --- size ---------------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return len(self.row_key)

    @property
    def nbytes(self) -> int:
        """Bytes held: ``row_key``, the slots and the released-rows stack."""
        return self.row_key.nbytes + self._slots.nbytes + self._released.nbytes

    @property
    def occupied(self) -> np.ndarray:
        """A bool per row: whether a key holds it (a new array)."""
        return self.row_key != NO_KEY

    @staticmethod
    def planned_bytes(capacity: int) -> int:
        """``nbytes`` of an index of ``capacity`` rows (nothing released): what a memory plan counts."""
        capacity = max(1, int(capacity))
        return capacity * 8 + _slots_for(capacity) * (4 if capacity < 2**31 else 8)

    def free_count(self) -> int:
        return self.capacity - self.high_water + self._n_released

    def free_list(self) -> list[int]:
        """The free rows as the free list they stand for (the last one is handed out first)."""
        return list(range(self.capacity - 1, self.high_water - 1, -1)) + self._released[: self._n_released].tolist()

    # --- the mapping ----------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._count

    def __iter__(self):
        return iter(self.row_key[self.occupied].tolist())

    def keys(self):
        return list(self)

    def values(self) -> list[int]:
        return np.nonzero(self.occupied)[0].tolist()

    def items(self):
        rows = np.nonzero(self.occupied)[0]
        return zip(self.row_key[rows].tolist(), rows.tolist())

    def get(self, key: int, default=None):
        r = int(self.lookup(np.asarray([key], dtype=np.int64))[0])
        return default if r < 0 else r

    def __getitem__(self, key: int) -> int:
        r = self.get(key)
        if r is None:
            raise KeyError(key)
        return r

    def __contains__(self, key) -> bool:
        return self.get(int(key)) is not None

    # --- vectorized -----------------------------------------------------------------------------------
    def _home(self, keys: np.ndarray) -> np.ndarray:
        """Each key's first slot: the hash's high 32 bits scaled to the slots (Lemire's multiply-shift, no modulo:
        a division of 64-bit integers is the slowest step of a lookup)."""
        return ((_mix(keys) >> np.uint64(32)) * np.uint64(len(self._slots)) >> np.uint64(32)).view(np.int64)

    def _window(self, slot: np.ndarray, steps: np.ndarray = _STEPS) -> np.ndarray:
        """The ``len(steps)`` slots from each of ``slot`` on, wrapping: ``[len(slot), len(steps)]``."""
        win = slot[:, None] + steps[None, :]
        n = len(self._slots)
        return np.where(win >= n, win - n, win) if len(steps) <= n else win % n

    def _find(self, keys: np.ndarray, slot: np.ndarray | None = None) -> np.ndarray:
        """The slot holding each key (-1: absent): its probe path (from ``slot``, default its home), ``_WINDOW``
        slots a round for every key still looking, up to the key or the first empty slot (a key sits before any
        empty slot on its path)."""
        keys = np.asarray(keys, dtype=np.int64)
        out = np.full(len(keys), -1, dtype=np.int64)
        if not len(keys) or not self._count:
            return out
        todo = np.arange(len(keys))
        slot = self._home(keys) if slot is None else slot
        while len(todo):
            win = self._window(slot, _FIND_STEPS)
            r = self._slots[win].astype(np.int64)
            match = r >= 0
            match[match] = self.row_key[r[match]] == np.broadcast_to(keys[todo][:, None], r.shape)[match]
            # the first slot of each window that ends its search: the key, or an empty slot (then it is absent)
            stop = match | (r == EMPTY)
            first = stop.argmax(axis=1)
            ended = stop[np.arange(len(todo)), first]
            found = ended & match[np.arange(len(todo)), first]
            out[todo[found]] = win[found, first[found]]
            todo, slot = todo[~ended], win[~ended, -1] + 1
            slot[slot == len(self._slots)] = 0
        return out

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """The row of each key (-1: none): compiled where it was built (probe.c: each key's probe path in one pass),
        else ``lookup_numpy``."""
        keys = np.asarray(keys, dtype=np.int64)
        if not keys.size or not self._count:
            return np.full(keys.shape, -1, dtype=np.int64)
        tables = self._probe_tables()
        if tables[2] is None:
            return self.lookup_numpy(keys)
        flat = np.ascontiguousarray(keys.reshape(-1))  # any shape: each key's row in its place
        return compiled.lookup(flat, tables[2])[0].reshape(keys.shape)

    def lookup_gather(self, keys: np.ndarray, weight, fallback):
        """``(rows, weight[rows] with fallback where none, how many have none)`` in one compiled pass (inference),
        or None where that pass is not built or not for these arrays (then ``lookup`` and a gather do it).
        ``weight``: a tensor with a row per row of the index; ``fallback``: a vector."""
        tables = self._probe_tables()
        keys = np.asarray(keys)
        if (tables[2] is None or keys.ndim != 1 or not weight.is_cpu or not weight.is_contiguous()
                or weight.dim() != 2 or len(weight) < len(self.row_key) or fallback.numel() != weight.shape[1]):
            return None
        if not fallback.is_cpu or fallback.dtype != weight.dtype:
            fallback = fallback.detach().to("cpu", weight.dtype)
        return compiled.embed(np.ascontiguousarray(keys, dtype=np.int64), tables[2], weight, fallback)

    def lookup_numpy(self, keys: np.ndarray) -> np.ndarray:
        """``lookup`` in numpy. Every key's home slot is read at once and its row's key compared (most keys sit at
        home: the slots are at most ``LOAD`` full); only the others probe on (``_find``)."""
        keys = np.asarray(keys, dtype=np.int64)
        if not len(keys) or not self._count:
            return np.full(len(keys), -1, dtype=np.int64)
        slot = self._home(keys)
        rows = self._slots.take(slot)
        # a free slot (EMPTY, TOMB: negative) reads some row's key (wrapped), then fails ``rows >= 0``
        hit = (self.row_key.take(rows, mode="wrap") == keys) & (rows >= 0)
        out = np.where(hit, rows, -1)
        on = np.flatnonzero(~hit & (rows != EMPTY))  # a collision or a removed entry on the way: probe further
        if len(on):
            nxt = slot[on] + 1
            nxt[nxt == len(self._slots)] = 0
            found = self._find(keys[on], nxt)
            out[on[found >= 0]] = self._slots[found[found >= 0]]
        return out

    def _place(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """Slots for distinct keys that are absent: the first empty or removed slot on each key's probe path."""
        todo = np.arange(len(keys))
        slot = self._home(keys)
        while len(todo):
            win = self._window(slot)
            free = self._slots[win] < 0
            first = free.argmax(axis=1)
            some = free[np.arange(len(todo)), first]
            want = win[np.arange(len(todo)), first]
            cand = np.nonzero(some)[0]
            _, once = np.unique(want[cand], return_index=True)  # one key per slot per round
            won = cand[once]
            self._tombs -= int((self._slots[want[won]] == TOMB).sum())
            self._slots[want[won]] = rows[todo[won]]
            left = np.ones(len(todo), dtype=bool)
            left[won] = False
            # a key that lost its slot looks again from there; one whose window was full, past it
            slot = np.where(some, want, win[:, -1] + 1)
            todo, slot = todo[left], slot[left]
            slot[slot == len(self._slots)] = 0

    def allocate(self, n: int) -> np.ndarray:
        """Up to ``n`` free rows, in the order a free list pops them (released first, then never used)."""
        k = min(n, self._n_released)
        out = self._released[self._n_released - k: self._n_released][::-1].copy()
        self._n_released -= k
        fresh = min(n - k, self.capacity - self.high_water)
        if fresh > 0:
            out = np.concatenate([out, np.arange(self.high_water, self.high_water + fresh, dtype=np.int64)])
            self.high_water += fresh
        return out

    def assign(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """``keys`` (distinct, absent) take ``rows`` (from ``allocate``)."""
        keys, rows = np.asarray(keys, dtype=np.int64), np.asarray(rows, dtype=np.int64)
        if not len(keys):
            return
        self.row_key[rows] = keys
        self._count += len(keys)
        self._place(keys, rows)

    def release(self, rows: np.ndarray) -> np.ndarray:
        """Free ``rows`` (occupied, distinct), pushed on the free stack in the given order; returns their keys."""
        rows = np.asarray(rows, dtype=np.int64)
        keys = self.row_key[rows].copy()
        if not len(rows):
            return keys
        slot = self._find(keys)
        self._slots[slot] = TOMB
        self._tombs += len(rows)
        self._count -= len(rows)
        self.row_key[rows] = NO_KEY
        need = self._n_released + len(rows)
        if need > len(self._released):
            self._released = np.concatenate([self._released[: self._n_released],
                                             np.zeros(max(need, 2 * len(self._released)) - self._n_released,
                                                      dtype=np.int64)])
        self._released[self._n_released: need] = rows
        self._n_released = need
        if self._tombs > len(self._slots) // 8:
            self._rebuild(len(self._slots))
        return keys

    def _rebuild(self, n_slots: int) -> None:
        self._probe = None  # the old arrays' addresses (and the arrays) go with them
        self._slots = np.full(n_slots, EMPTY, dtype=self._slots.dtype if self.capacity < 2**31 else np.int64)
        self._tombs = 0
        rows = np.nonzero(self.occupied)[0]
        for i in range(0, len(rows), REBUILD_CHUNK):  # a chunk at a time: the probing's temporaries stay small
            self._place(self.row_key[rows[i: i + REBUILD_CHUNK]], rows[i: i + REBUILD_CHUNK])

    def grow(self, capacity: int) -> None:
        """``capacity`` rows (more than now): the new ones never used; the slots rebuilt for the size."""
        if capacity <= self.capacity:
            return
        self._probe = None
        self.row_key = np.concatenate([self.row_key, np.full(capacity - self.capacity, NO_KEY, dtype=np.int64)])
        self._rebuild(_slots_for(capacity))

    def load(self, rows: np.ndarray, keys: np.ndarray, free: list[int] | np.ndarray) -> None:
        """The state a ``free_list`` and the occupied ``rows``/``keys`` describe (a checkpoint's)."""
        self.row_key[:] = NO_KEY
        rows = np.asarray(rows, dtype=np.int64)
        self.row_key[rows] = np.asarray(keys, dtype=np.int64)
        self._count = len(rows)
        free = np.asarray(free, dtype=np.int64)
        # the never-used rows: the longest prefix capacity-1, capacity-2, ... of the free list
        expect = np.arange(self.capacity - 1, self.capacity - 1 - len(free), -1)
        head = len(free) if np.array_equal(free, expect) else int(np.argmin(free == expect))
        self.high_water = self.capacity - head
        self._released = free[head:].copy()
        self._n_released = len(self._released)
        self._rebuild(len(self._slots))

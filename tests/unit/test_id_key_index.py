"""Issue 32 item 5: the ID table's key index in numpy arrays (flowtrain.train.ids.key_index), no Python
object per ID, behaves as the dict and free list it replaced."""
from __future__ import annotations

import numpy as np

from connectors.id_keys import NO_KEY
from flowtrain.train.ids import IdTable
from flowtrain.train.ids.key_index import KeyIndex


def test_key_index_equals_a_dict_and_a_free_list_under_churn():
    for seed in (0, 1, 2):
        rng = np.random.default_rng(seed)
        cap = 64
        index, ref, free = KeyIndex(cap), {}, list(range(cap - 1, -1, -1))
        universe = rng.integers(-2**63, 2**63 - 1, size=300, dtype=np.int64)
        universe = universe[universe != NO_KEY]
        for step in range(400):
            op = rng.integers(0, 4)
            if op == 0 and len(free) < 8:  # grow, as IdTable._grow does
                new = cap * 2
                index.grow(new)
                free = list(range(new - 1, cap - 1, -1)) + free
                cap = new
            elif op <= 1:  # admit absent keys
                keys = np.unique(rng.choice(universe, size=rng.integers(1, 12)))
                keys = np.asarray([k for k in keys.tolist() if k not in ref], dtype=np.int64)
                rows = index.allocate(len(keys))
                want = [free.pop() for _ in range(min(len(keys), len(free)))]
                assert rows.tolist() == want
                index.assign(keys[: len(rows)], rows)
                ref.update(zip(keys[: len(rows)].tolist(), rows.tolist()))
            elif op == 2 and ref:  # release some rows, in a given order
                gone = rng.choice(list(ref.values()), size=min(len(ref), int(rng.integers(1, 8))), replace=False)
                keys = index.release(gone)
                for k, r in zip(keys.tolist(), gone.tolist()):
                    assert ref.pop(k) == r
                    free.append(r)
            probe = np.concatenate([rng.choice(universe, size=20), np.asarray([NO_KEY])])
            assert index.lookup(probe).tolist() == [ref.get(int(k), -1) for k in probe]
            assert len(index) == len(ref) and dict(index.items()) == ref and set(index) == set(ref)
            assert index.free_list() == free and index.free_count() == len(free)
            if step % 50 == 0:  # a checkpoint's state loads back to the same index and free order
                again = KeyIndex(cap)
                rows = np.asarray(list(ref.values()), dtype=np.int64)
                again.load(rows, np.asarray(list(ref.keys()), dtype=np.int64), np.asarray(free, dtype=np.int64))
                assert dict(again.items()) == ref and again.free_list() == free


def test_key_index_costs_a_few_bytes_per_row_not_a_python_object():
    """A table's bookkeeping per row: the key (8 bytes) and under 6 bytes of hash slots; a dict was ~100."""
    n = 200_000
    index = KeyIndex(n)
    keys = np.random.default_rng(0).integers(-2**62, 2**62, size=n)
    index.assign(keys, index.allocate(n))
    assert len(index) == n and (index.lookup(keys) == np.arange(n)).all()
    repeated = np.concatenate([np.repeat(keys[:100], 5), [NO_KEY, 12345]])  # popular IDs, none, unknown
    assert index.lookup(repeated).tolist() == np.repeat(np.arange(100), 5).tolist() + [-1, -1]
    assert index.nbytes / n < 8 + 6
    table = IdTable(16, capacity=n)
    table.observe(keys)
    # the row and exp_avg (128), a row-wise exp_avg_sq (4) + step, last seen, dirty, key, slots
    per_row = table.state_bytes() / n
    assert 132 < per_row < 132 + 28, per_row

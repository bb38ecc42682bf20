"""Issue 32 item 5: the ID table's key index in numpy arrays (flowtrain.train.ids.key_index), no Python
object per ID, behaves as the dict and free list it replaced. Issue 49 item 4: its lookup compiled (probe.c) gives
the numpy path's rows, and the fused lookup-and-gather the rows' vectors."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from connectors.id_keys import NO_KEY, is_key
from flowtrain.train.ids import IdEmbedding, IdTable, compiled
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
            assert index.lookup_numpy(probe).tolist() == [ref.get(int(k), -1) for k in probe]
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


def test_the_install_built_the_compiled_lookup():
    """setup.py builds probe.c as an optional extension: an install without a compiler goes on, slower. The test
    environment must have it, or every test below would check the numpy path twice."""
    assert compiled.AVAILABLE, ("flowtrain/train/ids/_probe*.so is missing: `make install` (pip install -e .) builds it; "
                                "in a second work tree, `python setup.py build_ext --inplace`")


def _crowded(n_keys: int, seed: int) -> tuple[KeyIndex, np.ndarray]:
    """An index at its most crowded (LOAD full), with keys released (tombstones on probe paths) and some wrapped
    past the last slot."""
    rng = np.random.default_rng(seed)
    index = KeyIndex(n_keys)
    keys = rng.integers(-2**63, 2**63 - 1, size=n_keys, dtype=np.int64)
    keys = np.unique(keys[is_key(keys)])
    index.assign(keys, index.allocate(len(keys)))
    index.release(rng.choice(len(keys), size=len(keys) // 10, replace=False))  # under an eighth: tombstones stay
    return index, keys


@pytest.mark.parametrize("seed", [0, 1])
def test_compiled_lookup_equals_the_numpy_path(seed):
    index, keys = _crowded(5_000, seed)
    assert (index._slots == -2).any()  # tombstones on the probe paths
    absent = np.random.default_rng(seed + 10).integers(-2**62, 2**62, size=2_000)
    probe = np.concatenate([keys, absent, [NO_KEY], keys[::-7]])
    got, want = index.lookup(probe), index.lookup_numpy(probe)
    assert got.tolist() == want.tolist()
    assert (got >= 0).sum() == len(index) + (index.lookup(keys[::-7]) >= 0).sum()
    # keys whose probe path wraps from the last slot to the first: five keys all at home in the last slot
    small = KeyIndex(64)
    cand = np.random.default_rng(seed).integers(1, 2**62, size=200_000)
    last = cand[small._home(cand) == len(small._slots) - 1][:5]
    small.assign(last, small.allocate(5))
    assert (small._find(last) < len(small._slots) - 1).sum() == 4  # four of them wrapped
    assert small.lookup(last).tolist() == small.lookup_numpy(last).tolist() == [0, 1, 2, 3, 4]
    rows, missing = compiled.lookup(np.ascontiguousarray(probe), index._probe_tables()[2])
    assert missing == int((want < 0).sum())
    grid = probe[: 6 * 7].reshape(6, 7)[:, ::2]  # any shape, strided: each key's row in its place
    assert index.lookup(grid).tolist() == index.lookup_numpy(grid.ravel()).reshape(grid.shape).tolist()


@pytest.mark.parametrize("dim, dtype", [(16, torch.float32), (5, torch.float64), (40, torch.float32)])
def test_vectors_in_one_compiled_pass_equal_index_select_and_count_unknown_ids(dim, dtype):
    """IdTable.vectors (inference): the fused lookup and gather give index_select's rows, the fallback vector where
    a key has no row, and count the unknown IDs as rows_of does (row sizes of 64 bytes and others)."""
    table = IdTable(dim, capacity=3_000, dtype=dtype)
    rng = np.random.default_rng(0)
    known = rng.integers(1, 2**62, size=2_000)
    table.observe(known)
    table.weight.copy_(torch.randn(table.weight.shape, dtype=dtype))
    fallback = torch.randn(dim, dtype=dtype)
    probe = np.concatenate([known[rng.integers(0, 2_000, size=3_000)], rng.integers(2**62, 2**63 - 1, size=50),
                            [NO_KEY]])
    before = table.stats.unknown
    rows, out = table.vectors(probe, fallback)
    assert table.stats.unknown - before == 50
    want_rows = table.key_to_row.lookup_numpy(probe)
    assert rows.tolist() == want_rows.tolist()
    want = table.weight.index_select(0, torch.from_numpy(np.maximum(want_rows, 0)))
    want[torch.from_numpy(want_rows < 0)] = fallback
    assert out.dtype == dtype and torch.equal(out, want)


def test_a_copied_table_looks_up_in_its_own_arrays():
    """The compiled lookup keeps its arrays' addresses; a deep copy (a bundle's, hybrid.py's) finds its own, so the
    copy stays right when the original grows and its arrays move."""
    emb = IdEmbedding(4, capacity=8)
    keys = torch.arange(1, 7)
    emb.train()
    emb(keys)
    emb.eval()
    with torch.no_grad():
        first = emb(keys)
    twin = copy.deepcopy(emb)
    emb.train()
    emb(torch.arange(100, 140))  # grows: the original's slots and rows are new arrays
    emb.eval()
    assert twin.table.key_to_row.capacity == 8 and emb.table.key_to_row.capacity > 8
    with torch.no_grad():
        assert torch.equal(twin(keys), first) and torch.equal(emb(keys), first)
    assert twin.table.key_to_row.lookup(np.arange(100, 140)).tolist() == [-1] * 40

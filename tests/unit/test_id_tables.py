"""Issue 32 item 1: dynamic, collisionless ID embedding tables (flowtrain.train.ids)."""
from __future__ import annotations

import io

import numpy as np
import torch
from torch import nn

from connectors.id_keys import is_key
from flowtrain.train.ids import NO_KEY, IdEmbedding, IdTable, KeyReasons, key_of, keys_of


def _check_bijection(t: IdTable) -> None:
    """Two IDs never share a row: key_to_row and row_key are each other's inverse, free rows are unoccupied."""
    rows = list(t.key_to_row.values())
    assert len(rows) == len(set(rows))
    for k, r in t.key_to_row.items():
        assert t.occupied[r] and int(t.row_key[r]) == k
    assert int(t.occupied.sum()) == len(t.key_to_row)
    assert not t.occupied[t.free].any() if t.free else True
    assert len(set(t.free)) == len(t.free)
    assert len(t.free) + len(t.key_to_row) == t.capacity


def test_keys_are_stable_and_bad_values_counted():
    assert key_of("user-1") == key_of("user-1") != key_of("user-2")
    reasons = KeyReasons()
    keys = keys_of(["a", 42, "42", "", None, 1.5, "x" * 300, True], max_bytes=256, reasons=reasons)
    assert keys[1] == keys[2] == key_of("42")  # a JSON number and its CSV text are the same ID
    assert not is_key(keys[3:]).any() and is_key(keys[:3]).all()  # no key: each reason's reserved key
    assert reasons["empty"] == 1 and reasons["missing"] == 1
    assert reasons["wrong type (float)"] == 1 and reasons["wrong type (bool)"] == 1
    assert reasons["too long (over 256 bytes, --max-id-bytes)"] == 1


def test_id_rows_never_shared_under_eviction_and_reuse():
    rng = np.random.default_rng(0)
    universe = rng.integers(-2**62, 2**62, size=400)
    expired = evicted = 0
    for ttl in (300, 1500):  # the first mostly expires rows, the second mostly hits --max-ids
        t = IdTable(4, min_count=2, ttl=ttl, max_ids=50, capacity=8)
        for _ in range(200):
            batch = universe[np.minimum(rng.zipf(1.3, size=32), 400) - 1]
            rows = t.observe(batch)
            _check_bijection(t)
            # every occurrence of a key in a batch got the same row, distinct keys distinct rows
            seen: dict[int, int] = {}
            for k, r in zip(batch.tolist(), rows.tolist()):
                if r >= 0:
                    assert seen.setdefault(k, r) == r
            by_row: dict[int, int] = {}
            for k, r in seen.items():
                assert by_row.setdefault(r, k) == k
            assert len(t) <= 50
        assert t.stats.admitted > 50
        expired, evicted = expired + t.stats.expired, evicted + t.stats.evicted_lru
    assert expired > 0 and evicted > 0


def test_id_min_count_uses_fallback_until_seen_enough():
    t = IdTable(2, min_count=3)
    assert t.observe(np.array([7])).tolist() == [-1]
    assert t.observe(np.array([7])).tolist() == [-1]
    r = t.observe(np.array([7, 8]))
    assert r[0] >= 0 and r[1] == -1 and len(t) == 1
    assert t.observe(np.array([NO_KEY])).tolist() == [-1]


def test_id_ttl_expires_unseen_rows_and_forgets_counts():
    t = IdTable(2, min_count=1, ttl=10)
    t.observe(np.array([1, 2]))
    assert set(t.key_to_row) == {1, 2}
    for _ in range(11):
        t.observe(np.array([2]))
    assert set(t.key_to_row) == {2} and t.stats.expired == 1
    t2 = IdTable(2, min_count=2, ttl=10)
    t2.observe(np.array([5]))
    t2.observe(np.arange(100, 130))  # 30 events later: 5's count is forgotten
    assert t2.observe(np.array([5])).tolist() == [-1]


def test_id_max_ids_evicts_least_recently_seen():
    t = IdTable(2, max_ids=3)
    for k in (1, 2, 3):
        t.observe(np.array([k]))
    t.observe(np.array([1]))  # 2 is now the least recently seen
    t.observe(np.array([4]))
    assert set(t.key_to_row) == {1, 3, 4} and t.stats.evicted_lru == 1
    # every row seen in this batch: the new ID waits on the fallback vector
    assert t.observe(np.array([1, 3, 4, 9])).tolist()[3] == -1
    assert 9 not in t.key_to_row and t.stats.waiting == 1


def test_id_optimizer_state_reset_on_reuse():
    t = IdTable(3, max_ids=1, init_std=0.0)
    r = int(t.observe(np.array([10]))[0])
    t.apply_gradients(np.array([r]), torch.ones(1, 3), lr=0.1)
    assert t.row_step[r] == 1 and float(t.exp_avg[r].abs().sum()) > 0
    r2 = int(t.observe(np.array([11]))[0])  # 10 evicted, its row reused
    assert r2 == r and 10 not in t.key_to_row
    assert t.row_step[r] == 0 and float(t.exp_avg[r].abs().sum()) == 0 and float(t.exp_avg_sq[r].abs().sum()) == 0
    assert torch.equal(t.weight[r], torch.zeros(3))  # a fresh row at the fallback (zeros here)


def test_id_sparse_adam_is_row_wise_adam_and_torch_adam_when_a_rows_components_are_equal_in_size():
    """A row's Adam: first moment per element, second moment per row (the mean of g**2, FBGEMM's partial
    row-wise Adam). With components of one size (g**2 the same in each), it is torch's Adam exactly."""
    t = IdTable(4, init_std=0.1, seed=3)
    r = int(t.observe(np.array([123]))[0])
    p = nn.Parameter(t.weight[r].clone())
    opt = torch.optim.Adam([p], lr=0.05)
    for i in range(5):
        size = float(torch.rand(1, generator=torch.Generator().manual_seed(100 + i))) + 0.1
        g = size * torch.randn(4, generator=torch.Generator().manual_seed(i)).sign()
        p.grad = g.clone()
        opt.step()
        t.apply_gradients(np.array([r]), g[None, :], lr=0.05)
    assert torch.allclose(t.weight[r], p.detach(), atol=1e-6)
    # components of different sizes: the definition, written out
    t2 = IdTable(4, init_std=0.1, seed=3)
    r2 = int(t2.observe(np.array([123]))[0])
    w, m, v = t2.weight[r2].clone().double(), torch.zeros(4, dtype=torch.float64), 0.0
    for step in range(1, 6):
        g = torch.randn(4, generator=torch.Generator().manual_seed(step))
        t2.apply_gradients(np.array([r2]), g[None, :], lr=0.05)
        g = g.double()
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * float((g * g).mean())
        w = w - 0.05 / (1 - 0.9 ** step) * m / ((v / (1 - 0.999 ** step)) ** 0.5 + 1e-8)
    assert torch.allclose(t2.weight[r2].double(), w, atol=1e-6)


def test_id_embedding_trains_and_roundtrips_through_state_dict():
    torch.manual_seed(0)
    emb = IdEmbedding(4, min_count=1, ttl=1000)
    head = nn.Linear(4, 1)
    keys = torch.tensor([1, 2, 3, 1, NO_KEY])
    y = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0])
    opt = torch.optim.Adam(list(head.parameters()) + [emb.fallback], lr=0.05)
    for _ in range(20):
        loss = nn.functional.binary_cross_entropy_with_logits(head(emb(keys)).squeeze(1), y, reduction="sum")
        opt.zero_grad()
        loss.backward()
        for p in opt.param_groups[0]["params"]:
            if p.grad is not None:
                p.grad /= len(y)
        opt.step()
        emb.step(len(y), 0.05)
    assert emb.fallback.grad is not None  # the key-less row trained the fallback vector
    buf = io.BytesIO()
    torch.save(emb.state_dict(), buf)
    buf.seek(0)
    again = IdEmbedding(4)
    again.load_state_dict(torch.load(buf, weights_only=True))
    assert set(again.table.key_to_row) == {1, 2, 3}
    emb.eval(), again.eval()
    with torch.no_grad():
        assert torch.equal(emb(keys), again(keys))
        out = again(torch.tensor([99]))  # an unknown ID: the fallback vector, counted
    assert torch.equal(out[0], again.fallback.detach()) and again.table.stats.unknown == 1
    for a, b in ((emb.table.exp_avg, again.table.exp_avg), (emb.table.row_step, again.table.row_step)):
        assert (np.asarray(a) == np.asarray(b)).all() if isinstance(a, np.ndarray) else torch.equal(a, b)


def test_id_delta_holds_only_changed_rows():
    t = IdTable(2, ttl=5)
    t.observe(np.array([1, 2, 3]))
    d = t.take_delta()
    assert d.keys.tolist() == [1, 2, 3] and len(d.evicted) == 0
    r = t.key_to_row[2]
    t.apply_gradients(np.array([r]), torch.ones(1, 2), 0.1)
    d = t.take_delta()
    assert d.keys.tolist() == [2] and torch.equal(d.rows[0], t.weight[r])
    t.observe(np.array([2, 2, 2, 2, 2, 2]))  # 1 and 3 expire
    d = t.take_delta()
    assert d.keys.tolist() == [] and d.evicted.tolist() == [1, 3]


def test_id_ttl_shorter_than_a_batch_never_gives_a_row_seen_in_the_batch_to_another_id():
    """A key seen early in a batch whose TTL is shorter than the batch keeps its row: expiry never frees a row
    this batch's events already point to (it did: key 11 lost row 0 to key 21, both trained it)."""
    t = IdTable(2, ttl=2, min_count=1)
    t.observe(np.arange(11, 16))
    rows = t.observe(np.array([11, 21, 22, 23, 24]))
    assert len(set(rows.tolist())) == 5  # five keys, five rows
    assert t.key_to_row.lookup(np.array([11]))[0] == rows[0]  # 11 still owns the row its event trained
    # the keys not seen for longer than the TTL do expire
    assert (t.key_to_row.lookup(np.array([12, 13, 14, 15])) < 0).all()

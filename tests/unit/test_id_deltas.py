"""Issue 32 item 3: published versions carry the dense parameters and only the changed ID rows; the
scorer applies them strictly in order, a gap waits for the next snapshot."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from connectors.id_deltas import signed_record
from flowtrain.train.ids import IdEmbedding, key_of
from flowtrain.train.ids.publish import IdPublisher
from pipelines.ids.serving import ServedIds

KEY = b"k" * 32


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.user = IdEmbedding(4, ttl=60, max_ids=40, init_std=0.05)
        self.head = nn.Linear(4, 1)

    def forward(self, keys):
        return self.head(self.user(keys)).squeeze(1)


def _versions(n: int, snapshot_every: int = 4, seed: int = 0):
    """(record, payload) per version of a model trained a few steps between versions."""
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pub = IdPublisher(model, snapshot_every)
    out = []
    for v in range(1, n + 1):
        for _ in range(3):
            users = rng.zipf(1.3, size=16) + 10 * v  # new users each version, old ones expire
            keys = torch.as_tensor([key_of(f"u{u}") for u in users])
            loss = nn.functional.binary_cross_entropy_with_logits(model(keys), torch.ones(16), reduction="sum")
            opt.zero_grad()
            loss.backward()
            opt.step()
            model.user.step(16, 0.1)
        payload, meta = pub.publish(v)
        base_sha256 = out[-1][0]["sha256"] if meta.kind == "delta" else None
        out.append((signed_record(payload, version=v, base=meta.base, kind=meta.kind, run_id="r", path=f"v{v}",
                                  sequence=v, key=KEY, base_sha256=base_sha256), payload))
    return model, out


def _same_as_trainer(served: ServedIds, model: Net) -> None:
    table = model.user.table
    assert set(served.tables["user"].index) == set(table.key_to_row)
    keys = np.asarray(sorted(table.key_to_row), dtype=np.int64)
    want = table.weight[torch.as_tensor([table.key_to_row[int(k)] for k in keys])].numpy()
    assert np.array_equal(served.lookup("user", keys), want)
    assert np.array_equal(served.dense["head.weight"], model.head.weight.detach().numpy())


def test_id_deltas_applied_in_order_equal_the_trainer():
    model, versions = _versions(9)
    served = ServedIds(KEY)
    kinds = []
    for record, payload in versions:
        assert served.offer(record, payload) == "applied"
        kinds.append(record["kind"])
    assert kinds == ["snapshot", "delta", "delta", "delta", "snapshot", "delta", "delta", "delta", "snapshot"]
    _same_as_trainer(served, model)
    assert model.user.table.stats.expired > 0 or model.user.table.stats.evicted_lru > 0


def test_id_delta_gap_waits_for_the_next_snapshot():
    model, versions = _versions(9)
    served = ServedIds(KEY)
    served.offer(*versions[0])
    # version 2 is lost: 3 and 4 do not follow the served version 1, they are held, never applied
    assert served.offer(*versions[2]) == "held" and served.offer(*versions[3]) == "held"
    assert served.version == 1
    # the snapshot of version 5 is applied, and the deltas after it
    for record, payload in versions[4:]:
        assert served.offer(record, payload) == "applied"
    assert served.version == 9
    _same_as_trainer(served, model)


def test_id_delta_late_version_applied_once_its_base_is_served():
    model, versions = _versions(4)
    served = ServedIds(KEY)
    served.offer(*versions[0])
    assert served.offer(*versions[2]) == "held"
    assert served.offer(*versions[1]) == "applied"  # 2, then the held 3
    assert served.version == 3
    assert served.offer(*versions[1]) == "stale"  # a replay never rolls back
    assert served.offer(*versions[3]) == "applied"
    _same_as_trainer(served, model)


def test_id_evicted_row_served_until_its_delta():
    model = Net()
    pub = IdPublisher(model, snapshot_every=100)
    served = ServedIds(None)
    k1 = key_of("gone")
    model.user.train()
    model(torch.tensor([k1]))
    payload, meta = pub.publish(1)
    first = signed_record(payload, version=1, base=None, kind="snapshot", run_id="r", path="a", sequence=1, key=None)
    served.offer(first, payload)
    model(torch.arange(100, 170))  # 70 events later: k1 expired in the trainer
    assert k1 not in model.user.table.key_to_row
    row = served.lookup("user", np.array([k1]))
    assert not np.array_equal(row[0], served.dense["user.fallback"])  # still served from its last row
    payload, meta = pub.publish(2)
    assert k1 in meta.tables["user"].evicted.tolist()
    assert served.offer(signed_record(payload, version=2, base=1, kind="delta", run_id="r", path="b", sequence=2,
                                      key=None, base_sha256=first["sha256"]), payload) == "applied"
    before = served.unknown["user"]
    assert np.array_equal(served.lookup("user", np.array([k1]))[0], served.dense["user.fallback"])
    assert served.unknown["user"] == before + 1  # an unknown ID uses the fallback vector and is counted


def test_id_delta_of_another_lineage_never_applied_on_the_served_rows():
    """A trainer resumed from an older checkpoint (the newest did not verify) publishes versions 3, 4, ... again,
    from other rows: its delta 4 (on its own 3) must not land on the first lineage's 3, though the numbers
    follow (the old check, by number only, applied it). It is held; the scorer serves the first lineage whole
    until the second's next snapshot, then the second's rows exactly."""
    _, first = _versions(4, snapshot_every=100, seed=0)
    second_model, second = _versions(7, snapshot_every=5, seed=1)  # snapshots 1 and 6; deltas 2-5 and 7
    assert [r["kind"] for r, _ in second] == ["snapshot"] + ["delta"] * 4 + ["snapshot", "delta"]
    served = ServedIds(KEY)
    for record, payload in first[:3]:
        assert served.offer(record, payload) == "applied"
    rows_before = served.snapshot()
    assert second[3][0]["base"] == served.version == 3  # the same number, another payload
    assert served.offer(*second[3]) == "held" and served.offer(*second[4]) == "held"
    assert served.offer(*second[2]) == "stale"  # its 3: not newer than the served 3
    forged = first[2][0]["sha256"]  # claiming the served base: the signature covers base_sha256
    assert served.offer({**second[3][0], "base_sha256": forged}, second[3][1]).startswith("rejected")
    assert served.version == 3 and served.counts["applied"] == 3
    after = served.snapshot()
    for name, t in rows_before.tables.items():
        assert np.array_equal(after.tables[name].keys, t.keys) and np.array_equal(after.tables[name].rows, t.rows)
    assert {k: np.array_equal(v, after.dense[k]) for k, v in rows_before.dense.items()} == \
        {k: True for k in rows_before.dense}
    # the second lineage's snapshot 6 replaces everything (its held 4 and 5 are moot), then its 7
    assert served.offer(*second[5]) == "applied" and served.version == 6 and served.held == {}
    assert served.offer(*second[6]) == "applied" and served.version == 7
    _same_as_trainer(served, second_model)
    # a delta record without its base's digest is not believed
    unsigned = {k: v for k, v in first[1][0].items() if k not in ("base_sha256", "signature")}
    assert ServedIds(None).offer(unsigned, first[1][1]).startswith("rejected: version 2: a delta whose record")


def test_id_delta_tampered_or_unsigned_rejected():
    _, versions = _versions(2)
    record, payload = versions[0]
    served = ServedIds(KEY)
    assert served.offer(record, payload[:-4] + b"AAAA").startswith("rejected")
    assert served.offer({**record, "base": 7}, payload).startswith("rejected")  # signature covers the base
    assert ServedIds(b"x" * 32).offer(record, payload).startswith("rejected")
    assert served.version is None and served.counts["rejected"] == 2


def test_id_delta_bytes_proportional_to_rows_touched():
    """A 100,000-ID table with 1% touched: the delta is ~1% of the snapshot (bench/ids.py measures 1,000,000)."""
    model = Net()
    model.user = IdEmbedding(16, optimizer="sgd")
    model.head = nn.Linear(16, 1)
    model.user.train()
    model.user.table.observe(np.arange(100_000, dtype=np.int64))
    pub = IdPublisher(model, snapshot_every=1000)
    snap, _ = pub.publish(1)
    touched = np.arange(0, 100_000, 100, dtype=np.int64)
    rows = np.asarray([model.user.table.key_to_row[int(k)] for k in touched])
    model.user.table.apply_gradients(rows, torch.ones(len(rows), 16), 0.1)
    delta, meta = pub.publish(2)
    assert len(meta.tables["user"].keys) == 1000
    assert len(delta) < 0.02 * len(snap)
    assert len(snap) > 100_000 * 16 * 4

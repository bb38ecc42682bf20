"""The stream's features (pipelines/features/stream.py) against the backfill's core: bit for bit with ordered and
out-of-order delivery inside the allowed lateness, across kills at any point (the SQLite store reopened, the
records read again from the last committed offset), late events counted and left out, offset order kept."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from pipelines.features.columns import encode_keys, key_text, shard_of, time_micros, values_of
from pipelines.features.core import KeyFeatures
from pipelines.features.declare import declare
from pipelines.features.store import StateStore
from pipelines.features.stream import StreamFeatures, StreamPlan
from pipelines.features.transactions import generate_transactions

DECL = declare(["card:amount:count,sum,mean,max,std,last2:10m,1h,1d,life", "card:*:count:10m",
                "card:merchant:distinct:1d,life"])
PARTITIONS = 3


def _backfill(events: pa.Table) -> dict[str, np.ndarray]:
    """The backfill's values (one block, no state) of every event."""
    group = KeyFeatures(DECL.by_key(("card",)))
    names, codes, _ = encode_keys(key_text(events, ("card",)))
    return group.advance(names, codes, time_micros(events.column("time")),
                         {c: values_of(events.column(c)) for c in ("amount", "merchant")})


def _stream(events: pa.Table, tmp_path, lateness: float, kills: int, seed: int, cached: int = 100_000):
    """Every partition's records (keyed by card, in the table's order) through StreamFeatures in micro-batches,
    killed ``kills`` times at random points (before or after a checkpoint). Returns the rows that went on (by
    txn: values; a row sent twice must be the same) and the late txns."""
    rng = np.random.default_rng(seed)
    part = np.array([shard_of(c, PARTITIONS) for c in events.column("card").to_pylist()])
    plan = StreamPlan(DECL, "time", kinds=(("amount", "number"), ("merchant", "text")), allowed_lateness_s=lateness)
    sent: dict[int, dict] = {}
    late: set[int] = set()
    for p in range(PARTITIONS):
        records = events.filter(pa.array(part == p))
        n = records.num_rows
        path = tmp_path / f"p{p}.sqlite"
        committed = 0
        store = StateStore(path, cached=cached)
        feats = StreamFeatures(plan, store)
        kill_at = set(rng.integers(1, max(n // 60, 2), kills).tolist())
        flush, step = 0, 0
        last_offset, restarted = -1, False
        while committed < n:
            start = max(committed, feats.read_offset)
            size = int(rng.integers(1, 120))
            batch = records.slice(start, size)
            if not batch.num_rows:
                break
            offsets = np.arange(start, start + batch.num_rows)
            out = feats.offer(batch, offsets)
            if out.ready is not None:
                ids = out.ready.column("_offset").to_numpy()
                assert (np.diff(ids) > 0).all() and (ids[0] > last_offset or restarted), "offset order"
                restarted = False
                for row in out.ready.to_pylist():
                    key = row["txn"]
                    if key in sent:
                        assert _same(sent[key], row), ("sent again with other values", key)
                    sent[key] = row
                last_offset = ids[-1]
            if out.late is not None:
                late.update(out.late.column("txn").to_pylist())
            step += 1
            if step in kill_at and rng.random() < 0.5:  # killed before its checkpoint: the flush is lost
                store.close()
                store = StateStore(path, cached=cached)
                feats = StreamFeatures(plan, store)
                restarted = True
                continue
            feats.checkpoint()
            committed = feats.read_offset  # the Kafka commit, after the store's transaction
            flush += 1
            if step in kill_at:  # killed after the checkpoint (and maybe before the Kafka commit)
                store.close()
                store = StateStore(path, cached=cached)
                feats = StreamFeatures(plan, store)
                restarted = True
                if rng.random() < 0.5:
                    committed = max(0, committed - int(rng.integers(1, 30)))  # the commit did not happen
        store.close()
    return sent, late


def _same(a: dict, b: dict) -> bool:
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, float) and isinstance(y, float):
            if not (np.isnan(x) and np.isnan(y)) and np.float64(x).tobytes() != np.float64(y).tobytes():
                return False
        elif x != y:
            return False
    return True


@pytest.mark.parametrize("delay, lateness, kills, cached", [(0, 0.0, 0, 100_000), (0, 0.0, 6, 100_000),
                                                            (900, 900.0, 6, 5)],
                         ids=["ordered", "ordered, killed", "out of order within the lateness, killed, 5 keys cached"])
def test_the_stream_equals_the_backfill_bit_for_bit(tmp_path, delay, lateness, kills, cached):
    events, _ = generate_transactions(2000, cards=40, merchants=30, days=6, delay_s=delay, seed=9)
    sent, late = _stream(events, tmp_path, lateness, kills, seed=1, cached=cached)
    assert not late
    want = _backfill(events)
    txn = events.column("txn").to_numpy()
    held = len(txn) - len(sent)
    assert held <= PARTITIONS * 40 if lateness else held == 0  # only events inside the lateness at the end wait
    checked = 0
    for i, t in enumerate(txn):
        if t not in sent:
            continue
        row = sent[t]
        for name, col in want.items():
            w, g = col[i], row[name]
            if isinstance(w, float) or isinstance(w, np.floating):
                assert (np.isnan(w) and g is None) or np.float64(w).tobytes() == np.float64(g).tobytes(), (name, t)
            else:
                assert w == g, (name, t)
        checked += 1
    assert checked > 1700


def test_late_events_are_left_out_and_counted(tmp_path):
    events, _ = generate_transactions(2000, cards=30, merchants=20, days=4, delay_s=1800, seed=3)
    sent, late = _stream(events, tmp_path, lateness=300.0, kills=0, seed=2)
    assert late and len(sent) + len(late) <= events.num_rows
    kept = events.filter(pa.array([t not in late for t in events.column("txn").to_pylist()]))
    want = _backfill(kept)
    txn = kept.column("txn").to_numpy()
    for i, t in enumerate(txn):
        if t in sent:
            assert sent[t]["card_amount_count_1d"] == want["card_amount_count_1d"][i]
            assert np.float64(sent[t]["card_amount_sum_1h"]).tobytes() == want["card_amount_sum_1h"][i].tobytes()

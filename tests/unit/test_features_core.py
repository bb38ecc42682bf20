"""The aggregation core (pipelines/features/core.py) against a brute-force pandas oracle, and the same values bit
for bit however the events are cut into blocks, through serialised states, and with later events deleted."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from pipelines.features import exact
from pipelines.features.asof import AsOfTable
from pipelines.features.columns import encode_keys, key_text, values_of
from pipelines.features.core import KeyFeatures, OutOfOrderError
from pipelines.features.declare import declare
from pipelines.features.state import decode_state, encode_state
from tests.features_oracle import oracle

DECL = declare([
    "card:amount:count,sum,mean,min,max,std,distinct,last,last3:10m,1h,1d,life",
    "card:*:count:1h,life",
    "card:category:count,distinct,last2:1d,life",
    "card+shop:amount:sum,max:1h",
])


def _events(n=2500, seed=0) -> tuple[pd.DataFrame, np.ndarray]:
    rng = np.random.default_rng(seed)
    df = pd.DataFrame({
        "card": rng.integers(0, 30, n),
        "shop": rng.choice(["a", "b", "c"], n),
        "amount": np.round(rng.lognormal(3, 1.2, n), 2),
        "category": rng.choice(["food", "fuel", "travel", "web", None], n),
    })
    df.loc[rng.random(n) < 0.05, "amount"] = np.nan
    micros = np.sort(rng.integers(0, 3 * 86400, n)) * 1_000_000
    micros[100:110] = micros[100]  # ties: events at one time never see each other
    micros[500:503] = micros[500]
    order = rng.permutation(n)  # the input is not in time order
    return df.iloc[order].reset_index(drop=True), micros[order]


def _compute(df: pd.DataFrame, micros: np.ndarray, cuts=None, states=None, roundtrip=False) -> dict:
    """Every feature of DECL for the events, in blocks cut at ``cuts`` (time order), with states."""
    batch = pa.RecordBatch.from_pandas(df, preserve_index=False)
    out: dict[str, np.ndarray] = {}
    for key in DECL.keys():
        group = KeyFeatures(DECL.by_key(key))
        names, codes, _ = encode_keys(key_text(batch, key))
        cols = {c: values_of(batch.column(c)) for c in ("amount", "category")}
        if cuts is None:
            got = group.advance(names, codes, micros, cols, None)
        else:
            order = np.argsort(micros, kind="stable")
            states = {}
            parts = {}
            for lo, hi in zip([0, *cuts], [*cuts, len(order)]):
                rows = order[lo:hi]
                part = group.advance(names, codes[rows], micros[rows], {c: v[rows] for c, v in cols.items()}, states)
                if roundtrip:
                    states = {k: decode_state(encode_state(s)) for k, s in states.items()}
                for name, col in part.items():
                    parts.setdefault(name, []).append((rows, col))
            got = {}
            for name, pieces in parts.items():
                col = np.empty(len(order), dtype=pieces[0][1].dtype)
                for rows, values in pieces:
                    col[rows] = values
                got[name] = col
        out.update(got)
    return out


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal bit for bit (NaN equal to NaN)."""
    if a.dtype.kind == "f":
        return a.tobytes() == b.astype(a.dtype).tobytes()
    return list(a) == list(b)


def test_every_aggregation_and_window_equals_the_pandas_oracle():
    df, micros = _events()
    got = _compute(df, micros)
    want = oracle(df, DECL, micros)
    assert set(got) == set(DECL.aggregate_names())
    for name in DECL.aggregate_names():
        g, w = got[name], want[name].to_numpy()
        if g.dtype.kind in "iu":
            assert np.array_equal(g, w.astype(np.int64)), name  # counts exactly
        elif g.dtype.kind == "f":
            w = w.astype(float)
            assert np.array_equal(np.isnan(g), np.isnan(w)), name
            has = ~np.isnan(g)
            assert np.allclose(g[has], w[has], rtol=1e-9, atol=1e-12), (name, np.abs(g[has] - w[has]).max())
        else:
            assert list(g) == list(w), name


@pytest.mark.parametrize("roundtrip", [False, True], ids=["states", "serialised states"])
def test_blocks_and_states_give_the_same_values_bit_for_bit(roundtrip):
    df, micros = _events(seed=3)
    whole = _compute(df, micros)
    rng = np.random.default_rng(7)
    cuts = sorted(set(rng.integers(1, len(df), 25).tolist()))
    order = np.argsort(micros, kind="stable")
    ties = [i for i in range(1, len(df)) if micros[order[i]] == micros[order[i - 1]]]
    cuts = sorted(set(cuts + ties[:3]))  # blocks that cut between events at one time too
    blocks = _compute(df, micros, cuts=cuts, roundtrip=roundtrip)
    for name in whole:
        assert _same(whole[name], blocks[name]), name


def test_deleting_every_event_at_or_after_t_changes_no_feature_before_t():
    df, micros = _events(seed=5)
    whole = _compute(df, micros)
    for t in np.quantile(micros, [0.2, 0.5, 0.8]).astype(np.int64):
        keep = micros < t
        cut = _compute(df[keep].reset_index(drop=True), micros[keep])
        for name in whole:
            assert _same(whole[name][keep], cut[name]), (t, name)


def test_an_event_before_the_state_is_refused():
    group = KeyFeatures(declare(["card:*:count:1h"]).by_key(("card",)))
    states: dict = {}
    group.advance(["x"], np.array([0]), np.array([10_000_000]), {}, states)
    with pytest.raises(OutOfOrderError, match="earlier than its state's latest event"):
        group.advance(["x"], np.array([0]), np.array([9_000_000]), {}, states)


def test_exact_sums_do_not_lose_a_small_window_to_a_large_history():
    # A float64 prefix-sum difference loses ~1e-16 x the history's total; the exact sum does not.
    values = np.array([1e15, 1.0, 0.1, 0.2, 0.3])
    scale = exact.scale_for(values)
    sums = exact.prefix(exact.to_exact(values, scale))
    window = exact.to_float(np.array([sums[5] - sums[2]], dtype=object), scale)[0]
    assert window == math.fsum([0.1, 0.2, 0.3])
    assert (np.cumsum(values)[4] - np.cumsum(values)[1]) != window  # what float64 prefix sums give


def test_a_text_column_refuses_numeric_aggregations():
    group = KeyFeatures(declare(["card:category:sum:1h"]).by_key(("card",)))
    with pytest.raises(ValueError, match="sum needs numbers and column 'category' holds text"):
        group.advance(["x"], np.array([0]), np.array([0]), {"category": np.array(["a"], dtype=object)})


def test_as_of_join_equals_merge_asof():
    rng = np.random.default_rng(2)
    table = pd.DataFrame({"merchant": rng.choice(["m1", "m2", "m3"], 40),
                          "valid_from": rng.choice(np.arange(0, 10_000, 7), 40, replace=False) * 1_000_000,
                          "risk": rng.integers(0, 5, 40)})
    events = pd.DataFrame({"merchant": rng.choice(["m1", "m2", "m3", "m4"], 500)})
    micros = rng.integers(-500, 10_500, 500) * 1_000_000
    micros[:5] = table["valid_from"].to_numpy()[:5]  # a version that starts at t applies to t
    decl = declare(joins=["m.parquet:merchant:valid_from"])
    t = AsOfTable(decl.joins[0], pa.Table.from_pandas(table.assign(
        valid_from=pd.to_datetime(table["valid_from"], unit="us")), preserve_index=False))
    got = t.take(t.lookup(key_text(pa.table(events), ("merchant",)), micros))["merchant_risk"].to_pylist()
    want = oracle(events, decl, micros, {"m.parquet": table.assign(_vf_micros=table["valid_from"])})
    assert got == [None if pd.isna(v) else int(v) for v in want["merchant_risk"]]


def test_a_static_join_refuses_a_key_twice():
    decl = declare(joins=["m.csv:merchant"])
    with pytest.raises(ValueError, match="key 'm1' appears twice"):
        AsOfTable(decl.joins[0], pa.table({"merchant": ["m1", "m1"], "risk": [1, 2]}))

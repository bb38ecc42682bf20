"""`flowtrain features` (the backfill, a Beam pipeline on the FnApiRunner) on generated transactions against the
brute-force pandas oracle for every aggregation and window, the as-of join, the input's order, the leakage test
(deleting every event at or after t changes no feature of an event before t), rows without a time, and bad input
as one line."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from flowtrain.cli.main import main
from pipelines.features.declare import declare
from pipelines.features.transactions import generate_transactions
from tests.features_oracle import oracle

pytestmark = pytest.mark.timeout(300)

AGGREGATIONS = [
    "card:amount:count,sum,mean,min,max,std,last,last3:10m,1h,1d,7d,life",  # 20 days: 3 time blocks
    "card:*:count:10m,life",
    "card:merchant:distinct,last2:1d,life",
    "card+merchant:amount:sum,count:1d",
]


def _args(inputs, out, merchants):
    args = ["features", "--input", inputs, "--time-column", "time", "--out", out,
            "--join", f"{merchants}:merchant:valid_from"]
    for a in AGGREGATIONS:
        args += ["--aggregate", a]
    return args


@pytest.fixture(scope="module")
def backfill(tmp_path_factory):
    """4,000 generated payments delivered up to 20 minutes late (the file is in arrival order, times are whole
    seconds: ties), one row without a time; `flowtrain features` on all of them and on those before a cut."""
    base = tmp_path_factory.mktemp("features")
    txns, merchants = generate_transactions(4000, cards=60, merchants=40, days=20, delay_s=1200, seed=4)
    df = txns.to_pandas()
    df["time"] = df["time"].astype("Int64")
    df.loc[17, "time"] = pd.NA  # a row without a time
    pacsv.write_csv(pa.Table.from_pandas(df, preserve_index=False), base / "txns.csv")
    pacsv.write_csv(merchants, base / "merchants.csv")
    assert main(_args(str(base / "txns.csv"), str(base / "all.parquet"), str(base / "merchants.csv"))) == 0
    cut = int(np.quantile(txns.column("time").to_numpy(), 0.6))
    before = df[df["time"].fillna(cut + 1) < cut]
    pacsv.write_csv(pa.Table.from_pandas(before, preserve_index=False), base / "before.csv")
    assert main(_args(str(base / "before.csv"), str(base / "before.parquet"), str(base / "merchants.csv"))) == 0
    return {"df": df, "merchants": merchants.to_pandas(), "all": pq.read_table(base / "all.parquet").to_pandas(),
            "before": pq.read_table(base / "before.parquet").to_pandas(), "before_rows": before.index.to_numpy(),
            "base": base}


def test_every_aggregation_window_and_join_equals_the_pandas_oracle(backfill):
    df, got = backfill["df"], backfill["all"]
    micros = np.where(df["time"].isna(), -(1 << 62), df["time"].fillna(0).to_numpy(np.int64) * 1_000_000)
    decl = declare(AGGREGATIONS, ["merchants.csv:merchant:valid_from"])
    merchants = backfill["merchants"].assign(_vf_micros=backfill["merchants"]["valid_from"] * 1_000_000)
    want = oracle(df, decl, micros, {"merchants.csv": merchants})
    assert list(got.columns) == [*df.columns, *decl.aggregate_names(), "merchant_risk_tier"]
    assert got["txn"].tolist() == df["txn"].tolist()  # one row per input row, in the input's order
    checked = 0
    for name in [*decl.aggregate_names(), "merchant_risk_tier"]:
        g, w = got[name], want[name]
        if name.endswith(("_count_10m", "_seen")) or "_count_" in name or "_distinct_" in name:
            assert g.astype(np.int64).tolist() == w.astype(np.int64).tolist(), name  # counts exactly
        elif g.dtype == object:
            assert [None if pd.isna(v) else v for v in g] == [None if pd.isna(v) else v for v in w], name
        else:
            g, w = g.to_numpy(float), pd.to_numeric(w).to_numpy(float)
            assert np.array_equal(np.isnan(g), np.isnan(w)), name
            ok = ~np.isnan(g)
            assert np.allclose(g[ok], w[ok], rtol=1e-9, atol=0), (name, np.max(np.abs(g[ok] - w[ok])))
        checked += 1
    assert checked == len(decl.aggregate_names()) + 1
    # the row without a time: its row is there, with empty aggregates
    assert got.loc[17, "card_seen"] == 0 and got.loc[17, "card_amount_count_life"] == 0


def test_deleting_every_event_at_or_after_t_changes_no_feature_before_t(backfill):
    before, whole = backfill["before"], backfill["all"].iloc[backfill["before_rows"]].reset_index(drop=True)
    assert len(before) == len(whole) > 1000
    for name in before.columns:
        a, b = before[name], whole[name]
        if a.dtype.kind == "f":
            assert a.to_numpy().tobytes() == b.to_numpy().astype(a.dtype).tobytes(), name  # bit for bit
        else:
            assert [None if pd.isna(v) else v for v in a] == [None if pd.isna(v) else v for v in b], name


def test_bad_declarations_and_inputs_are_one_line(backfill, capsys):
    base = backfill["base"]
    txns = str(base / "txns.csv")
    cases = [
        (["--aggregate", "card:amount:sum:1h"], "--aggregate needs --time-column"),
        (["--time-column", "when", "--aggregate", "card:amount:sum:1h"], "has no column when"),
        (["--time-column", "time", "--aggregate", "card:category:sum:1h"], "sum need numbers and column 'category'"),
        (["--time-column", "time", "--aggregate", "card:amount:sum:1y"], "window '1y'"),
        (["--time-column", "time", "--join", f"{txns}:card"], "key 'c"),
    ]
    for extra, message in cases:
        code = main(["features", "--input", txns, "--out", str(base / "bad.parquet"), *extra])
        err = capsys.readouterr().err
        assert code == 2, (extra, err)
        assert message in err and err.strip().count("\n") == 0, (extra, err)
    assert main(_args(txns, str(base / "all.parquet"), str(base / "merchants.csv"))) == 2
    assert "exists: give --overwrite" in capsys.readouterr().err


def test_batch_trains_on_the_backfill_and_the_stream_takes_the_dataset_declaration(backfill, tmp_path, monkeypatch):
    """`flowtrain batch --aggregate/--join` runs `flowtrain features`' backfill before its ETL (the same rows, bit
    for bit), trains on the aggregates and joined columns and records the declaration in the dataset's manifest,
    which the stream's parts then take when given none (declared once)."""
    from connectors.dataset import read_manifest
    from flowtrain.commands.stream.inputs import over_time

    base, run = backfill["base"], tmp_path / "run"
    monkeypatch.chdir(base)  # the joined table given relative to here: the dataset records it absolute
    args = _args(str(base / "txns.csv"), "", "merchants.csv")
    declared = args[args.index("--join"):]
    assert main(["batch", "--input", str(base / "txns.csv"), "--label", "fraud", "--time-column", "time",
                 "--numeric", "amount", "--categorical", "category", *declared, "--job-only", "--out", str(run)]) == 0
    mine = pq.read_table(run / "features.parquet")
    assert mine.equals(pq.read_table(base / "all.parquet"))  # flowtrain features' code path, the same values
    manifest = read_manifest(str(run / "dataset"))
    recorded = manifest["features"]
    assert recorded["aggregations"] == AGGREGATIONS and recorded["joins"] == [f"{base / 'merchants.csv'}:merchant:valid_from"]
    spec = manifest["spec"]
    decl = declare(AGGREGATIONS, recorded["joins"])
    features = {*spec["numeric"], *spec["optional_numeric"], *spec["categorical"]}
    assert {*decl.aggregate_names(), "merchant_risk_tier"} <= features  # the model's columns
    assert {"card_amount_count_1d", "card_seen", "card_merchant_distinct_life"} <= set(spec["numeric"])
    assert "card_amount_mean_1h" in spec["optional_numeric"]
    # the stream: no --aggregate/--join given -> the dataset's; the same given -> kept; others -> one line
    taken = over_time({"aggregations": (), "joins": ()}, manifest, "DS")
    assert list(taken["aggregations"]) == AGGREGATIONS and list(taken["joins"]) == recorded["joins"]
    newer = {"aggregations": tuple(AGGREGATIONS), "joins": (f"{base / 'newer.csv'}:merchant:valid_from",)}
    assert over_time(newer, manifest, "DS") == newer  # a newer file of the same table
    with pytest.raises(SystemExit, match="differ from those dataset DS was made with"):
        over_time({"aggregations": ("card:amount:sum:1h",), "joins": ()}, manifest, "DS")

"""Issue 45 item 7 (sample weights) through the real batch job (the Beam ETL, the dataset, the trainer, the report):
--weight-column changes the fit as weights should (rows of weight 0 have no say: the fit equals the fit without
them, and differs from the unweighted one), bad weights are dead letters with their reason and the counts reconcile
(in = out + dead letters), a weight column the file lacks is a one-line error naming it, and the weights are never a
feature."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pytest

import flowtrain
from flowtrain.errors import FlowtrainError

pytestmark = pytest.mark.timeout(300)
FAST_API = {"steps": 30, "hidden": [16], "threads": 1, "no_progress": True, "seed": 1}


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    """Rows of two kinds with the same features: kind A's label is yes with probability sigmoid(3x), kind B's with
    sigmoid(-3x) (the opposite rule; noisy, so a fit is a smooth curve, not a step). Weighted, A weighs
    1 and B 0 (and a few rows carry bad weights); the same A rows alone; the same rows without a weight column."""
    base = tmp_path_factory.mktemp("weights")
    r = np.random.default_rng(0)
    n = 600
    x = r.normal(size=n)
    z = r.normal(size=n)  # a second feature, noise
    kind_b = np.arange(n) % 2 == 1
    p_yes = 1 / (1 + np.exp(np.where(kind_b, 3 * x, -3 * x)))
    y = (r.random(n) < p_yes).astype(np.int64)
    w = np.where(kind_b, 0.0, 1.0).astype(object)
    bad = {7: -1.0, 21: None, 35: float("nan")}  # negative, missing, not a number: dead letters
    for i, value in bad.items():
        w[i] = value
    weighted = pa.table({"x": x, "z": z, "y": y, "w": pa.array(list(w), pa.float64())})
    pacsv.write_csv(weighted, base / "weighted.csv")
    keep = ~kind_b & ~np.isin(np.arange(n), list(bad))
    pacsv.write_csv(weighted.filter(pa.array(keep)).drop_columns(["w"]), base / "a_only.csv")
    pacsv.write_csv(weighted.drop_columns(["w"]), base / "plain.csv")
    return {"base": base, "table": weighted, "kind_b": kind_b, "bad": bad, "x": x}


@pytest.fixture(scope="module")
def runs(tables):
    base = tables["base"]
    out = {}
    for name, extra in (("weighted", {"weight_column": "w"}), ("a_only", {}), ("plain", {})):
        summary = flowtrain.batch(input=[str(base / f"{name}.csv")], label="y", numeric=["x", "z"],
                                  task="classification", out=str(base / "runs" / name), **extra, **FAST_API)
        out[name] = {"summary": summary, "dir": base / "runs" / name}
    return out


def _p_yes(run_dir, x):
    rows = pa.table({"x": x, "z": np.zeros_like(x)}).to_pandas()
    predicted = flowtrain.load(str(run_dir)).predict(rows)
    return predicted["pred_probability_1"].to_numpy()


def test_rows_of_weight_zero_have_no_say_the_fit_equals_the_fit_without_them(tables, runs):
    grid = np.linspace(-2.5, 2.5, 41)
    weighted, a_only, plain = (_p_yes(runs[k]["dir"], grid) for k in ("weighted", "a_only", "plain"))
    # the weighted fit learns kind A's rule (yes above 0), as training on kind A alone does (not to the last digit:
    # the runs split their own rows at random, and a fit's L2 penalty scales with its rows) ...
    assert (weighted[grid > 1] > 0.8).all() and (weighted[grid < -1] < 0.2).all(), weighted
    np.testing.assert_allclose(weighted, a_only, atol=0.1)
    # ... while without the weights the two kinds cancel out: no rule
    assert np.abs(plain - 0.5).max() < 0.2, plain
    # the weighted metrics are reported, and the weight column is no feature
    test_metrics = runs["weighted"]["summary"]["test"]["model"]
    assert {"weighted_log_loss", "weighted_accuracy"} <= set(test_metrics)
    assert test_metrics["weighted_accuracy"] > 0.7 and "weighted_accuracy" not in runs["plain"]["summary"]["test"]["model"]
    manifest = json.loads((runs["weighted"]["dir"] / "dataset" / "_manifest.json").read_text())
    assert manifest["spec"]["weight_column"] == "w" and manifest["spec"]["numeric"] == ["x", "z"]
    assert json.loads((runs["weighted"]["dir"] / "config.json").read_text())["weight_column"] == "w"
    report = (runs["weighted"]["dir"] / "report.md").read_text()
    unused = [line for line in report.splitlines() if "not used" in line]
    assert "sample weights: column `w` (not a feature" in report and len(unused) == 1 and "`w`" not in unused[0]


def test_bad_weights_are_dead_letters_and_the_counts_reconcile(tables, runs):
    manifest = json.loads((runs["weighted"]["dir"] / "dataset" / "_manifest.json").read_text())
    counts = manifest["counts"]
    assert counts["in"] == tables["table"].num_rows == counts["out"] + counts["dead_letters"]
    reason = "weight column 'w' is missing, not a finite number or negative (a sample weight is a number >= 0)"
    assert counts["dead_letters_by_reason"] == {reason: len(tables["bad"])}
    good = tables["table"].num_rows - len(tables["bad"])
    weights = [v for i, v in enumerate(tables["table"].column("w").to_pylist()) if i not in tables["bad"]]
    assert len(weights) == good and manifest["stats"]["weight_sum"] <= sum(weights)  # the training split's share


def test_a_weight_column_the_file_lacks_is_a_one_line_error_naming_it(tables, tmp_path):
    with pytest.raises((FlowtrainError, ValueError)) as err:
        flowtrain.batch(input=[str(tables["base"] / "plain.csv")], label="y", numeric=["x", "z"],
                        weight_column="weight", out=str(tmp_path / "run"), **FAST_API)
    message = str(err.value)
    assert "weight" in message and "x, z, y" in message and "\n" not in message.strip(), message

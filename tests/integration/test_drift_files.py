"""Issue 34 (reference profiles, drift in batch, data quality, done-when for `flowtrain drift`): a batch run
stores its reference profile (run directory and bundle); a table whose second half is shifted (one numeric
feature's mean +1 s.d., one categorical feature gaining a new frequent value, the label's base rate doubled)
raises alarms for exactly those in `flowtrain drift`'s exit code and report, and none on the unshifted half."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pytest

ROWS = 2000  # each half: the documented window of `--drift-window` (docs/observability.md)


def make_table(rng, n: int, *, shifted: bool = False) -> pa.Table:
    """x1 ~ N(5, 2) (+1 s.d. shifted), x2 ~ N(0, 1), c in a/b/c (shifted: 30% "zzz", never seen), d in p/q,
    optional o with 5% missing; the label y is 1 with probability 0.2 (shifted: 0.4)."""
    x1 = rng.normal(5.0, 2.0, n) + (2.0 if shifted else 0.0)
    c = rng.choice(["a", "b", "c"], size=n, p=[0.5, 0.3, 0.2]).astype(object)
    if shifted:
        c[rng.random(n) < 0.3] = "zzz"
    o = rng.normal(1.0, 1.0, n)
    y = (rng.random(n) < (0.4 if shifted else 0.2)).astype(np.int64)
    return pa.table({"x1": x1, "x2": rng.normal(0.0, 1.0, n), "c": c.tolist(),
                     "d": rng.choice(["p", "q"], size=n).tolist(),
                     "o": pa.array(o, mask=rng.random(n) < 0.05), "y": y})


@pytest.fixture(scope="module")
def drift_run(tmp_path_factory) -> dict:
    from flowtrain import batch as run_batch

    base = tmp_path_factory.mktemp("drift")
    rng = np.random.default_rng(34)
    pacsv.write_csv(make_table(rng, 6000), base / "train.csv")
    pacsv.write_csv(make_table(rng, ROWS), base / "first.csv")
    pacsv.write_csv(make_table(rng, ROWS, shifted=True), base / "second.csv")
    summary = run_batch(**{"input": [str(base / "train.csv")], "label": "y", "numeric": "x1,x2",
                           "optional_numeric": "o", "categorical": "c,d", "task": "classification",
                           "out": str(base / "run"), "no_progress": True, "threads": 1, "steps": 40})
    return {"base": base, "run": Path(summary["run_dir"])}


def test_batch_run_stores_its_reference_profile_next_to_the_spec_and_in_the_bundle(drift_run):
    from flowtrain.train.bundle import read_bundle

    run = drift_run["run"]
    profile = json.loads((run / "drift_reference.json").read_text())
    assert set(profile["numeric"]) == {"x1", "x2", "o"} and set(profile["categorical"]) == {"c", "d"}
    x1 = profile["numeric"]["x1"]
    assert len(x1["counts"]) == 10 and abs(x1["edges"][4] - 5.0) < 0.5  # quantile bins in the column's units
    assert x1["min"] < 0 and x1["max"] > 10 and profile["numeric"]["o"]["missing"] == pytest.approx(0.05, abs=0.02)
    assert profile["categorical"]["c"]["values"] == ["a", "b", "c"]
    assert profile["label"]["name"] == "y" and profile["label"]["kind"] == "classes"
    share = profile["label"]["counts"][1] / sum(profile["label"]["counts"])
    assert share == pytest.approx(0.2, abs=0.03)
    assert profile["prediction"]["kind"] == "numeric" and sum(profile["prediction"]["counts"]) > 0
    bundle = read_bundle(run / "bundle")  # checksummed with the bundle's other files
    assert bundle.extra_json("drift_reference.json") == profile


def _drift(run: Path, files: list[Path], out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flowtrain.cli", "drift", "--model", str(run),
                           *[a for f in files for a in ("--input", str(f))], "--out", str(out)],
                          capture_output=True, text=True, timeout=300)


def test_flowtrain_drift_alarms_for_the_shifted_features_only_with_exit_code_3(drift_run):
    base, run = drift_run["base"], drift_run["run"]
    quiet = _drift(run, [base / "first.csv"], base / "quiet")
    assert quiet.returncode == 0, quiet.stdout + quiet.stderr
    report = json.loads((base / "quiet" / "drift.json").read_text())
    assert report["alarms"] == [] and report["rows"] == ROWS, report["alarms"]  # no false alarm
    shifted = _drift(run, [base / "second.csv"], base / "shifted")
    assert shifted.returncode == 3, shifted.stdout + shifted.stderr
    report = json.loads((base / "shifted" / "drift.json").read_text())
    assert set(report["alarms"]) - {"(prediction)"} == {"x1", "c", "y"}, report["alarms"]
    by = {e["feature"]: e for e in report["features"]}
    assert "psi" in by["x1"]["alarms"] and by["x1"]["measures"]["psi"] > 0.2
    assert "unseen" in by["c"]["alarms"] and by["c"]["unseen_rate"] == pytest.approx(0.3, abs=0.04)
    assert by["y"]["kind"] == "label" and by["y"]["measures"]["linf"] > 0.15
    assert "ALARM: x1" in shifted.stdout.replace("ALARM: c", "ALARM: x1") or "x1 (numeric)" in shifted.stdout
    page = (base / "shifted" / "drift.html").read_text()
    assert 'data-feature="x1" data-alarm="1"' in page and 'data-feature="x2" data-alarm="0"' in page
    assert page.count("<svg") >= 6  # a histogram pair per feature, label and score
    assert page.index('data-feature="x2"') > page.index('data-feature="x1"')  # ranked by drift


def test_flowtrain_drift_bad_input_is_one_line_naming_it(drift_run):
    base, run = drift_run["base"], drift_run["run"]
    (base / "other.csv").write_text("a,b\n1,2\n")
    bad = _drift(run, [base / "other.csv"], base / "bad")
    assert bad.returncode not in (0, 3) and "x1" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr


def test_predict_summary_has_a_drift_section_with_data_quality(drift_run, capsys):
    import flowtrain

    base, run = drift_run["base"], drift_run["run"]
    summary = flowtrain.predict(str(run), [str(base / "second.csv")], str(base / "preds.parquet"))
    drift = summary["drift"]
    assert set(drift["alarms"]) - {"(prediction)"} == {"x1", "c", "y"} and drift["rows"] == ROWS
    assert any(q["feature"] == "c" and q["issue"] == "unseen_spike" for q in drift["quality"])
    saved = json.loads((base / "preds.parquet.metrics.json").read_text())
    assert saved["drift"]["alarms"] == drift["alarms"]
    assert "predict: drift: " in capsys.readouterr().out


def test_drift_thresholds_change_the_alarms(drift_run):
    from connectors.fields import check
    from flowtrain.commands.drift.job import bundle_reference, measure_files, predict_drift_section
    from flowtrain.commands.predict.job import PredictJob
    from flowtrain.train.bundle import read_bundle
    from pipelines.drift.profile import counts_to_json

    base, run = drift_run["base"], drift_run["run"]
    bundle = read_bundle(run / "bundle")
    reference = bundle_reference(bundle)
    counts, _ = measure_files([str(base / "second.csv")], bundle, reference)
    loose = predict_drift_section(reference, counts_to_json(counts), thresholds="psi=50,js=1")
    assert "x1" not in loose["alarms"] and "c" in loose["alarms"] and loose["thresholds"]["psi"] == 50
    assert check(PredictJob(drift_threshold="psi=50")).drift_threshold == "psi=50"
    with pytest.raises(Exception, match="MEASURE one of psi"):
        check(PredictJob(drift_threshold="ks=0.1"))

"""The batch run's evaluation report (report.md, report.html, figures, intervals, importance,
slices) and its TensorBoard event files, on small synthetic tables through the real `flowtrain batch`."""
from __future__ import annotations

import base64
import json
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest


def _write_csv(path: Path, header: list[str], columns: list) -> None:
    rows = zip(*columns)
    path.write_text(",".join(header) + "\n" + "".join(",".join(str(v) for v in row) + "\n" for row in rows))


def _binary_csv(path: Path, n: int = 3000) -> None:
    rng = np.random.default_rng(0)
    x1, x2 = rng.normal(size=n), rng.normal(size=n)
    c = rng.choice(["red", "green", "blue", "grey"], size=n, p=[0.4, 0.3, 0.2, 0.1])
    logit = 1.5 * x1 - 0.5 * x2 + (c == "red") * 1.0 - 0.3
    y = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(int)
    _write_csv(path, ["x1", "x2", "c", "y"], [np.round(x1, 5), np.round(x2, 5), c, y])


def _batch(args: list[str]) -> int:
    from flowtrain.cli.main import main

    return main(["batch", "--threads", "1", "--no-progress", *args])


@pytest.fixture(scope="module")
def binary_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("binary")
    _binary_csv(base / "data.csv")
    t0 = time.time()
    rc = _batch(["--input", str(base / "data.csv"), "--label", "y", "--task", "classification", "--numeric", "x1,x2",
                 "--categorical", "c", "--slice-by", "c", "--epochs", "3", "--hidden", "16",
                 "--out", str(base / "run")])
    assert rc == 0
    return base / "run", t0, time.time()


def _embedded_images(html: str) -> dict[str, bytes]:
    """alt text -> PNG bytes of every image embedded in the HTML."""
    found = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    return {alt: base64.b64decode(data) for alt, data in found}


def _intervals_cover(intervals: dict) -> int:
    checked = 0
    for name, metrics in intervals["models"].items():
        for key, m in metrics.items():
            if m["value"] == m["value"]:
                assert m["low"] - 1e-12 <= m["value"] <= m["high"] + 1e-12, (name, key, m)
                checked += 1
    for key, m in (intervals.get("difference") or {}).get("metrics", {}).items():
        assert m["low"] - 1e-12 <= m["value"] <= m["high"] + 1e-12, ("difference", key, m)
        checked += 1
    return checked


def test_binary_report_has_curves_thresholds_intervals_importance_and_slices(binary_run):
    run, _, _ = binary_run
    summary = json.loads((run / "summary.json").read_text())
    ev = summary["evaluation"]
    models = set(ev["intervals"]["models"])
    assert models == {"flowtrain model", "linear model", "majority class"}
    # every interval covers its point estimate, the model-minus-linear difference too
    assert _intervals_cover(ev["intervals"]) == 3 * 4 + 4
    # the point estimates are the same numbers the test table has always reported
    assert ev["intervals"]["models"]["flowtrain model"]["auc"]["value"] == pytest.approx(
        summary["test"]["model"]["auc"], abs=1e-6)
    # thresholds: the chosen one from validation, metrics at it and at 0.5, a 9-row table, for each model
    for name in models:
        b = ev["binary"][name]
        assert 0 < b["chosen_threshold"] < 1 and b["at_half"]["threshold"] == 0.5
        assert [r["threshold"] for r in b["table"]] == pytest.approx([0.1 * i for i in range(1, 10)])
        assert 0 <= b["brier"] <= 1
    # importance: x1 carries most of the signal and its interval excludes 0
    top = ev["importance"]["features"][0]
    assert top["feature"] == "x1" and top["low"] > 0
    # slices: every test row in exactly one slice
    assert sum(r["rows"] for r in ev["slices"]["rows"]) == summary["rows"]["test"]
    assert {r["value"] for r in ev["slices"]["rows"]} == {"red", "green", "blue", "grey"}
    # the figures exist as files and inside the self-contained HTML
    html = (run / "report.html").read_text()
    images = _embedded_images(html)
    for alt, name in (("ROC curve", "roc.png"), ("precision/recall curve", "pr.png"),
                      ("calibration curve", "calibration.png"), ("permutation importance", "importance.png")):
        assert images[alt] == (run / name).read_bytes() and images[alt][:8] == b"\x89PNG\r\n\x1a\n"
    assert "src=\"http" not in html and "<script" not in html
    md = (run / "report.md").read_text()
    for name in ("roc.png", "pr.png", "calibration.png", "importance.png"):
        assert f"({name})" in md
    if os.environ.get("FLOWTRAIN_UPDATE_DOCS") == "1":  # the figures in docs/observability.md, made on request
        docs = Path(__file__).resolve().parents[2] / "docs" / "img"
        for name in ("roc.png", "calibration.png", "importance.png"):
            (docs / f"report-{name}").write_bytes((run / name).read_bytes())
    assert "## Slices by c" in md and "## Thresholds" in md
    # which model, in words
    if summary["training"]["best_step"] == 0:
        assert "equals its linear part (the fitted linear baseline): no checkpoint beat it on validation auc by one " \
               "standard error" in md
    else:
        assert f"checkpoint at step {summary['training']['best_step']:,}" in md


def test_batch_run_writes_tensorboard_events_and_timestamped_metrics(binary_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, t0, t1 = binary_run
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    for tag in ("train/loss", "train/lr", "train/rows_per_s", "valid/auc", "valid/loss", "test/auc",
                "test/accuracy", "test/brier"):
        assert tag in tags["scalars"], tag
    assert "test/pr_curve" in tags["tensors"]
    # the scalars equal metrics.jsonl, whose every line has a wall-clock time within the run
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records and all(t0 <= r["time"] <= t1 for r in records)
    valid = [r for r in records if r["kind"] == "valid"]
    assert [(e.step, e.value) for e in acc.Scalars("valid/auc")] == [
        (r["step"], pytest.approx(r["auc"], rel=1e-6)) for r in valid]
    summary = json.loads((run / "summary.json").read_text())
    assert acc.Scalars("test/auc")[-1].value == pytest.approx(summary["test"]["model"]["auc"], abs=1e-6)
    # hparams: the options with the final test metrics
    from tensorboard.plugins.hparams import plugin_data_pb2

    content = acc.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    assert start.session_start_info.hparams["hidden"].string_value == "16"
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"])
    assert "test/auc" in {m.name.tag for m in experiment.experiment.metric_infos}


def test_regression_report_has_residual_and_predicted_vs_actual_plots(shared_data):
    _, run = shared_data.regression_run()
    summary = json.loads((run / "summary.json").read_text())
    ev = summary["evaluation"]
    assert _intervals_cover(ev["intervals"]) == 3 * 3 + 3
    assert ev["intervals"]["models"]["flowtrain model"]["rmse"]["value"] == pytest.approx(
        summary["test"]["model"]["rmse"], rel=1e-5)
    images = _embedded_images((run / "report.html").read_text())
    assert {"predicted vs actual", "residuals", "permutation importance"} <= set(images)
    assert (run / "residuals.png").is_file() and (run / "predicted_vs_actual.png").is_file()
    assert ev["importance"]["features"][0]["feature"] == "x"  # y = 3x + ...: x matters most


def test_multiclass_report_has_per_class_auc(tmp_path):
    rng = np.random.default_rng(1)
    n = 1500
    x = rng.normal(size=n)
    label = np.where(x < -0.5, "low", np.where(x > 0.5, "high", "mid"))
    noise = rng.random(n) < 0.1
    label[noise] = rng.choice(["low", "mid", "high"], size=int(noise.sum()))
    _write_csv(tmp_path / "data.csv", ["x", "z", "label"], [np.round(x, 5), np.round(rng.normal(size=n), 5), label])
    assert _batch(["--input", str(tmp_path / "data.csv"), "--label", "label", "--task", "classification",
                   "--numeric", "x,z", "--epochs", "2", "--hidden", "8", "--out", str(tmp_path / "run")]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    auc = summary["evaluation"]["per_class_auc"]["flowtrain model"]
    assert set(auc) == {"high", "low", "mid"} and all(0.5 < v <= 1 for v in auc.values())
    md = (tmp_path / "run" / "report.md").read_text()
    assert "ROC AUC (one vs rest)" in md
    assert _intervals_cover(summary["evaluation"]["intervals"]) == 3 * 3 + 3


def test_slice_by_a_column_that_is_not_categorical_fails_before_training(tmp_path, capsys):
    _binary_csv(tmp_path / "data.csv", n=400)
    rc = _batch(["--input", str(tmp_path / "data.csv"), "--label", "y", "--task", "classification",
                 "--numeric", "x1,x2", "--categorical", "c", "--slice-by", "x1", "--epochs", "1",
                 "--out", str(tmp_path / "run")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--slice-by x1: not a categorical feature of the dataset; use one of c" in err
    assert not (tmp_path / "run" / "model.pt").exists()


def test_bootstrap_intervals_and_thresholds_on_known_numbers():
    from flowtrain.train.evaluation import at_threshold, bootstrap, choose_threshold

    rng = np.random.default_rng(0)
    y = (rng.random(2000) < 0.3).astype(float)
    good = np.clip(0.3 + 0.4 * (y - 0.3) + rng.normal(scale=0.15, size=2000), 0.001, 0.999)
    bad = np.full(2000, 0.3)
    out = bootstrap("binary", y, {"good": good, "bad": bad}, b=100, difference=("good", "bad"))
    assert _intervals_cover(out) == 4 + 4 + 4
    assert out["difference"]["metrics"]["auc"]["low"] > 0.2  # the good model is clearly better
    m = at_threshold(np.array([1, 1, 0, 0.0]), np.array([0.9, 0.4, 0.6, 0.1]), 0.5)
    assert (m["accuracy"], m["precision"], m["recall"], m["f1"]) == (0.5, 0.5, 0.5, 0.5)
    assert 0.2 < choose_threshold(y, good) < 0.6


def test_compare_two_runs_prints_options_metrics_with_intervals_and_overlays_validation_curves(binary_run, tmp_path,
                                                                                                capsys):
    from flowtrain.cli.main import main

    first, _, _ = binary_run
    second = tmp_path / "second"
    assert _batch(["--input", str(first.parent / "data.csv"), "--label", "y", "--task", "classification",
                   "--numeric", "x1,x2", "--categorical", "c", "--epochs", "2", "--hidden", "8", "--lr", "0.003",
                   "--out", str(second)]) == 0
    capsys.readouterr()
    assert main(["compare", str(first), str(second), "--out", str(tmp_path / "cmp")]) == 0
    printed = capsys.readouterr().out
    assert "| hidden | 16 | 8 |" in printed and "| lr | 0.001 | 0.003 |" in printed
    assert "| epochs | 3 | 2 |" in printed
    for run, column in ((first, 0), (second, 1)):
        auc = json.loads((run / "summary.json").read_text())["evaluation"]["intervals"]["models"]["flowtrain model"]
        row = next(line for line in printed.splitlines() if line.startswith("| auc |"))
        cell = row.split("|")[2 + column].strip()
        assert cell == f"{auc['auc']['value']:.4f} [{auc['auc']['low']:.4f}, {auc['auc']['high']:.4f}]"
    assert (tmp_path / "cmp" / "compare.md").read_text() in printed
    png = (tmp_path / "cmp" / "compare.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert data["options"]["hidden"] == [[16], [8]]
    # a directory that is not a finished batch run: exit 2, named
    assert main(["compare", str(first), str(tmp_path)]) == 2
    assert f"compare: {tmp_path}: not a finished `flowtrain batch` run (no summary.json)" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["binary", "multiclass", "regression"])
def test_weighted_bootstrap_metrics_equal_scikit_learn_on_the_resampled_rows(kind):
    from flowtrain.train.evaluation import point_metrics, weighted_metrics

    rng = np.random.default_rng(5)
    n = 3000
    if kind == "binary":
        y = (rng.random(n) < 0.3).astype(float)
        p = np.round(np.clip(0.3 + 0.3 * (y - 0.3) + rng.normal(scale=0.2, size=n), 0.001, 0.999), 2)  # ties
    elif kind == "multiclass":
        y, p = rng.integers(0, 4, n).astype(float), rng.dirichlet(np.ones(4), n)
    else:
        y = rng.normal(size=n)
        p = y + rng.normal(size=n)
    assert weighted_metrics(kind, y, p, np.ones(n)) == pytest.approx(point_metrics(kind, y, p), rel=1e-9)
    rows = rng.integers(0, n, n)  # a bootstrap resample: rows drawn with replacement = rows weighted by count
    weights = np.bincount(rows, minlength=n).astype(float)
    assert weighted_metrics(kind, y, p, weights) == pytest.approx(point_metrics(kind, y[rows], p[rows]), rel=1e-9)

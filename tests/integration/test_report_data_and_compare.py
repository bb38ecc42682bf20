"""What a data scientist checks first in a batch run's report and in `flowtrain compare` (issue 29
item 8), and that text from the data never becomes HTML in report.md / report.html (issue 28 item
14), on a small table through the real `flowtrain batch`: a time column, two unused columns, a class,
a column and category values that are HTML or Markdown links."""
from __future__ import annotations

import csv
import datetime as dt
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

HOSTILE_COLUMN = "<img src=x onerror=alert(1)>"
HOSTILE_CLASS = "<script>alert(1)</script>"
HOSTILE_VALUES = ["[click](javascript:alert(1))", "a|b", "<b>bold</b>"]


def _table(path: Path, n: int = 400) -> None:
    """y is a class of |x| (no linear model can fit it); ``id`` and ``note`` are never declared."""
    rng = np.random.default_rng(0)
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["id", "when", "x", HOSTILE_COLUMN, "note", "y"])
        for i in range(n):
            x = rng.normal()
            y = HOSTILE_CLASS if abs(x) + rng.normal() * 0.1 > 1 else "ok"
            w.writerow([i, (dt.date(2024, 1, 1) + dt.timedelta(days=i)).isoformat(), round(x, 5),
                        rng.choice(HOSTILE_VALUES), "n", y])


def _batch(args: list[str]) -> int:
    from flowtrain.cli.main import main

    return main(["batch", "--threads", "1", "--no-progress", "--label", "y", "--numeric", "x",
                 "--categorical", HOSTILE_COLUMN, "--time-column", "when", *args])


@pytest.fixture(scope="module")
def step_zero_run(tmp_path_factory):
    """A run whose model cannot move (lr 1e-6): reported at step 0, equal to its linear baseline, a
    flat validation curve. Every figure saved is recorded: its titles and legend texts."""
    import matplotlib.figure

    base = tmp_path_factory.mktemp("report")
    _table(base / "data.csv")
    figures: list[dict] = []
    save = matplotlib.figure.Figure.savefig

    def recording(fig, fname, *args, **kwargs):
        axes = fig.get_axes()
        figures.append({"titles": [ax.get_title() for ax in axes],
                        "legend": [t.get_text() for ax in axes if ax.get_legend() for t in ax.get_legend().get_texts()],
                        "texts": [t.get_text() for ax in axes for t in ax.texts],
                        "ylim": [ax.get_ylim() for ax in axes]})
        return save(fig, fname, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(matplotlib.figure.Figure, "savefig", recording)
        assert _batch(["--input", str(base / "data.csv"), "--slice-by", HOSTILE_COLUMN, "--lr", "1e-6",
                       "--steps", "20", "--out", str(base / "run")]) == 0
    return base / "run", figures


def _date(seconds: float) -> str:
    t = dt.datetime.fromtimestamp(seconds, dt.timezone.utc)
    return t.date().isoformat() if t.time() == dt.time(0) else t.isoformat().replace("+00:00", "Z")


def test_report_shows_the_time_split_as_dates_the_features_used_the_unused_columns_and_the_time_columns_role(
        step_zero_run):
    run, _ = step_zero_run
    md = (run / "report.md").read_text()
    manifest = json.loads((run / "dataset" / "_manifest.json").read_text())
    split = manifest["split"]
    cut_valid, cut_test = _date(split["valid_from"]), _date(split["test_from"])
    assert f"train before {cut_valid}; validation from {cut_valid} to before {cut_test}; test from {cut_test}" in md
    assert f"its values run from {_date(split['min'])} to {_date(split['max'])}" in md
    assert "time column `when`: splits the rows by time; not a feature" in md
    assert "label: `y`; features used: numeric `x`; categorical `&lt;img src=x onerror=alert(1)>`" in md
    assert re.search(r"columns of `[^`]*data\.csv` not used \(neither a feature, the label nor the time column\): "
                     r"`id`, `note`\n", md)
    data = json.loads((run / "summary.json").read_text())["data"]  # the same for machines
    assert data["input_columns"]["unused"] == ["id", "note"]
    assert (data["split"]["valid_from"], data["split"]["test_from"]) == (cut_valid, cut_test)
    assert data["features"] == {"numeric": ["x"], "optional_numeric": [], "categorical": [HOSTILE_COLUMN], "id": []}


def test_curves_say_when_the_model_equals_the_linear_baseline(step_zero_run):
    run, figures = step_zero_run
    summary = json.loads((run / "summary.json").read_text())
    assert summary["training"]["best_step"] == 0
    curves = [f for f in figures if any(t in ("ROC curve (test)", "precision / recall (test)", "calibration (test)")
                                        for t in f["titles"])]
    assert len(curves) == 3
    for fig in curves:
        model = next(t for t in fig["legend"] if t.startswith("flowtrain model"))
        assert "= linear model: the same predictions,\nits line lies under the linear model's" in model, fig
    md = (run / "report.md").read_text()
    assert "Its test predictions are the linear model's: in the figures its curves lie under the linear model's" in md


def test_a_validation_curve_flat_within_one_row_of_the_split_says_so_and_is_widened(step_zero_run):
    run, figures = step_zero_run
    summary = json.loads((run / "summary.json").read_text())
    n = summary["rows"]["valid"]
    metric = next(f for f in figures if any(t.startswith("validation auc") for t in f["titles"]))
    assert metric["titles"] == ["validation auc: flat within one validation row"]
    low, high = metric["ylim"][0]
    assert high - low >= 2 / n - 1e-9  # one row either side, not the noise magnified
    assert any(f"less than one row of the validation split (1/{n:,}" in t for t in metric["texts"])
    md = (run / "report.md").read_text()
    assert re.search(rf"The validation auc moved by [0-9.e-]+ over the run, less than one row of the validation split "
                     rf"\(1/{n:,} = ", md)


def test_report_md_and_html_escape_html_and_links_from_the_data(step_zero_run):
    run, _ = step_zero_run
    md = (run / "report.md").read_text()
    html = (run / "report.html").read_text()
    summary = json.loads((run / "summary.json").read_text())
    assert HOSTILE_CLASS in summary["classes"]  # the data really holds it
    for text in (md, html):
        assert "<script" not in text and "<img src=x" not in text and "<b>" not in text
    assert "](javascript:" not in md  # a Markdown link from the data stays text (in HTML it is text anyway)
    assert "<a " not in html
    assert "&lt;script>alert(1)&lt;/script>" in md and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert f"## Slices by {HOSTILE_COLUMN.replace('<', '&lt;')}" in md
    # every row of every Markdown table has as many columns as its header ("a|b" stays one cell)
    tables = re.findall(r"((?:^\|.*\|\n)+)", md, flags=re.M)
    assert len(tables) >= 4
    for table in tables:
        widths = {len(re.split(r"(?<!\\)\|", row)) for row in table.splitlines()}
        assert len(widths) == 1, table
    assert "| a\\|b |" in md


def test_compare_says_when_both_runs_report_step_0_and_gives_paired_run_minus_run_intervals(step_zero_run, tmp_path,
                                                                                          capsys):
    from flowtrain.cli.main import main

    first, _ = step_zero_run
    trained = tmp_path / "trained"  # the same table and split, a model that learns |x|
    assert _batch(["--input", str(first.parent / "data.csv"), "--lr", "0.01", "--steps", "300", "--hidden", "16",
                   "--out", str(trained)]) == 0
    s1, s2 = (json.loads((r / "summary.json").read_text()) for r in (first, trained))
    assert s1["training"]["best_step"] == 0 and s2["training"]["best_step"] > 0
    capsys.readouterr()
    assert main(["compare", str(first), str(trained), "--out", str(tmp_path / "cmp")]) == 0
    printed = capsys.readouterr().out
    assert f"{first.name} reports the model at step 0, which equals its linear part" in printed
    assert "Both runs" not in printed
    paired = json.loads((tmp_path / "cmp" / "compare.json").read_text())["paired"]
    assert paired["reference"] == first.name
    diff = paired["runs"]["trained"]
    assert diff["rows"] == s1["rows"]["test"]
    for metric, m in diff["metrics"].items():  # the point estimate: run minus run on the same rows
        a = s2["evaluation"]["intervals"]["models"]["flowtrain model"][metric]["value"]
        b = s1["evaluation"]["intervals"]["models"]["flowtrain model"][metric]["value"]
        assert m["value"] == pytest.approx(a - b, abs=1e-9)
        assert m["low"] - 1e-12 <= m["value"] <= m["high"] + 1e-12
    assert diff["metrics"]["auc"]["low"] > 0  # |x| learnt: a difference the 40 test rows can tell
    row = next(line for line in printed.splitlines() if line.startswith("| auc |") and "−" not in line
               and line.count("[") == 1)
    assert row == (f"| auc | {diff['metrics']['auc']['value']:.4f} [{diff['metrics']['auc']['low']:.4f}, "
                   f"{diff['metrics']['auc']['high']:.4f}] |")
    # two runs at step 0 (the same run in two directories): compare says so
    twin = tmp_path / "twin"
    shutil.copytree(first, twin)
    assert main(["compare", str(first), str(twin), "--out", str(tmp_path / "cmp2")]) == 0
    printed = capsys.readouterr().out
    assert f"Both runs ({first.name}, twin) report their model at step 0, which equals its linear part" in printed
    assert "| auc | 0.0000 [0.0000, 0.0000] |" in printed


def test_compare_gives_no_paired_interval_for_runs_on_different_test_rows():
    from flowtrain.commands.compare import TestPredictions, paired_differences

    y = np.array([0.0, 1.0, 1.0, 0.0])
    a = TestPredictions("binary", y, np.array([0.2, 0.8, 0.6, 0.4]), "digest-a")
    b = TestPredictions("binary", y, np.array([0.1, 0.9, 0.7, 0.3]), "digest-b")
    out = paired_differences(["a", "b", "c"], [a, b, "FileNotFoundError: no dataset"])
    assert out["runs"]["b"] == {"reason": "b and a have different test rows (4 and 4 rows; not the same rows in the "
                                          "same order)"}
    assert out["runs"]["c"] == {"reason": "c: FileNotFoundError: no dataset"}
    same = paired_differences(["a", "b"], [a, TestPredictions("binary", y, b.p, "digest-a")], b=50)
    assert same["runs"]["b"]["metrics"]["brier"]["value"] == pytest.approx(
        np.mean((b.p - y) ** 2) - np.mean((a.p - y) ** 2))

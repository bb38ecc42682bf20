"""Issue 45, what a user hits next, through the real command line and the real Beam pipelines: the docs' quick
start run as written (feature types inferred, printed once, recorded; the DataFrame call; load().predict with a
dict, keep_columns, predict_proba), absent optional columns at predict, exit status 3 when nothing is predicted
or dead letters are over the bound, compare pairing runs on the same rows in other folders, a random split that
does not move with its folder, and a job with SIGINT inherited as ignored that still stops on SIGINT."""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

import flowtrain
from tests.customers_data import customers
from tests.procs import stop_group

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "flowtrain.cli"]


def _ignore_sigint() -> None:  # what `flowtrain batch ... &` in a script gets: SIGINT ignored, inherited
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_item11_a_batch_job_with_sigint_inherited_as_ignored_still_stops_on_sigint(tmp_path):
    r = np.random.default_rng(0)
    x = r.normal(size=400)
    pacsv.write_csv(pa.table({"x": x, "y": (x > 0).astype(np.int64)}), tmp_path / "t.csv")
    log = tmp_path / "out.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen([*CLI, "batch", "--input", str(tmp_path / "t.csv"), "--label", "y", "--numeric", "x",
                                 "--steps", "1000000", "--no-progress", "--threads", "1", "--out",
                                 str(tmp_path / "run")], cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=_ignore_sigint)
    try:
        deadline = time.monotonic() + 120
        while "model: step 0" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None and "model: step 0" in log.read_text(), log.read_text()[-3000:]
        proc.send_signal(signal.SIGINT)  # the process itself, as `kill -INT PID` does
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            raise AssertionError("flowtrain batch did not stop within 60 s of SIGINT (inherited as ignored)") from None
        assert proc.returncode != 0
        marker = json.loads((tmp_path / "run" / "run.json").read_text())
        assert marker["status"] == "failed", marker
    finally:
        stop_group(proc, signal.SIGKILL, timeout=10)


# --- the customers table of the docs' quick start ---------------------------------------------------------------
#: Fast training for the tests (the docs' commands run as written, with these appended).
FAST = ["--steps", "30", "--hidden", "16", "--threads", "1", "--no-progress", "--seed", "1"]
FAST_API = {"steps": 30, "hidden": [16], "threads": 1, "no_progress": True, "seed": 1}


def _block(md: str, after: str, lang: str = "") -> str:
    """The first fenced code block of ``md`` after the text ``after``."""
    rest = md.split(after, 1)[1]
    return re.search(rf"```{lang}\n(.*?)```", rest, flags=re.S).group(1)


def _cli(argv: list[str], cwd: Path) -> tuple[int, str, str]:
    """``flowtrain ARGV`` in this process (``flowtrain.cli.main.main``) with ``cwd`` as the working directory:
    (exit status, stdout, stderr)."""
    from flowtrain.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    before = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    finally:
        os.chdir(before)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def quick_start(tmp_path_factory) -> dict:
    """The README's quick start run for real: `flowtrain batch --input customers.csv --label churned --out
    runs/customers` (feature types inferred) in folder A; the same file in another folder B run through the Python
    API without `region`; and the DataFrame call of docs/python-api.md."""
    base = tmp_path_factory.mktemp("quick")
    table = customers()
    for folder in (base / "A", base / "B" / "deep"):
        folder.mkdir(parents=True)
        pacsv.write_csv(table, folder / "customers.csv")
    command = _block((ROOT / "README.md").read_text(), "## Your own table", "bash").strip()
    assert command == "flowtrain batch --input customers.csv --label churned --out runs/customers"
    code, out, err = _cli([*shlex.split(command)[1:], *FAST], base / "A")
    assert code == 0, err[-3000:]
    other = flowtrain.batch(input=[str(base / "B" / "deep" / "customers.csv")], label="churned", exclude=["region"],
                            out=str(base / "B" / "run"), **FAST_API)
    return {"base": base, "out": out, "run": base / "A" / "runs" / "customers", "other": other, "table": table}


def test_item1_the_readme_quick_start_infers_the_types_prints_them_once_and_records_them(quick_start):
    out = quick_start["out"]
    printed = _block((ROOT / "README.md").read_text(), "are inferred from the file's first rows").strip().splitlines()
    assert len(printed) == 5
    for line in printed:  # the README's lines are the real run's, each printed once
        assert out.count(line + "\n") == 1, (line, out[:3000])
    manifest = json.loads((quick_start["run"] / "dataset" / "_manifest.json").read_text())
    spec = manifest["spec"]
    assert (spec["numeric"], spec["optional_numeric"], spec["categorical"], spec["time_column"]) == (
        ["tenure_months", "monthly_spend"], ["support_calls"], ["plan", "region"], "signup")
    assert manifest["inferred"]["id_suggested"] == ["customer_id"] and set(manifest["inferred"]["left_out"]) == {
        "customer_id", "country"}
    summary = json.loads((quick_start["run"] / "summary.json").read_text())
    assert summary["data"]["inferred"] == manifest["inferred"]
    report = (quick_start["run"] / "report.md").read_text()
    assert "feature columns inferred from the first 2,000 rows (no --numeric or --categorical given); left out: " \
           "`customer_id` (text with 2,000 different values" in report


def test_item8_compare_pairs_runs_on_the_same_rows_in_other_folders_with_other_features(quick_start, tmp_path):
    from flowtrain.commands.compare import compare

    result = compare([quick_start["run"], quick_start["base"] / "B" / "run"], tmp_path / "cmp")
    paired = result["paired"]["runs"]["run"]
    rows = json.loads((quick_start["run"] / "summary.json").read_text())["rows"]["test"]
    assert "metrics" in paired and paired["rows"] == rows, paired  # was: "different test rows (N and N rows...)"
    assert "auc" in paired["metrics"]


def test_item2_predict_reads_an_absent_optional_column_as_missing_and_says_so_once(quick_start, tmp_path):
    new = quick_start["table"].slice(0, 50).drop(["support_calls", "region", "churned"])
    pacsv.write_csv(new, tmp_path / "new.csv")
    code, out, err = _cli(["predict", "--model", str(quick_start["run"]), "--input", str(tmp_path / "new.csv"),
                           "--out", str(tmp_path / "p.parquet"), "--id-column", "customer_id"], tmp_path)
    assert code == 0, err  # was: "missing column(s) region, support_calls the model needs", exit 2
    line = (f"predict: support_calls, region absent from {tmp_path / 'new.csv'}: read as missing in its 50 row(s) "
            f"(the model learned with missing values there)")
    assert out.count(line) == 1, out
    summary = json.loads((tmp_path / "p.parquet.metrics.json").read_text())
    assert summary["absent_columns"] == {"region": 50, "support_calls": 50}
    assert summary["counts"] == {"in": 50, "predictions": 50, "dead_letters": 0}
    # a column it cannot do without is still refused, naming it
    pacsv.write_csv(new.drop(["tenure_months"]), tmp_path / "bad.csv")
    code, _, err = _cli(["predict", "--model", str(quick_start["run"]), "--input", str(tmp_path / "bad.csv"),
                         "--out", str(tmp_path / "q.parquet")], tmp_path)
    assert code == 2 and "missing column(s) tenure_months that the model needs" in err, err
    # the same rows in Python: predicted, the absence said once (a warning) and counted
    predictor = flowtrain.load(str(quick_start["run"]))
    with pytest.warns(UserWarning, match="support_calls, region absent from the input: read as missing in its 50"):
        got = predictor.predict(new.to_pandas())
    assert predictor.last_absent == {"region": 50, "support_calls": 50} and got["pred_reason"].isna().all()
    by_id = dict(zip(pq.read_table(tmp_path / "p.parquet").column("customer_id").to_pylist(),
                     pq.read_table(tmp_path / "p.parquet").column("pred_probability_yes").to_pylist()))
    np.testing.assert_allclose(got["pred_probability_yes"], [by_id[c] for c in new.column("customer_id").to_pylist()],
                               atol=1e-6)
    with pytest.raises(flowtrain.BundleError, match="missing column.s. tenure_months, monthly_spend that the model "
                                                    "needs .*the input has plan"):
        predictor.predict([{"plan": "basic"}])


def test_item3_the_dataframe_call_of_the_python_api_docs_runs_as_written(quick_start, tmp_path, monkeypatch):
    snippet = _block((ROOT / "docs" / "python-api.md").read_text(), "# Python API", "python")
    assert "flowtrain.batch(input=df," in snippet
    pacsv.write_csv(quick_start["table"], tmp_path / "customers.csv")
    pacsv.write_csv(quick_start["table"].slice(0, 20), tmp_path / "new.csv")
    monkeypatch.chdir(tmp_path)
    real_batch = flowtrain.batch
    monkeypatch.setattr(flowtrain, "batch", lambda *a, **kw: real_batch(*a, **{**kw, **FAST_API}))  # fast training
    namespace: dict = {}
    exec(compile(snippet, "docs/python-api.md", "exec"), namespace)  # noqa: S102 - the docs' own example, run
    summary, predictor = namespace["summary"], namespace["predictor"]
    assert summary["data"]["features"]["numeric"] == ["tenure_months", "monthly_spend"]
    assert summary["data"]["inferred"]["left_out"]["country"].startswith("constant")
    assert (tmp_path / "runs" / "customers" / "bundle" / "bundle.json").is_file()
    one = predictor.predict({"plan": "basic", "tenure_months": 3, "monthly_spend": 20.5})
    assert isinstance(one, dict) and one["pred_class"] in ("no", "yes") and one["pred_reason"] is None
    kept = predictor.predict(namespace["df"].head(3), keep_columns=True)
    assert list(kept.columns[:9]) == quick_start["table"].column_names and "pred_class" in kept.columns
    proba = predictor.predict_proba(namespace["df"].head(3))
    assert proba.shape == (3, 2) and list(predictor.classes_) == ["no", "yes"]
    np.testing.assert_allclose(proba[:, 1], kept["pred_probability_yes"], atol=1e-12)
    np.testing.assert_allclose(proba.sum(axis=1), 1.0, atol=1e-12)
    assert (tmp_path / "predictions.parquet").is_file()  # the snippet's flowtrain.predict ran too
    with pytest.raises(flowtrain.FlowtrainError, match="input: expected files or globs .* not a numpy.ndarray"):
        real_batch(input=np.zeros((3, 2)), label="y")


def test_item6_nothing_predicted_and_too_many_dead_letters_exit_3(quick_start, tmp_path):
    bad = quick_start["table"].slice(0, 50)
    bad = bad.set_column(bad.schema.get_field_index("monthly_spend"), "monthly_spend",
                         pa.array([f"${v:.2f}" for v in bad.column("monthly_spend").to_pylist()]))
    pacsv.write_csv(bad, tmp_path / "bad.csv")
    code, out, err = _cli(["predict", "--model", str(quick_start["run"]), "--input", str(tmp_path / "bad.csv"),
                           "--out", str(tmp_path / "p.parquet")], tmp_path)
    assert code == 3, (out, err)  # was: exit 0 with "0 predictions"
    assert ("nothing could be predicted: all 50 rows are dead letters (column 'monthly_spend' holds a value that "
            "is not a number (50)); see") in err
    assert (tmp_path / "p.parquet.dead_letters.jsonl").read_text().count("\n") == 50  # the outputs are written
    # batch: more dead letters than --max-dead-letter-fraction: stopped after the ETL, before training
    mixed = pa.concat_tables([quick_start["table"].slice(50, 150).cast(bad.schema), bad])
    pacsv.write_csv(mixed, tmp_path / "mixed.csv")
    code, out, err = _cli(["batch", "--input", "mixed.csv", "--label", "churned", "--numeric",
                           "tenure_months,monthly_spend", "--categorical", "plan", "--out", "run",
                           "--max-dead-letter-fraction", "0.2", *FAST], tmp_path)
    assert code == 3, (out[-2000:], err)
    assert "50 of 200 rows (25.0%) are dead letters, more than --max-dead-letter-fraction 0.2" in err
    assert not (tmp_path / "run" / "model.pt").exists()
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "failed"


def test_item9_a_random_split_does_not_move_with_the_folder(tmp_path):
    from connectors.dataset_spec import FeatureSpec
    from flowtrain.local.runners import pipeline_options
    from pipelines.tabular.pipeline import run_tabular_etl

    table = customers(600, seed=2)
    spec = FeatureSpec(label="churned", task="classification", numeric=["tenure_months"], categorical=["plan"])
    tests = []
    for folder in (tmp_path / "here", tmp_path / "moved" / "elsewhere"):
        folder.mkdir(parents=True)
        pacsv.write_csv(table, folder / "customers.csv")
        run_tabular_etl([str(folder / "customers.csv")], spec, dataset_path=str(folder / "ds"),
                        dead_letters_path=None, options=pipeline_options("batch"))
        manifest = json.loads((folder / "ds" / "_manifest.json").read_text())
        sources = pa.concat_tables([pq.read_table(folder / "ds" / s["file"]) for s in manifest["splits"]["test"]])
        tests.append(sorted(s.rsplit(":", 1)[1] for s in sources.column("source").to_pylist()))
    assert len(tests[0]) > 30 and tests[0] == tests[1]  # the same rows in the test split (was: other rows)


def test_item7_class_weight_balanced_trains_the_weighted_loss_and_reports_weighted_metrics(quick_start, tmp_path):
    plain = json.loads((quick_start["run"] / "summary.json").read_text())
    weighted = flowtrain.batch(input=[str(quick_start["base"] / "A" / "customers.csv")], label="churned",
                               class_weight="balanced", out=str(tmp_path / "run"), **FAST_API)
    model = weighted["test"]["model"]
    assert {"weighted_log_loss", "weighted_accuracy"} <= set(model) and "weighted_accuracy" not in plain["test"]["model"]
    # the same features and split as the unweighted run, the minority class (churned: yes) now counts as much as
    # the other: more of the rows are predicted to churn
    counts = json.loads((tmp_path / "run" / "dataset" / "_manifest.json").read_text())["stats"]["class_counts"]
    assert counts[1] < counts[0] and weighted["rows"] == plain["rows"]
    rows = quick_start["table"].to_pandas()
    share = {name: (flowtrain.load(str(run)).predict(rows)["pred_class"] == "yes").mean()
             for name, run in (("plain", quick_start["run"]), ("weighted", tmp_path / "run"))}
    assert share["weighted"] > share["plain"] + 0.05, share
    valid = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("weighted_log_loss" in r for r in valid)
    assert json.loads((tmp_path / "run" / "config.json").read_text())["class_weight"] == "balanced"

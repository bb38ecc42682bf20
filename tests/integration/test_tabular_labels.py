"""`flowtrain batch` on any table (issue #10): labels of any type, K classes, time columns, small data.

Real Beam ETLs (FnApiRunner) and real training; the data-parallel and pipeline runs go through
the real worker entry point (torch.distributed, gloo).
"""
from __future__ import annotations

import datetime as dt
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from connectors.dataset_spec import FeatureSpec
from flowtrain.local.runners import pipeline_options
from flowtrain.train import checkpoint
from pipelines.tabular.labels import encode_labels, label_keys, sort_classes
from pipelines.tabular.pipeline import run_tabular_etl
from pipelines.tabular.preflight import SplitError
from pipelines.tabular.schema import SchemaError
from pipelines.tabular.times import format_time, time_cutoff, time_seconds

pytestmark = pytest.mark.timeout(300)

N = 400
START = dt.date(2012, 1, 1)


def _table(n: int = N, seed: int = 0) -> dict[str, list]:
    """Labels of every type, learnable from x1, x2 and c; a date per row (one a day from 2012-01-01)."""
    rng = np.random.default_rng(seed)
    x1, x2 = rng.normal(size=n), rng.normal(size=n)
    c = rng.choice(["a", "b", "c"], size=n)
    score = x1 + 0.5 * x2 + (c == "a")
    species = np.where(score < -0.4, "adelie", np.where(score < 0.9, "chinstrap", "gentoo"))
    sex = np.where(x1 + 0.3 * rng.normal(size=n) > 0, "male", "female")
    grade = 1 + (x1 > 0).astype(int) + (x2 > 0).astype(int)
    dates = [START + dt.timedelta(days=i) for i in range(n)]
    grade[-5:] = 4  # a class that only the test period has
    return {"x1": x1.round(5).tolist(), "x2": x2.round(5).tolist(), "c": c.tolist(), "species": species.tolist(),
            "sex": sex.tolist(), "flag": (x2 > 0).tolist(), "grade": grade.tolist(),
            "date": [d.strftime("%Y/%m/%d") for d in dates],
            "y": (3 * x1 - 2 * x2 + 1.5 * (c == "b") + 0.3 * rng.normal(size=n)).round(5).tolist()}


@pytest.fixture(scope="module")
def table_csv(tmp_path_factory) -> tuple[str, dict]:
    data = _table()
    path = tmp_path_factory.mktemp("tab") / "table.csv"
    cols = list(data)
    lines = [",".join(cols)]
    for i in range(N):
        row = [str(data[k][i]).lower() if k == "flag" else str(data[k][i]) for k in cols]
        if i == 7:
            row[cols.index("species")] = "NA"  # a missing label: a dead letter
        lines.append(",".join(row))
    path.write_text("\n".join(lines) + "\n")
    return str(path), data


def _etl(path: str, out, **spec) -> dict:
    spec = FeatureSpec(**{"numeric": ["x1", "x2"], "categorical": ["c"], "task": None, **spec})
    return run_tabular_etl([path], spec, dataset_path=str(out / "ds"), dead_letters_path=str(out / "dead.jsonl"),
                           options=pipeline_options("batch"))


def _targets(ds: str) -> dict[int, float]:
    """line -> featurized label of every row of every split."""
    manifest = json.loads(open(f"{ds}/_manifest.json").read())
    table = pa.concat_tables([pq.read_table(f"{ds}/{s['file']}", columns=["label", "source"])
                              for split in manifest["splits"].values() for s in split])
    return {int(s.rsplit(":", 1)[1]): y for s, y in zip(table["source"].to_pylist(), table["label"].to_pylist())}


def test_label_keys_of_every_type_are_one_vocabulary():
    assert label_keys(pa.array(["male", " female", None, ""])).to_pylist() == ["male", "female", None, None]
    assert label_keys(pa.array([True, False, None])).to_pylist() == ["true", "false", None]
    assert label_keys(pa.array(["True", "FALSE"])).to_pylist() == ["true", "false"]
    assert label_keys(pa.array([1, 2, 10])).to_pylist() == ["1", "2", "10"]
    assert label_keys(pa.array([1.0, 2.5, float("nan")])).to_pylist() == ["1", "2.5", None]
    assert label_keys(pa.array(["1", "1.0", " 2 "])).to_pylist() == ["1", "1", "2"]
    assert sort_classes(["10", "2", "1"]) == ["1", "2", "10"]
    spec = FeatureSpec(label="y", task="classification", numeric=["x"])
    targets, known = encode_labels(pa.array(["b", "a", "z", None]), spec, {"classes": ["a", "b"]})
    assert targets[:2].tolist() == [1.0, 0.0] and known.tolist() == [True, True, False, False]


def test_string_binary_label_with_a_slash_date_time_split(table_csv, tmp_path, capsys):
    path, data = table_csv
    m = _etl(path, tmp_path, label="sex", time_column="date", valid_from="2012-10-01", test_from="2012-12-01")
    assert m["spec"]["task"] == "classification"  # inferred: text
    assert m["stats"]["classes"] == ["female", "male"]
    # YYYY/MM/DD read as dates, ISO cutoffs read the same way: 274 days of 2012 before October ...
    assert m["rows"] == {"train": 274, "valid": 61, "test": N - 335}
    assert m["split"]["time_column"] == "date" and format_time(m["split"]["min"]) == "2012-01-01T00:00:00Z"
    targets = _targets(str(tmp_path / "ds"))
    assert len(targets) == N
    assert all(targets[i + 2] == (1.0 if data["sex"][i] == "male" else 0.0) for i in range(N))


def test_integer_label_inferred_as_classes_and_an_unseen_class_is_a_dead_letter(table_csv, tmp_path):
    path, data = table_csv
    m = _etl(path, tmp_path, label="grade", time_column="date", valid_from="2012-10-01", test_from="2012-12-01")
    assert m["spec"]["task"] == "classification"  # integers with few values
    assert m["stats"]["classes"] == ["1", "2", "3"]
    reason = "label 'grade' holds a class not seen in the training split"
    assert m["counts"]["dead_letters_by_reason"] == {reason: 5}
    assert m["counts"]["in"] == N == m["counts"]["out"] + m["counts"]["dead_letters"]
    dead = [json.loads(line) for line in open(tmp_path / "dead.jsonl")]
    assert sorted(d["source"] for d in dead) == sorted(f"{path}:{N + 1 - i}" for i in range(5))
    assert {d["payload"]["json"]["grade"] for d in dead} == {"4"}
    targets = _targets(str(tmp_path / "ds"))
    assert all(targets[i + 2] == data["grade"][i] - 1 for i in range(N - 5))


def test_boolean_label(table_csv, tmp_path):
    path, data = table_csv
    m = _etl(path, tmp_path, label="flag")
    assert m["spec"]["task"] == "classification" and m["stats"]["classes"] == ["false", "true"]
    targets = _targets(str(tmp_path / "ds"))
    assert all(targets[i + 2] == float(data["flag"][i]) for i in range(N))


def test_time_formats_and_cutoffs_read_alike():
    day = dt.datetime(2013, 3, 4, tzinfo=dt.timezone.utc).timestamp()
    hour = day + 5 * 3600
    seconds = time_seconds(pa.array(["2013-03-04", "2013/03/04", "2013-03-04T05:00:00Z", "2013-03-04 05:00:00",
                                       "2013-03-04T07:00:00.250+02:00", str(int(hour)), "March 4", None]))
    assert seconds[:6].tolist() == [day, day, hour, hour, hour, hour] and np.isnan(seconds[6:]).all()
    assert time_seconds(pa.array([hour * 1000]), "epoch_ms").tolist() == [hour]
    assert time_seconds(pa.array([dt.date(2013, 3, 4)])).tolist() == [day]
    assert time_seconds(pa.array(["04.03.2013"]), "%d.%m.%Y").tolist() == [day]
    assert time_cutoff("04.03.2013", "%d.%m.%Y") == time_cutoff("2013/03/04") == time_cutoff("2013-03-04") == day
    with pytest.raises(ValueError, match="not a time"):
        time_cutoff("next tuesday")


def test_an_empty_split_names_the_column_its_range_and_the_cutoffs(table_csv, tmp_path):
    path, _ = table_csv
    with pytest.raises(SplitError) as err:
        _etl(path, tmp_path, label="sex", time_column="date", valid_from="2014-07-01", test_from="2015-01-01")
    text = str(err.value)
    assert "valid and test splits are empty" in text and "time column 'date'" in text
    assert "2012-01-01T00:00:00Z" in text and "2013-02-03T00:00:00Z" in text  # the column's min and max
    assert "2014-07-01T00:00:00Z (--valid-from 2014-07-01)" in text and "2015-01-01T00:00:00Z" in text
    assert not list(tmp_path.glob("ds.tmp-*")) and not list(tmp_path.glob("beam-temp-*"))


@pytest.fixture(scope="module")
def species_run(table_csv, tmp_path_factory) -> dict:
    """The 3-class string label end to end with every training choice left to flowtrain."""
    from flowtrain import batch as run_batch

    path, _ = table_csv
    out = tmp_path_factory.mktemp("species") / "run"
    summary = run_batch(**{"input": [path], "label": "species", "numeric": "x1,x2", "categorical": "c",
                           "out": str(out), "no_progress": True, "threads": 1})
    return {"summary": summary, "out": out}


def test_three_class_string_label_end_to_end_beats_its_baselines(species_run):
    summary, out = species_run["summary"], species_run["out"]
    assert summary["kind"] == "multiclass" and summary["classes"] == ["adelie", "chinstrap", "gentoo"]
    assert summary["counts"]["dead_letters_by_reason"] == {"label 'species' is missing": 1}
    test = summary["test"]
    majority, linear, model = test["baselines"]["majority class"], test["baselines"]["linear model"], test["model"]
    for metrics in (model, majority, linear):
        assert {"accuracy", "macro_f1", "log_loss", "per_class", "confusion"} <= set(metrics)
    # a small table trains enough steps (the plan is chosen from it) to beat the majority class clearly
    assert summary["training"]["plan"]["steps"] >= 800 and summary["training"]["plan"]["batch_size"] == 32
    assert model["accuracy"] >= majority["accuracy"] + 0.3, test
    assert model["accuracy"] >= linear["accuracy"] - 0.05, test
    assert linear["accuracy"] >= majority["accuracy"] + 0.3 and summary["linear"]["grad_norm"] < 1e-3
    assert summary["select_by"] == "accuracy"
    for name in ("confusion.png", "report.md", "metric.png", "linear.pt", "training.json"):
        assert (out / name).exists(), name
    report = (out / "report.md").read_text()
    # the test table with 95% intervals, and the per-class table
    assert "| model | test accuracy | test macro f1 | test log loss |" in report and "| chinstrap |" in report


@pytest.mark.timeout(400)
def test_k_class_model_with_workers_and_stages_equals_one_process(species_run, tmp_path):
    from flowtrain import batch as run_batch

    dataset = str(species_run["out"] / "dataset")
    common = {"dataset": dataset, "no_progress": True, "dropout": 0.0, "steps": 20, "batch_size": 64,
              "eval_every": 10, "hidden": "16,8"}
    runs = {"one": {}, "workers": {"workers": 2}, "stages": {"stages": 2, "microbatches": 2}}
    states = {}
    for name, extra in runs.items():
        summary = run_batch(**{**common, **extra, "out": str(tmp_path / name)})
        assert summary["training"]["steps"] == 20
        state = torch.load(checkpoint.latest(tmp_path / name / "checkpoints"), weights_only=True)
        assert state["step"] == 20
        states[name] = state["model"]
    for name in ("workers", "stages"):
        diff = max(float((states[name][k] - states["one"][k]).abs().max()) for k in states["one"])
        assert diff <= 1e-5, (name, diff)
    assert states["one"]["7.weight"].shape[-1] == 3  # the heads (the default recipe's ensemble's members): K logits


def test_small_regression_table_from_json_lines_beats_the_mean(tmp_path):
    from flowtrain import batch as run_batch

    data = _table(300, seed=1)
    rows = [{"x1": data["x1"][i], "x2": data["x2"][i], "c": data["c"][i], "y": data["y"][i]} for i in range(300)]
    rows[3]["y"] = None
    path = tmp_path / "table.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = run_batch(**{"input": [str(path)], "label": "y", "numeric": "x1,x2", "categorical": "c",
                           "out": str(tmp_path / "run"), "no_progress": True, "threads": 1})
    assert summary["task"] == "regression" and summary["select_by"] == "rmse"
    test = summary["test"]
    assert {"rmse", "mae", "r2"} <= set(test["model"])
    assert test["model"]["rmse"] < 0.3 * test["baselines"]["training mean"]["rmse"], test
    assert test["model"]["r2"] > 0.9


@pytest.mark.timeout(240)
def test_positive_class_chooses_and_names_the_positive_class(table_csv, tmp_path, capsys):
    """--positive-class: a two-class label's positive class is the user's, listed second in the manifest's
    classes (target 1), recorded, printed once, in summary.json and the report; the default is the later in
    sorted order, said so. A value that is no class, or a label with three classes, is a one-line error."""
    from flowtrain import batch as run_batch
    from flowtrain.errors import FlowtrainError

    path, data = table_csv
    m = _etl(path, tmp_path / "chosen", label="sex", positive_class="female")
    assert m["stats"]["classes"] == ["male", "female"] and m["stats"]["positive_class"] == "female"
    assert m["spec"]["positive_class"] == "female" and m["spec"]["task"] == "classification"
    targets = _targets(str(tmp_path / "chosen" / "ds"))
    assert all(targets[i + 2] == (1.0 if data["sex"][i] == "female" else 0.0) for i in range(N))
    default = _etl(path, tmp_path / "default", label="sex")
    assert default["stats"]["classes"] == ["female", "male"] and default["stats"]["positive_class"] == "male"
    assert "positive_class" not in default["spec"]  # unset: the manifest's spec as before
    with pytest.raises(SchemaError, match="--positive-class 'other' is not a class of label 'sex' in the training "
                                            "split; its classes are 'female', 'male'"):
        _etl(path, tmp_path / "bad", label="sex", positive_class="other")
    with pytest.raises(SchemaError, match="--positive-class is for a label with two classes; label 'species' has 3"):
        _etl(path, tmp_path / "three", label="species", positive_class="gentoo")
    with pytest.raises(FlowtrainError, match="not both"):
        run_batch(input=[path], label="flag", numeric="x1", positive_class="true", positive_above=0.5,
                  out=str(tmp_path / "both"))

    capsys.readouterr()
    common = {"dataset": str(tmp_path / "chosen" / "ds"), "no_progress": True, "steps": 5, "threads": 1}
    summary = run_batch(**common, out=str(tmp_path / "run"))
    printed = capsys.readouterr().out
    assert summary["positive_class"] == "female" and summary["classes"] == ["male", "female"]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["positive_class"] == "female"
    assert "Positive class: female" in (tmp_path / "run" / "report.md").read_text()
    assert [line for line in printed.splitlines() if line.startswith("classes:")] == [
        "classes: 'female' is the positive class, 'male' the negative (--positive-class)"]
    run_batch(**{**common, "dataset": str(tmp_path / "default" / "ds")}, out=str(tmp_path / "run-default"))
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("classes:")] == [
        "classes: 'male' is the positive class, 'female' the negative (the later of the two in sorted order; "
        "--positive-class chooses)"]


def test_batch_dead_letters_are_counted_by_kind_and_keep_their_message(tmp_path):
    """Malformed JSON lines at different positions are one kind in the manifest's (and report's) counts,
    not one reason per error position; the dead letters file keeps each whole message."""
    rows = [json.dumps({"x1": float(i), "x2": 1.0, "c": "abc"[i % 3], "y": float(i % 2)}) for i in range(60)]
    rows[5], rows[9], rows[13] = '{"x1": 1 "x2": 2}', '{"x1": 1, "x2": 2,, "c": "a"}', '{"x1": 1, "y" 2}'
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(rows) + "\n")
    m = _etl(str(path), tmp_path, label="y", task="regression")
    assert m["counts"]["dead_letters_by_reason"] == {"malformed JSON line": 3}
    dead = [json.loads(line)["reason"] for line in open(tmp_path / "dead.jsonl")]
    assert len(set(dead)) == 3 and all(r.startswith("malformed JSON line: JSONDecodeError: Expecting") for r in dead)

"""flowtrain predict, the model bundle, flowtrain.load, the Python API against the CLI."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
import torch

import flowtrain

pytestmark = pytest.mark.timeout(400)
ROOT = Path(__file__).resolve().parents[2]
OPTIONS = {"label": "y", "numeric": ["x1", "x2"], "categorical": ["c"], "task": "classification", "steps": 40,
           "no_progress": True, "threads": 1, "hidden": [16, 8], "seed": 3}


def _write(path: Path, n: int, seed: int, *, label: bool = True, unseen_every: int = 0, bad_line: int = 0) -> None:
    r = np.random.default_rng(seed)
    lines = ["id,x1,x2,c" + (",y" if label else "")]
    for i in range(n):
        x1, x2 = r.normal(), r.normal()
        c = "zz" if unseen_every and i % unseen_every == 0 else "abcd"[r.integers(4)]
        y = int(x1 + 0.5 * x2 + (c == "a") + r.normal() * 0.5 > 0.3)
        x1_text = "abc" if bad_line and i == bad_line else f"{x1:.4f}"
        lines.append(f"{i},{x1_text},{x2:.4f},{c}" + (f",{y}" if label else ""))
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("predict")
    _write(base / "train.csv", 2000, 0)
    _write(base / "new.csv", 300, 1, unseen_every=3, bad_line=7)
    _write(base / "unlabelled.csv", 50, 2, label=False, unseen_every=5)
    summary = flowtrain.batch(input=[str(base / "train.csv")], out=str(base / "run"), **OPTIONS)
    return {"base": base, "run": base / "run", "summary": summary}


def _in_process(run_dir: Path, rows: pa.Table) -> np.ndarray:
    """The trained model (model.pt, the run's dataset statistics, the ETL's feature code) on ``rows``."""
    from connectors.fields import build
    from connectors.files import SOURCE_FILE, SOURCE_ROW
    from flowtrain.commands.batch.options import BatchJob
    from flowtrain.train.loader import TabularDataset
    from flowtrain.train.models import build_run_model
    from flowtrain.train.plan import train_config
    from pipelines.tabular.features import feature_arrays

    data = TabularDataset(run_dir / "dataset")
    job = build(BatchJob, json.loads((run_dir / "config.json").read_text()))
    model = build_run_model(job.model, data, train_config(job)).eval()
    model.load_state_dict(torch.load(run_dir / "model.pt", weights_only=True))
    rows = rows.append_column(SOURCE_FILE, pa.array(["x"] * rows.num_rows)).append_column(
        SOURCE_ROW, pa.array(np.arange(rows.num_rows)))
    arrays, names = feature_arrays(rows.to_batches()[0], data.spec, data.stats)
    feats = dict(zip(names, arrays))
    x_num = torch.tensor(np.stack([feats[f"num__{c}"].to_numpy() for c in data.spec.all_numeric], 1))
    x_cat = torch.tensor(np.stack([feats[f"cat__{c}"].to_numpy() for c in data.spec.categorical], 1)).long()
    with torch.no_grad():
        return torch.sigmoid(model(x_num, x_cat).double()).numpy()


def _good_rows(path: Path) -> pa.Table:
    table = pacsv.read_csv(path, convert_options=pacsv.ConvertOptions(column_types={"x1": pa.string()}))
    keep = [i for i, v in enumerate(table.column("x1").to_pylist()) if v != "abc"]
    table = table.take(keep)
    return table.set_column(1, "x1", pc.cast(table.column("x1"), pa.float64()))


def test_predict_on_held_out_file_equals_the_in_process_model(run, tmp_path):
    out = tmp_path / "pred.parquet"
    summary = flowtrain.predict(model=str(run["run"]), input=[str(run["base"] / "new.csv")], out=str(out),
                                id_column="id")
    counts = summary["counts"]
    assert counts == {"in": 300, "predictions": 299, "dead_letters": 1}
    dead = [json.loads(line) for line in open(summary["dead_letters"])]
    assert len(dead) == 1 and dead[0]["source"] == f"{run['base'] / 'new.csv'}:9"  # line 9: header + rows 0..7
    assert "x1" in dead[0]["reason"]
    pred = pq.read_table(out).sort_by("id")
    assert pred.column_names == ["pred_source", "id", "y", "pred_probability_1", "pred_class", "pred_model_version"]
    rows = _good_rows(run["base"] / "new.csv").sort_by("id")
    expected = _in_process(run["run"], rows.select(["x1", "x2", "c"]))
    assert pred.column("id").to_pylist() == rows.column("id").to_pylist()
    np.testing.assert_allclose(pred.column("pred_probability_1").to_numpy(), expected, atol=1e-6, rtol=0)
    # unseen categories ("zz": every third row) were predicted (out-of-vocabulary code), not dropped
    assert sum(1 for c in rows.column("c").to_pylist() if c == "zz") == 100
    assert "auc" in summary["metrics"] and summary["metrics"]["rows"] == 299
    assert json.loads((tmp_path / "pred.parquet.metrics.json").read_text())["metrics"]["auc"] == \
        pytest.approx(summary["metrics"]["auc"])


def test_unlabelled_rows_are_predicted_as_csv(run, tmp_path):
    out = tmp_path / "pred.csv"
    proc = subprocess.run([sys.executable, "-m", "flowtrain.cli", "predict", "--model", str(run["run"] / "bundle"),
                           "--input", str(run["base"] / "unlabelled.csv"), "--out", str(out), "--keep-columns",
                           "id,c"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "50 rows in, 50 predictions, 0 dead letters" in proc.stdout
    pred = pacsv.read_csv(out)
    assert pred.num_rows == 50 and "y" not in pred.column_names and "metrics" not in json.loads(
        (tmp_path / "pred.csv.metrics.json").read_text())
    assert {str(v) for v in pred.column("pred_class").to_pylist()} <= {"0", "1"} and "zz" in pred.column("c").to_pylist()


def test_bundle_in_a_fresh_process_without_dataset_or_run_equals_predict(run, tmp_path):
    out = tmp_path / "pred.parquet"
    flowtrain.predict(model=str(run["run"]), input=str(run["base"] / "new.csv"), out=str(out), id_column="id")
    copy = tmp_path / "run-copy"
    shutil.copytree(run["run"], copy)
    exported = flowtrain.export(str(copy), str(tmp_path / "exported"))
    shutil.rmtree(copy)  # the dataset and the run directory are gone: the bundle alone predicts
    script = (
        "import sys, pyarrow.csv as c, pyarrow.parquet as pq, flowtrain\n"
        "t = c.read_csv(sys.argv[2], convert_options=c.ConvertOptions(column_types={'x1': 'string'}))\n"
        "p = flowtrain.load(sys.argv[1])\n"
        "out = p.predict(t, keep=['id'])\n"
        "assert out.num_rows == t.num_rows and out.column('id').equals(t.column('id'))\n"
        "pq.write_table(out.filter(out.column('pred_reason').is_null()), sys.argv[3])\n"
        "print(len(p.last_dead_letters), p.last_dead_letters[0].reason)\n")
    proc = subprocess.run([sys.executable, "-c", script, str(exported), str(run["base"] / "new.csv"),
                           str(tmp_path / "loaded.parquet")], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("1 numeric feature 'x1'")
    a, b = pq.read_table(out).sort_by("id"), pq.read_table(tmp_path / "loaded.parquet").sort_by("id")
    assert a.column("id").to_pylist() == b.column("id").to_pylist()
    np.testing.assert_allclose(a.column("pred_probability_1").to_numpy(), b.column("pred_probability_1").to_numpy(),
                               atol=1e-6, rtol=0)
    assert a.column("pred_class").to_pylist() == b.column("pred_class").to_pylist()
    # the same weights: the same checksum in the version (the run's name is the copy's)
    digest = [t.column("pred_model_version").to_pylist()[0].split("@")[1] for t in (a, b)]
    assert digest[0] == digest[1]
    # a pandas DataFrame of the same rows gives the same predictions
    frame = pacsv.read_csv(run["base"] / "unlabelled.csv").to_pandas()
    loaded = flowtrain.load(str(exported))
    np.testing.assert_allclose(loaded.predict(frame)["pred_probability_1"].to_numpy(),
                               loaded.predict(pa.Table.from_pandas(frame)).column("pred_probability_1").to_numpy())


def test_bad_bundles_and_missing_columns_are_one_line_errors(run, tmp_path):
    bundle = tmp_path / "bundle"
    shutil.copytree(run["run"] / "bundle", bundle)
    weights = bundle / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(flowtrain.BundleError, match="weights.safetensors: modified"):
        flowtrain.load(str(bundle))
    proc = subprocess.run([sys.executable, "-m", "flowtrain.cli", "predict", "--model", str(bundle), "--input",
                           str(run["base"] / "new.csv"), "--out", str(tmp_path / "p.parquet")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "weights.safetensors: modified" in proc.stderr
    shutil.rmtree(bundle)
    shutil.copytree(run["run"] / "bundle", bundle)
    (bundle / "features.json").unlink()
    with pytest.raises(flowtrain.BundleError, match="features.json: missing"):
        flowtrain.load(str(bundle))
    shutil.rmtree(bundle)
    shutil.copytree(run["run"] / "bundle", bundle)
    manifest = json.loads((bundle / "bundle.json").read_text())
    (bundle / "bundle.json").write_text(json.dumps({**manifest, "flowtrain_version": "99.0"}))
    with pytest.raises(flowtrain.BundleError, match="newer than this flowtrain"):
        flowtrain.load(str(bundle))
    (tmp_path / "nox.csv").write_text("id,x2,c\n1,0.5,a\n")
    with pytest.raises(flowtrain.FlowtrainError, match="missing column\\(s\\) x1"):
        flowtrain.predict(model=str(run["run"]), input=[str(tmp_path / "nox.csv")], out=str(tmp_path / "q.parquet"))
    with pytest.raises(flowtrain.FlowtrainError, match="missing column\\(s\\) x1"):
        flowtrain.load(str(run["run"])).predict([{"x2": 1.0, "c": "a"}])


def test_api_run_equals_cli_run(run, tmp_path):
    """The CLI with the same options (from the API run's config.json) gives the same test metric."""
    config = json.loads((run["run"] / "config.json").read_text())
    assert config["steps"] == 40 and config["hidden"] == [16, 8]
    cli_out = tmp_path / "cli"
    proc = subprocess.run([sys.executable, "-m", "flowtrain.cli", "batch", "--config", str(run["run"] / "config.json"),
                           "--out", str(cli_out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cli = json.loads((cli_out / "summary.json").read_text())
    api = run["summary"]
    assert cli["training"]["steps"] == api["training"]["steps"] == 40
    assert abs(cli["test"]["model"]["auc"] - api["test"]["model"]["auc"]) <= 1e-6
    assert abs(cli["test"]["model"]["log_loss"] - api["test"]["model"]["log_loss"]) <= 1e-6
    assert abs(cli["test"]["baselines"]["linear model"]["auc"] - api["test"]["baselines"]["linear model"]["auc"]) \
        <= 1e-6


@pytest.mark.parametrize("task", ["multiclass", "regression"])
def test_k_classes_and_regression_predict_in_label_terms(task, tmp_path):
    r = np.random.default_rng(7)
    lines = ["x1,x2,c,k,v"]
    for _ in range(900):
        x1, x2, c = r.normal(), r.normal(), "abc"[r.integers(3)]
        k = ["lo", "mid", "hi"][int(np.digitize(x1 + 0.3 * x2, [-0.5, 0.5]))]
        lines.append(f"{x1:.3f},{x2:.3f},{c},{k},{3 * x1 - x2 + r.normal() * 0.1 + 100:.3f}")
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n")
    label = "k" if task == "multiclass" else "v"
    flowtrain.batch(input=[str(tmp_path / "t.csv")], label=label, numeric=["x1", "x2"], categorical=["c"],
                    task="classification" if task == "multiclass" else "regression", steps=30,
                    out=str(tmp_path / "run"), no_progress=True, threads=1)
    summary = flowtrain.predict(model=str(tmp_path / "run"), input=str(tmp_path / "t.csv"),
                                out=str(tmp_path / "p.parquet"))
    pred = pq.read_table(tmp_path / "p.parquet")
    order = np.argsort([int(s.rsplit(":", 1)[1]) for s in pred.column("pred_source").to_pylist()])
    loaded = flowtrain.load(str(tmp_path / "run")).predict(pacsv.read_csv(tmp_path / "t.csv"))
    if task == "multiclass":
        probs = [f"pred_probability_{c}" for c in ("hi", "lo", "mid")]  # the classes in the training split's order
        assert pred.column_names == ["pred_source", "k", *probs, "pred_class", "pred_model_version"]
        p = np.stack([pred.column(c).to_numpy()[order] for c in probs], 1)
        np.testing.assert_allclose(p.sum(1), 1.0, atol=1e-5)
        np.testing.assert_allclose(p, np.stack([loaded.column(c).to_numpy() for c in probs], 1), atol=1e-6, rtol=0)
        assert summary["metrics"]["accuracy"] > 0.8
    else:
        got = pred.column("pred_value").to_numpy()[order]
        np.testing.assert_allclose(got, loaded.column("pred_value").to_numpy(), atol=1e-6, rtol=0)
        assert abs(got.mean() - 100) < 1.0 and summary["metrics"]["r2"] > 0.9  # in the label's units


def test_export_with_a_torch_export_program_equals_the_bundle_model(run, tmp_path):
    from flowtrain.train.bundle import build_module, read_bundle

    out = Path(flowtrain.export(str(run["run"]), str(tmp_path / "b"), torch_export=True))
    bundle = read_bundle(out)  # model.pt2 is checksummed like the rest
    assert "model.pt2" in bundle.manifest["files"]
    program = torch.export.load(str(out / "model.pt2")).module()
    model = build_module(bundle)
    x_num, x_cat = torch.randn(37, 2), torch.randint(0, 5, (37, 1))
    torch.testing.assert_close(program(x_num, x_cat), model(x_num, x_cat), atol=1e-6, rtol=0)
    data = bytearray((out / "model.pt2").read_bytes())
    data[len(data) // 2] ^= 1
    (out / "model.pt2").write_bytes(bytes(data))
    with pytest.raises(flowtrain.BundleError, match="model.pt2: modified"):
        flowtrain.load(str(out))

"""MLflow tracking (issue 46 item 4) against a real tracking server the test starts (``mlflow server``: SQLite
backend, served artifacts, 127.0.0.1): ``flowtrain batch --mlflow URI`` logs its parameters, per-step metrics,
report and bundle, and registers a pyfunc model whose ``mlflow.pyfunc.load_model(...).predict(df)`` equals
``flowtrain.load(bundle).predict(df)`` to 1e-6."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request

import mlflow  # the dev install has it (pyproject's dev extra): a missing MLflow fails, never skips
import numpy as np
import pandas as pd
import pytest

from tests.procs import stop_group

pytestmark = pytest.mark.timeout(300)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tracking_server(tmp_path_factory):
    """``mlflow server`` on 127.0.0.1 (SQLite, artifacts served from a temporary folder), stopped at the end."""
    base = tmp_path_factory.mktemp("mlflow")
    port = _free_port()
    log = open(base / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
                             f"sqlite:///{base / 'mlflow.db'}", "--artifacts-destination", str(base / "artifacts"),
                             "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, (base / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "mlflow server did not answer /health in 120 s"
            time.sleep(0.5)
        yield uri
    finally:
        stop_group(proc, timeout=30)
        log.close()


def _table(path):
    rng = np.random.default_rng(1)
    n = 400
    a, b = rng.normal(size=(2, n))
    shop = rng.choice(["north", "south", "west"], n)
    label = np.where(a + (shop == "west") > 0.5, "high", np.where(b > 0, "mid", "low"))
    pd.DataFrame({"a": a, "b": b, "shop": shop, "level": label}).to_csv(path, index=False)
    return path


def test_a_batch_run_in_mlflow_predicts_as_flowtrain(tracking_server, tmp_path):
    import flowtrain

    table, run = _table(tmp_path / "t.csv"), tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "flowtrain.cli", "batch", "--no-progress", "--input", str(table),
                           "--label", "level", "--numeric", "a,b", "--categorical", "shop", "--out", str(run),
                           "--steps", "60", "--eval-every", "20", "--mlflow", tracking_server, "--mlflow-experiment",
                           "flowtrain-test", "--mlflow-model", "levels"], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    mlflow.set_tracking_uri(tracking_server)
    client = mlflow.tracking.MlflowClient()
    logged = client.get_run(summary["mlflow_run_id"])
    assert logged.data.params["label"] == "level" and logged.data.params["steps"] == "60"
    assert logged.data.metrics["test_accuracy"] == pytest.approx(summary["test"]["model"]["accuracy"])
    steps = [m.step for m in client.get_metric_history(logged.info.run_id, "valid_accuracy")]
    assert steps == sorted(steps) and steps[0] == 0 and len(steps) >= 3  # per-step: every validation
    assert client.get_metric_history(logged.info.run_id, "train_loss")
    names = {a.path for a in client.list_artifacts(logged.info.run_id)}
    assert {"report.md", "summary.json", "bundle", "figures"} <= names
    assert "bundle/bundle.json" in {a.path for a in client.list_artifacts(logged.info.run_id, "bundle")}
    version = client.get_registered_model("levels").latest_versions[0]
    assert version.run_id == logged.info.run_id

    model = mlflow.pyfunc.load_model(f"models:/levels/{version.version}")
    assert [c.name for c in model.metadata.get_input_schema().inputs] == ["a", "b", "shop"]
    rows = pd.read_csv(table).drop(columns=["level"])
    rows.loc[3, "shop"] = "east"  # a category the model never saw: predicted alike (out of vocabulary)
    ours = flowtrain.load(str(run / "bundle")).predict(rows)
    theirs = model.predict(rows)
    assert list(theirs.columns) == list(ours.columns)
    probabilities = [c for c in ours.columns if c.startswith("pred_probability")]
    assert len(probabilities) == 3
    assert np.abs(theirs[probabilities].to_numpy() - ours[probabilities].to_numpy()).max() <= 1e-6
    assert theirs["pred_class"].tolist() == ours["pred_class"].tolist()

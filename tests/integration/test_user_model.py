"""--model MODULE:FACTORY: a user's model trained by the engine (data and pipeline parallelism), in the bundle."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import flowtrain

pytestmark = pytest.mark.timeout(600)
ROOT = Path(__file__).resolve().parents[2]
COMMON = {"no_progress": True, "steps": 12, "batch_size": 64, "eval_every": 6, "seed": 1}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    base = tmp_path_factory.mktemp("user-model")
    r = np.random.default_rng(0)
    lines = ["x1,x2,c,y"]
    for _ in range(1200):
        x1, x2, c = r.normal(), r.normal(), "abc"[r.integers(3)]
        lines.append(f"{x1:.4f},{x2:.4f},{c},{int(x1 - x2 + (c == 'b') + r.normal() * 0.3 > 0)}")
    (base / "t.csv").write_text("\n".join(lines) + "\n")
    flowtrain.batch(input=[str(base / "t.csv")], label="y", numeric=["x1", "x2"], categorical=["c"],
                    task="classification", out=str(base / "etl"), job_only=True, no_progress=True)
    return str(base / "etl" / "dataset")


def _run(dataset: str, out: Path, **options) -> tuple[dict, dict]:
    summary = flowtrain.batch(dataset=dataset, out=str(out), **COMMON, **options)
    return summary, torch.load(out / "model.pt", weights_only=True)


def test_user_model_with_two_workers_equals_one_worker(dataset, tmp_path):
    one, w1 = _run(dataset, tmp_path / "one", model="examples.my_model:build")
    two, w2 = _run(dataset, tmp_path / "two", model="examples.my_model:build", workers=2)
    assert set(w1) == set(w2) and any(k.startswith("embeddings.") for k in w1)  # the user's module, not the MLP
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], atol=1e-5, rtol=0)
    assert abs(one["test"]["model"]["auc"] - two["test"]["model"]["auc"]) <= 1e-5
    # the bundle names the factory and predicts with the user's module (its code: only when trusted)
    predictor = flowtrain.load(str(tmp_path / "one"), trust_code=True)
    assert predictor.bundle.model["architecture"] == {"kind": "factory", "factory": "examples.my_model:build"}
    got = predictor.predict([{"x1": 0.1, "x2": -0.3, "c": "b"}, {"x1": 1.0, "x2": 0.0, "c": "new"}])
    assert len(got) == 2 and all(0 <= row["pred_probability_1"] <= 1 for row in got)


def test_pipeline_parallel_user_model_and_a_clear_error_for_a_plain_module(dataset, tmp_path):
    one, w1 = _run(dataset, tmp_path / "one", model="examples.my_model:build_sequential")
    staged, w2 = _run(dataset, tmp_path / "staged", model="examples.my_model:build_sequential", stages=2,
                      microbatches=2)
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], atol=1e-5, rtol=0)
    proc = subprocess.run([sys.executable, "-m", "flowtrain.cli", "batch", "--dataset", dataset, "--out",
                           str(tmp_path / "bad"), "--model", "examples.my_model:build", "--stages", "2",
                           "--no-progress"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--model examples.my_model:build returns a SmallNet" in proc.stderr and "--stages 2" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "flowtrain.cli", "batch", "--dataset", dataset, "--out",
                           str(tmp_path / "bad2"), "--model", "examples.my_model:nothing", "--no-progress"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 2 and "module examples.my_model has no nothing" in proc.stderr, proc.stderr[-2000:]

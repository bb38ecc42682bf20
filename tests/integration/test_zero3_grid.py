"""ZeRO-3 on the grid's data dimension end to end (#31): ``flowtrain batch --workers 2 --stages 2 --shard-states
parameters`` trains on a partial last batch (a replica with empty micro-batches), each replica holds half of its
stage's parameters, the plan says so before step 0, and the bundle (the whole model) predicts.

Equality with one process is ``tests/integration/test_zero_sharding.py``'s grid test (the sharder on 2 x 2
workers, stages and tensor shards); this is the ``fit`` path: GridEngine, evaluation, checkpoints, bundle."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import flowtrain

pytestmark = pytest.mark.timeout(300)


def _cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flowtrain.cli", "batch", "--no-progress", "--threads", "1",
                           "--device", "cpu", "--hidden", "16,8", "--dropout", "0", *args], capture_output=True,
                          text=True, timeout=timeout)


def _input(tmp_path) -> list[str]:
    """``y = 3x + 2[c == a] + noise``, 600 rows split by time: 500 training rows, in batches of 99 five full
    ones and one of 5 rows, 3 + 2 over two replicas: 4 micro-batches of [1, 1, 1, 0] and [1, 1, 0, 0] rows."""
    rows = 600
    rng = np.random.default_rng(0)
    x, c = rng.normal(size=rows), rng.choice(["a", "b", "c"], size=rows)
    y = 3 * x + 2 * (c == "a") + rng.normal(scale=0.1, size=rows)
    csv = tmp_path / "data.csv"
    csv.write_text("t,x,c,y\n" + "".join(f"{i},{x[i]:.6f},{c[i]},{y[i]:.6f}\n" for i in range(rows)))
    return ["--input", str(csv), "--label", "y", "--task", "regression", "--numeric", "x", "--categorical", "c",
            "--time-column", "t", "--valid-from", "500", "--test-from", "550", "--batch-size", "99"]


def test_batch_zero3_with_stages_trains_and_its_bundle_predicts(tmp_path):
    run = tmp_path / "run"
    # the partial last batch: each replica still joins every layer's gathers
    done = _cli(*_input(tmp_path), "--epochs", "1", "--workers", "2", "--stages", "2", "--shard-states", "parameters",
                "--out", str(run))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "(6 steps per epoch of 500 rows)" in done.stdout, done.stdout[-2000:]
    assert "memory plan per rank, --workers 2 --shard-states parameters --stages 2" in done.stdout
    assert done.stdout.index("memory plan per rank") < done.stdout.index("step 0 valid")

    # checkpoints sharded as data parallelism's ZeRO saves them: one DCP file per rank, no whole model
    newest = sorted((run / "checkpoints").glob("ckpt-*.pt"))[-1]
    assert {p.name for p in newest.with_suffix(".dcp").iterdir()} == {".metadata", *(f"__{r}_0.distcp" for r in range(4))}
    assert "model" not in torch.load(newest, weights_only=True)

    summary = json.loads((run / "summary.json").read_text())
    measured = summary["training"]["memory"]["measured"]
    assert len(measured) == 4  # 2 replicas x 2 stages
    weights = torch.load(run / "model.pt", weights_only=True)
    numel = sum(v.numel() for v in weights.values() if v.is_floating_point())
    # each parameter is held by one replica of its stage (plus padding), not by both
    assert numel * 4 <= sum(m["parameters"] for m in measured) <= (numel + 32) * 4

    predictor = flowtrain.load(str(run / "bundle"))
    bundled = predictor.module.state_dict()
    assert weights.keys() == bundled.keys() and all(torch.equal(weights[k], bundled[k]) for k in weights)
    out = predictor.predict([{"t": 600, "x": 1.0, "c": "a"}, {"t": 601, "x": -1.0, "c": "b"}])
    assert [round(r["pred_value"]) for r in out] == [5, -3], out  # y = 3x + 2[c == a]


def _model_at(run, step: int, tmp_path) -> dict:
    """The whole model of a run's checkpoint at ``step``, flat tensors by name (sharded: its DCP files read whole)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = run / "checkpoints" / f"ckpt-{step:09d}.pt"
    if not path.with_suffix(".dcp").exists():
        return {k: v.reshape(-1) for k, v in torch.load(path, weights_only=True)["model"].items()}
    whole = tmp_path / f"{run.name}-{step}-whole.pt"
    dcp_to_torch_save(path.with_suffix(".dcp"), whole)
    return {k[len("model."):]: v.reshape(-1) for k, v in torch.load(whole, weights_only=True).items()
            if k.startswith("model.")}


@pytest.mark.slow
@pytest.mark.timeout(900)  # four runs of flowtrain batch, up to 6 workers on a small machine
def test_batch_zero3_grid_checkpoint_resumes_with_other_workers(tmp_path):
    """2 replicas x 2 stages with ZeRO-3 for 6 steps (checkpoints sharded), resumed to 12 as 1 x 2 (no sharding:
    the shards read whole) and as 3 x 2 (ZeRO-3 over 3: each rank reads its pieces): each ends with the
    uninterrupted 2 x 2 run's parameters."""
    common = ["--decay-steps", "12", "--eval-every", "6", "--stages", "2", "--shard-states", "parameters",
              "--failure-timeout", "180"]  # a loaded small machine: 6 workers may pass 60 s between beats
    full = _cli(*_input(tmp_path), *common, "--steps", "12", "--workers", "2", "--out", str(tmp_path / "full"),
                timeout=400)
    assert full.returncode == 0, full.stderr[-2000:]
    dataset = str(tmp_path / "full" / "dataset")
    first = _cli("--dataset", dataset, "--batch-size", "99", *common, "--steps", "6", "--workers", "2",
                 "--out", str(tmp_path / "part"), timeout=400)
    assert first.returncode == 0, first.stderr[-2000:]
    assert (tmp_path / "part" / "checkpoints" / "ckpt-000000006.dcp").is_dir()
    shutil.copytree(tmp_path / "part", tmp_path / "part3")
    want = _model_at(tmp_path / "full", 12, tmp_path)
    half = _model_at(tmp_path / "part", 6, tmp_path)
    assert max(float((half[k] - want[k]).abs().max()) for k in want) > 1e-4  # steps 7-12 move the parameters
    for workers, run in (("1", "part"), ("3", "part3")):
        again = _cli("--dataset", dataset, "--batch-size", "99", *common, "--steps", "12", "--workers", workers,
                     "--resume", "--out", str(tmp_path / run), timeout=400)
        assert again.returncode == 0, again.stderr[-2000:]
        assert "resumed from ckpt-000000006.pt (step 6)" in again.stdout
        got = _model_at(tmp_path / run, 12, tmp_path)
        assert got.keys() == want.keys() and max(float((got[k] - want[k]).abs().max()) for k in want) <= 1e-5

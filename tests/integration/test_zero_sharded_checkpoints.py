"""Checkpoints of sharded state (issue 31 item 3): each rank writes its own shard with
``torch.distributed.checkpoint`` (DCP), a checkpoint written by N ranks resumes on any other number (DCP
reshards), the bundle's model stays whole, and a layout it cannot be resharded into is one line naming the
file and the fix."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flowtrain.parallel.launch import spawn
from flowtrain.train import checkpoint
from tests.dcp_files import elements_per_file

ROOT = Path(__file__).resolve().parents[2]
ENV = {"PYTHONPATH": str(ROOT)}
pytestmark = pytest.mark.timeout(400)
STEPS, HALF = 12, 6


def _spawn(n: int, job: dict, workdir: Path) -> None:
    spawn(n, "tests.zero_dcp_jobs:run_job", job, failure_timeout_s=120, workdir=workdir, extra_env=ENV,
          threads_per_worker=1)


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in b)


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])  # exact on both (checked)
def test_zero3_sharded_checkpoint_per_rank_files_resume_on_1_and_3_equals_uninterrupted(tmp_path, seed):
    """ZeRO-3 on 2 ranks writes one shard file per rank; resumed on 1 rank (whole) and on 3 (ZeRO-3, resharded)
    each ends with the parameters and Adam state of the uninterrupted run (every step's rows on one rank: the
    same arithmetic on any number of ranks, so equal by construction, not by tolerance luck)."""
    uninterrupted = tmp_path / "whole.pt"
    _spawn(1, {"stage": "parameters", "start": 0, "stop": STEPS, "seed": seed, "out": str(uninterrupted)},
           tmp_path / "u")
    ckpts = tmp_path / "checkpoints"
    _spawn(2, {"stage": "parameters", "start": 0, "stop": HALF, "seed": seed, "save": str(ckpts),
               "out": str(tmp_path / "half.pt")}, tmp_path / "h")
    shards = ckpts / f"ckpt-{HALF:09d}.dcp"
    assert sorted(p.name for p in shards.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # per rank
    side = json.loads((ckpts / f"ckpt-{HALF:09d}.sha256").read_text())
    assert set(side["shards"]) == {".metadata", "__0_0.distcp", "__1_0.distcp"}  # every shard file checksummed
    small = torch.load(ckpts / f"ckpt-{HALF:09d}.pt", weights_only=True)
    assert "model" not in small and small["sharded_state"] == shards.name  # the file holds no whole model
    # each rank's file holds its own half of the parameters (and of the Adam moments), not the whole
    held = elements_per_file(shards, "model.")
    assert set(held) == {"__0_0.distcp", "__1_0.distcp"} and max(held.values()) <= 0.6 * sum(held.values()), held
    moments = elements_per_file(shards, "optim.")
    assert set(moments) == {"__0_0.distcp", "__1_0.distcp"}, moments

    want = torch.load(uninterrupted, weights_only=True)
    for n in (1, 3):
        out = tmp_path / f"resumed{n}.pt"
        _spawn(n, {"stage": "parameters", "start": HALF, "stop": STEPS, "seed": seed, "load": str(ckpts),
                   "out": str(out), "loaded": str(tmp_path / f"loaded{n}.pt")}, tmp_path / f"r{n}")
        got = torch.load(out, weights_only=True)
        assert _max_diff(got["model"], want["model"]) <= 1e-5, n
        for k, s in want["optimizer"]["state"].items():
            mine = got["optimizer"]["state"][k]
            assert float((mine["exp_avg"] - s["exp_avg"]).abs().max()) <= 1e-5, (n, k)
            assert float((mine["exp_avg_sq"] - s["exp_avg_sq"]).abs().max()) <= 1e-5, (n, k)
            assert float(mine["step"]) == float(s["step"]) == STEPS
        assert set(got["optimizer"]["state"]) == set(want["optimizer"]["state"])  # the unused layer has none
    # the state 3 ranks read is bit for bit what 2 ranks wrote (reading reshards, it computes nothing)
    half = torch.load(tmp_path / "half.pt", weights_only=True)
    loaded = torch.load(tmp_path / "loaded3.pt", weights_only=True)
    assert all(torch.equal(loaded["model"][k], v) for k, v in half["model"].items())
    for k, s in half["optimizer"]["state"].items():
        assert torch.equal(loaded["optimizer"]["state"][k]["exp_avg_sq"], s["exp_avg_sq"])


def test_sharded_checkpoint_of_another_architecture_is_an_error_naming_it(tmp_path):
    """A sharded checkpoint read into a model of another shape: one line naming the directory and the fix."""
    from torch import nn

    _spawn(2, {"stage": "parameters", "start": 0, "stop": 2, "save": str(tmp_path / "c"),
               "out": str(tmp_path / "o.pt")}, tmp_path / "w")
    shards = tmp_path / "c" / f"ckpt-{2:09d}.dcp"
    other = nn.Sequential(nn.Linear(6, 5))
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.read_whole(shards, other, ("model",))
    assert str(shards) in str(err.value) and "--overwrite" in str(err.value) and "\n" not in str(err.value)


# --- flowtrain batch: the engine writes and reads sharded checkpoints ---------------------------------------
def _batch(dataset: str, out: Path, *extra: str, ok: bool = True) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "flowtrain.cli", "batch", "--no-progress", "--dataset", dataset, "--out", str(out),
            "--dropout", "0", "--batch-size", "64", "--threads", "1", "--hidden", "16,8", "--eval-every", "4",
            "--decay-steps", "12", "--device", "cpu", "--failure-timeout", "120", *extra]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env={**__import__("os").environ, **ENV})
    assert (done.returncode == 0) == ok, done.stdout[-2000:] + done.stderr[-2000:]
    return done


@pytest.fixture(scope="module")
def dataset(shared_data) -> str:
    return shared_data.regression_dataset(rows=1200)


def test_batch_zero3_checkpoints_per_rank_files_resume_on_one_worker_and_not_into_stages(dataset, tmp_path):
    """flowtrain batch --workers 2 --shard-states parameters: each checkpoint is one shard file per rank (no whole
    model in it) and the bundle's model.pt is whole; a resume into --stages 2 stops in one line naming the
    checkpoint and the fix; --resume with one worker reads the shards whole and trains on."""
    run = tmp_path / "run"
    _batch(dataset, run, "--steps", "8", "--workers", "2", "--shard-states", "parameters")
    newest = sorted((run / "checkpoints").glob("ckpt-*.pt"))[-1]
    shards = newest.with_suffix(".dcp")
    assert {p.name for p in shards.iterdir()} == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    assert "model" not in torch.load(newest, weights_only=True)
    model = torch.load(run / "model.pt", weights_only=True)
    assert all(v.numel() > 0 for v in model.values())  # the bundle's model: whole tensors
    # the engine asked to resume it into pipeline stages (the command line's run directory already refuses a
    # changed --stages; fit itself, as the Python API calls it, says why and names the file)
    from dataclasses import asdict

    from flowtrain.parallel.launch import WorkerFailure
    from flowtrain.train.plan import TrainConfig

    config = asdict(TrainConfig(hidden=(16, 8), dropout=0.0, batch_size=64, steps=12, eval_every=4, decay_steps=12,
                                stages=2, device="cpu", no_progress=True))
    with pytest.raises(WorkerFailure) as failed:
        spawn(2, "flowtrain.train.jobs:train_worker", {"config": config, "dataset": dataset, "run_dir": str(run),
                                                       "resume": True},
              failure_timeout_s=120, workdir=tmp_path / "grid", extra_env=ENV, threads_per_worker=1)
    line = [x for x in str(failed.value).splitlines() if "ZeRO-sharded" in x]
    assert line and str(newest) in line[-1] and "without --stages / --tensor-parallel" in line[-1], str(failed.value)
    one = _batch(dataset, run, "--steps", "12", "--resume")
    assert f"resumed from {newest.name}" in one.stdout
    final = torch.load(sorted((run / "checkpoints").glob("ckpt-*.pt"))[-1], weights_only=True)
    assert final["step"] == 12 and "model" in final  # one worker: a whole checkpoint again

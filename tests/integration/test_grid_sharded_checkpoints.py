"""Sharded checkpoints of the grid with tensor shards (issue 31 item 3): ``GridEngine`` with ZeRO on the replicas
of its tensor shards writes each rank's own pieces (DCP), a shard's slices at their offsets in the whole
parameter (the model's own names and shapes), and a checkpoint resumes with other replicas and other tensor
shards (DCP reshards); the model the run ends with (the bundle's) is whole.

Real gloo ranks through the real entry point (``tests.grid_dcp_jobs``); no collective is mocked."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowtrain.parallel.launch import spawn
from flowtrain.train import checkpoint
from tests.dcp_files import elements_per_file
from tests.tp_jobs import build_model

ROOT = Path(__file__).resolve().parents[2]
ENV = {"PYTHONPATH": str(ROOT)}
pytestmark = pytest.mark.timeout(400)
STEPS, HALF = 6, 3


def _spawn(n: int, job: dict, workdir: Path) -> None:
    spawn(n, "tests.grid_dcp_jobs:run_job", job, failure_timeout_s=120, workdir=workdir, extra_env=ENV,
          threads_per_worker=1)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in b)


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict:
    """2 replicas x 2 tensor shards with ZeRO-3 for HALF steps, its checkpoint sharded."""
    base = tmp_path_factory.mktemp("gridcp")
    _spawn(4, {"tensor": 2, "stage": "parameters", "start": 0, "stop": HALF, "save": str(base / "ckpt"),
               "out": str(base / "half.pt")}, base / "w")
    return {"base": base, "ckpt": base / "ckpt", "half": torch.load(base / "half.pt", weights_only=True)}


def test_grid_with_tensor_shards_saves_each_ranks_pieces_in_the_whole_shapes(written):
    """One shard file per rank, each holding its own part (not a whole copy); the saved tensors are the whole
    model's (names and shapes): read whole in one process they are the model the run ended with, bit for bit
    (and the best weights saved with them)."""
    shards = written["ckpt"] / f"ckpt-{HALF:09d}.dcp"
    assert {p.name for p in shards.iterdir()} == {".metadata", *(f"__{r}_0.distcp" for r in range(4))}
    small = torch.load(written["ckpt"] / f"ckpt-{HALF:09d}.pt", weights_only=True)
    assert "model" not in small and small["sharded_state"] == shards.name
    model = build_model()
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    saved = checkpoint.shard_names(shards)
    assert {k[len("model."):]: v for k, v in saved.items() if k.startswith("model.")} == shapes
    held = elements_per_file(shards, "model.")
    total = sum(v.numel() for v in model.state_dict().values())
    assert sum(held.values()) == total  # every element once: no rank wrote a whole copy, none was left out
    assert set(held) == {f"__{r}_0.distcp" for r in range(4)} and max(held.values()) <= 0.45 * total, held
    assert set(elements_per_file(shards, "optim.")) == set(held)  # the Adam moments: each rank its own too
    whole = checkpoint.read_whole(shards, model, ("model", "optim", "best"), param_groups=small["optimizer_groups"])
    assert all(torch.equal(whole["model"][k], v) for k, v in written["half"].items())
    assert all(torch.equal(whole["best"][k], v) for k, v in written["half"].items())
    assert all(float(s["step"]) == HALF for s in whole["optimizer"]["state"].values())


@pytest.mark.slow
@pytest.mark.timeout(900)  # five grids of 2 to 6 workers on a small machine
def test_grid_sharded_checkpoint_resumes_with_other_replicas_and_tensor_shards(written, tmp_path):
    """The 2 x T2 checkpoint resumed to STEPS as 3 x T2 (ZeRO-3 over 3: each rank reads its pieces), 1 x T2 (no
    replicas: read whole, cut into slices), 2 x T1 (ZeRO, no tensor shards) and 1 x T3 (three other slices):
    each reads bit for bit the state written and ends within 1e-5 of the uninterrupted 2 x T2 run."""
    _spawn(4, {"tensor": 2, "stage": "parameters", "start": 0, "stop": STEPS, "out": str(tmp_path / "full.pt")},
           tmp_path / "u")
    want = torch.load(tmp_path / "full.pt", weights_only=True)
    assert _max_diff(written["half"], want) > 1e-4  # steps HALF..STEPS move the parameters
    model = build_model()
    groups = torch.load(written["ckpt"] / f"ckpt-{HALF:09d}.pt", weights_only=True)["optimizer_groups"]
    wrote = checkpoint.read_whole(written["ckpt"] / f"ckpt-{HALF:09d}.dcp", model, ("model", "optim"),
                                  param_groups=groups)
    for world, tensor in ((6, 2), (2, 2), (2, 1), (3, 3)):
        name = f"d{world // tensor}t{tensor}"
        _spawn(world, {"tensor": tensor, "stage": "parameters", "start": HALF, "stop": STEPS, "load": str(written["ckpt"]),
                       "loaded": str(tmp_path / f"{name}-loaded.pt"), "out": str(tmp_path / f"{name}.pt")},
               tmp_path / name)
        loaded = torch.load(tmp_path / f"{name}-loaded.pt", weights_only=True)
        assert all(torch.equal(loaded["model"][k], v) for k, v in wrote["model"].items()), name
        assert _max_diff(torch.load(tmp_path / f"{name}.pt", weights_only=True), want) <= 1e-5, name


@pytest.mark.parametrize(("stage", "grid"), [
    ("optimizer", {"tensor": 2}), pytest.param("gradients", {"stages": 2}, marks=pytest.mark.slow)])
def test_zero12_on_the_grid_saves_sharded_and_resumes_on_another_layout(tmp_path, stage, grid):
    """ZeRO-1 with tensor shards and ZeRO-2 with pipeline stages (#49 item 2): 2 replicas write one shard file per
    rank, each its own part (no rank gathers the whole state); the checkpoint resumed with one replica (the grid
    reads it whole) ends where the uninterrupted 2-replica run ends, to 1e-9 in float64."""
    common = {"stage": stage, "dtype": "float64", **grid}
    _spawn(4, {**common, "start": 0, "stop": HALF, "save": str(tmp_path / "ckpt"), "out": str(tmp_path / "half.pt")},
           tmp_path / "a")
    shards = tmp_path / "ckpt" / f"ckpt-{HALF:09d}.dcp"
    assert {p.name for p in shards.iterdir()} == {".metadata", *(f"__{r}_0.distcp" for r in range(4))}
    assert "model" not in torch.load(tmp_path / "ckpt" / f"ckpt-{HALF:09d}.pt", weights_only=True)
    held = elements_per_file(shards, "model.")
    total = sum(v.numel() for v in build_model().state_dict().values())
    assert sum(held.values()) == total and max(held.values()) <= 0.45 * total, held  # each rank its own part
    _spawn(4, {**common, "start": 0, "stop": STEPS, "out": str(tmp_path / "full.pt")}, tmp_path / "b")
    _spawn(2, {**common, "start": HALF, "stop": STEPS, "load": str(tmp_path / "ckpt"), "out": str(tmp_path / "one.pt")},
           tmp_path / "c")
    want, got = torch.load(tmp_path / "full.pt", weights_only=True), torch.load(tmp_path / "one.pt", weights_only=True)
    assert _max_diff(got, want) <= 1e-9
    assert _max_diff(torch.load(tmp_path / "half.pt", weights_only=True), want) > 1e-4  # the resumed steps moved it

"""Tensor parallelism, the D x S x T grid and devices: plans as data (one process), equivalence
with one device through the real worker entry point (gloo), merged checkpoints, `--device`."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from flowtrain.parallel.device import DeviceError, backend_for, cpu_state, resolve_device
from flowtrain.parallel.grid import Grid, GridError
from flowtrain.parallel.launch import spawn
from flowtrain.parallel.tensor.plan import (
    ShardedSequential,
    TensorGroup,
    TensorParallelError,
    plan_tensor_parallel,
    shard_module,
)
from tests.tp_jobs import batches, build_model, reference

ROOT = Path(__file__).resolve().parents[2]  # the repository
ENV = {"PYTHONPATH": str(ROOT)}
pytestmark = pytest.mark.timeout(300)


# -- plans, grids and devices as data: one process ----------------------------------------------

def test_plan_pairs_linears_splits_tables_and_prints():
    plan = plan_tensor_parallel(build_model(), 2)
    roles = [layer.role for layer in plan.layers]
    assert roles == ["vocab", "column", "on shards", "on shards", "row (1 all-reduce fwd)", "replicated",
                     "replicated", "column", "on shards", "on shards", "row (1 all-reduce fwd)", "replicated",
                     "replicated", "replicated"]
    table = plan.table()
    assert "| layer | module | role | split | per shard |" in table
    assert "| 1 | Carry(Linear(15->32)) | column | output features | 16, 16 |" in table
    assert ("| 0 | WideDeepInput(deep: TabularInput(4 numeric, 3 tables)) | vocab | embedding rows "
            "| 3, 2 | 1, 1 | 4, 3 |") in table
    # per step: forward one all-reduce per row layer plus one for all tables; backward one per column layer
    assert plan.all_reduces_per_step == (3, 2)
    assert all(layer.role == "replicated" for layer in plan_tensor_parallel(build_model(), 1).layers)


def test_uneven_widths_are_split_and_a_too_narrow_layer_is_an_error_naming_it():
    plan = plan_tensor_parallel(build_model(), 3)  # 32 and 16 do not divide by 3; a table of 2 rows
    assert "| 1 | Carry(Linear(15->32)) | column | output features | 11, 11, 10 |" in plan.table()
    assert "| 2, 2, 1 | 1, 1, 0 | 3, 2, 2 |" in plan.table()
    narrow = nn.Sequential(nn.Linear(4, 2), nn.ReLU(), nn.Linear(2, 1))
    with pytest.raises(ValueError, match=r"cannot split layer 0 \(Linear\(4->2\)\) over --tensor-parallel 3: its 2 "
                                         r"output feature\(s\) are fewer than the shards"):
        plan_tensor_parallel(narrow, 3)


def test_shards_cut_and_merge_back_and_a_diverged_replica_is_an_error():
    model = build_model()
    full = model.state_dict()
    for tensor in (2, 3):
        plan = plan_tensor_parallel(model, tensor)
        shards = [plan.shard_state(full, t) for t in range(tensor)]
        modules = [shard_module(model, plan, TensorGroup(None, t, tensor)) for t in range(tensor)]
        for t in range(tensor):  # shard_module holds exactly the slices shard_state cuts
            got = modules[t].state_dict()
            assert set(got) == set(full) and all(torch.equal(got[k], shards[t][k]) for k in got)
        merged = plan.merge(shards)
        assert all(torch.equal(merged[k], full[k]) for k in full)
    shards[1]["13.linear.bias"] = shards[1]["13.linear.bias"] + 1e-3
    with pytest.raises(TensorParallelError, match="replicated '13.linear.bias' differs between tensor shards 0 and 1"):
        plan.merge(shards)


def test_a_failing_layer_raises_with_the_plan_and_the_layer_marked():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    plan = plan_tensor_parallel(model, 2)
    shard = shard_module(model, plan, TensorGroup(None, 0, 2))
    assert isinstance(shard, ShardedSequential)
    with pytest.raises(TensorParallelError) as err:
        shard(torch.randn(3, 7))  # the wrong width
    text = str(err.value)
    assert "tensor shard 0 of 2 failed in layer 0 (Linear(8->16), column)" in text
    assert "| >> 0 | Linear(8->16) | column | output features | 8, 8 |" in text


def test_grid_numbers_ranks_and_prints_who_does_what():
    grid = Grid(data=2, stages=2, tensor=2)
    assert [grid.rank_of(*((r, s, t))) for r in range(2) for s in range(2) for t in range(2)] == list(range(8))
    pos = grid.position(6)
    assert (pos.replica, pos.stage, pos.tensor) == (1, 1, 0) and pos.rank_of(0) == 4 and pos.rank_of(1, 0) == 2
    assert grid.tensor_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.data_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid.pipeline_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    table = grid.table({6: "layers 4-13, shard 1/2"})
    assert "| 6 | 1 | 1 | 0 | 6,7 | 2,6 | 4,6 | layers 4-13, shard 1/2 |" in table
    assert Grid.from_world(12, stages=2, tensor=3) == Grid(2, 2, 3)
    with pytest.raises(GridError, match="7 workers cannot form a grid of --stages 2 x --tensor-parallel 2"):
        Grid.from_world(7, stages=2, tensor=2)


def test_device_resolution_and_its_errors():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("cuda", local_rank=2, local_world=4, cuda_count=4) == torch.device("cuda", 2)
    assert resolve_device("auto", cuda_count=0) == torch.device("cpu")
    assert resolve_device("auto", local_rank=1, local_world=2, cuda_count=2) == torch.device("cuda", 1)
    with pytest.raises(DeviceError, match="3 local workers but 2 GPU"):
        resolve_device("cuda", local_world=3, cuda_count=2)
    with pytest.raises(DeviceError, match="3 local workers but 2 GPU"):
        resolve_device("auto", local_world=3, cuda_count=2)
    with pytest.raises(DeviceError, match="--device cuda: no CUDA device is visible"):
        resolve_device("cuda", cuda_count=0)
    with pytest.raises(DeviceError, match="not one of auto, cpu, cuda"):
        resolve_device("tpu")
    assert backend_for("cpu") == "gloo" and backend_for("cuda:0") == "cpu:gloo,cuda:nccl"
    state = cpu_state({"a": torch.ones(2), "opt": {"state": {0: {"m": torch.zeros(1)}}, "lr": [0.1]}})
    assert state["opt"]["lr"] == [0.1] and state["opt"]["state"][0]["m"].device.type == "cpu"


# -- equivalence through the real worker entry point ----------------------------------------------

def _run_grid(tmp_path, world: int, **job) -> tuple[dict, dict]:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    spawn(world, "tests.tp_jobs:grid_job", {"steps": 20, "out": str(out), "device": "cpu", **job},
          failure_timeout_s=120, workdir=tmp_path / "w", extra_env=ENV)
    return torch.load(out / "merged.pt", weights_only=True), torch.load(out / "shards.pt", weights_only=True)


def _check_equal_to_one_device(merged: dict) -> None:
    want = reference(20)
    assert max(float((merged[k] - v).abs().max()) for k, v in want.state_dict().items()) <= 1e-5
    # the merged state loads into the plain (unsharded) model and predicts the same
    model = build_model()
    model.load_state_dict(merged)
    model.eval(), want.eval()
    x = batches(1, seed=99)[0][0]
    assert torch.allclose(model(x), want(x), atol=1e-5)


@pytest.mark.parametrize("tensor", [2, 3])
def test_tensor_parallel_equals_one_device_after_20_adam_steps(tmp_path, tensor):
    merged, shards = _run_grid(tmp_path, tensor, tensor=tensor)
    _check_equal_to_one_device(merged)
    # the shards really are shards: T = 3 splits 32 features 11/11/10 and the 2-row table 1/1/0
    sizes = [s["1.inner.weight"].shape[0] for s in shards["shards"][0]]
    assert sizes == ([16, 16] if tensor == 2 else [11, 11, 10])
    # communication as planned: 3 all-reduces forward, 2 backward per step (T > 1)
    assert shards["all_reduces"] == 20 * 5


def test_3d_grid_2x2x2_equals_one_device(tmp_path):
    """8 processes: 2 replicas x 2 pipeline stages (1F1B, 3 micro-batches) x 2 tensor shards."""
    merged, _ = _run_grid(tmp_path, 8, stages=2, tensor=2, microbatches=3)
    _check_equal_to_one_device(merged)


@pytest.mark.slow  # the 2 x 2 x 2 grid above composes the same pieces
@pytest.mark.parametrize("stages", [1, 2])
def test_2d_grids_with_tensor_parallel_2_equal_one_device(tmp_path, stages):
    """data x tensor (2 x 2) and pipeline x tensor (2 x 2)."""
    merged, _ = _run_grid(tmp_path, 4, stages=stages, tensor=2, microbatches=3)
    _check_equal_to_one_device(merged)


# -- the command line -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def flights(shared_data) -> str:
    return shared_data.flights(every=40)


def _batch(*args, timeout=280) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flowtrain.cli", "batch", "--no-progress", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_batch_tensor_parallel_on_explicit_cpu_writes_sharded_and_merged_checkpoints(flights, tmp_path):
    from flowtrain.train.loader import TabularDataset
    from flowtrain.train.models import Architecture

    run = tmp_path / "run"
    proc = _batch("--dataset", flights, "--out", str(run), "--tensor-parallel", "2", "--device", "cpu",
                  "--steps", "12", "--eval-every", "6", "--batch-size", "256", "--hidden", "32,16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "1 replica(s) x 1 pipeline stage(s) x 2 tensor shard(s) on 127.0.0.1 (cpu, gloo)" in proc.stdout
    assert "| rank | replica | stage | tensor shard |" in proc.stdout and "tensor parallel plan, T = 2" in proc.stdout
    state = torch.load(sorted((run / "checkpoints").glob("ckpt-*.pt"))[-1], weights_only=True)
    assert state["optimizer"]["grid"] == {"stages": 1, "tensor_parallel": 2}
    (shard0, shard1), = state["shards"]
    assert shard0["1.inner.weight"].shape[0] == 16 and shard1["1.inner.weight"].shape[0] == 16
    data = TabularDataset(flights)

    def plain(state_dict):  # the run's architecture (the default recipe, as the run chose it), unsharded
        model = Architecture.from_dict(state["config"], "the run's checkpoint").build(data)
        model.load_state_dict(state_dict)
        return model.eval()

    # the merged state dict loads into the unsharded model, and equals merging the shards by the plan
    merged = plain(state["model"])
    plan = plan_tensor_parallel(merged, 2)
    by_plan = plain(plan.merge([shard0, shard1]))
    test = data.split("test")
    assert torch.equal(merged(test.x_num, test.x_cat), by_plan(test.x_num, test.x_cat))


def test_device_cuda_without_a_gpu_is_a_clear_error_before_training(flights, tmp_path):
    proc = _batch("--dataset", flights, "--out", str(tmp_path / "run"), "--device", "cuda", "--tensor-parallel",
                  "2", timeout=120)
    assert proc.returncode == 2
    assert "--device cuda: no CUDA device is visible to torch" in proc.stderr
    assert not (tmp_path / "run" / "workers").exists()



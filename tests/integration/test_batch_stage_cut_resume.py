"""`flowtrain batch --stages 2 --resume` keeps the checkpoint's stage cut (issue 31, the bug noticed in the
third session): rank 0 cuts the model by measured time, which varies under load; a resume that measured
again could cut elsewhere, and then the checkpoint's per-stage optimizer state did not load."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.timeout(400)
ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "flowtrain.cli", "batch", "--no-progress"]
COMMON = ("--dropout", "0", "--batch-size", "64", "--threads", "1", "--hidden", "16,8,8", "--eval-every", "4",
          "--decay-steps", "12", "--device", "cpu", "--stages", "2", "--microbatches", "2", "--failure-timeout", "120")


@pytest.fixture(scope="module")
def dataset(shared_data) -> str:
    return shared_data.regression_dataset(rows=1200)


def _batch(dataset: str, out: Path, *extra: str) -> subprocess.CompletedProcess:
    done = subprocess.run(CLI + ["--dataset", dataset, "--out", str(out), *COMMON, *extra], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done


def _layer_params(model_state: dict, stage_state: dict) -> list[tuple[int, int]]:
    """(layer index, its parameter count) of a stage, in order (a Sequential's keys start with the layer's index)."""
    counts: dict[int, int] = {}
    for key in stage_state:
        counts[int(key.split(".")[0])] = counts.get(int(key.split(".")[0]), 0) + 1
    return sorted(counts.items())


def _recut(state: dict, bounds: list[list[int]]) -> dict:
    """The checkpoint's per-stage Adam states cut again at ``bounds`` (the model's layers, whole-model order)."""
    whole, per_layer = [], []
    for stage_opt, stage_state in zip(state["optimizer"]["stages"], state["stages"]):
        params = stage_opt["param_groups"][0]["params"]
        assert len(params) == len(stage_state)  # every stage_state key is a parameter (no buffers in this model)
        whole += [stage_opt["state"].get(i, stage_opt["state"].get(str(i))) for i in params]
        per_layer += _layer_params(state["model"], stage_state)
    out, at = [], 0
    for a, b in bounds:
        n = sum(count for layer, count in per_layer if a <= layer < b)
        mine = whole[at:at + n]
        at += n
        group = {**state["optimizer"]["stages"][0]["param_groups"][0], "params": list(range(n))}
        out.append({"state": {i: s for i, s in enumerate(mine) if s is not None}, "param_groups": [group]})
    assert at == len(whole)
    return {**state["optimizer"], "stages": out}


def test_batch_resume_with_stages_keeps_the_checkpoints_stage_cut(dataset, tmp_path):
    out = tmp_path / "run"
    _batch(dataset, out, "--steps", "8")
    path = sorted((out / "checkpoints").glob("ckpt-*.pt"))[-1]
    state = torch.load(path, weights_only=True)
    recorded = state["stage_bounds"]  # the cut is in the checkpoint
    layers = recorded[-1][1]
    assert len(recorded) == 2 and recorded[0][0] == 0 and recorded[0][1] == recorded[1][0]
    # another valid cut, as a measurement under load may give: the checkpoint rewritten to it (state and checksum)
    cut = recorded[0][1] + (1 if recorded[0][1] + 1 < layers else -1)
    other = [[0, cut], [cut, layers]]
    state["optimizer"] = _recut(state, other)
    state["stage_bounds"] = other
    torch.save(state, path)
    side = path.with_suffix(".sha256")
    record = json.loads(side.read_text())
    side.write_text(json.dumps({**record, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}))
    resumed = _batch(dataset, out, "--steps", "12", "--resume")
    assert f"resumed from {path.name}" in resumed.stdout
    # the resumed grid runs the checkpoint's cut, not a measured one
    grid = [line for line in resumed.stdout.splitlines() if line.startswith("| ") and "| layers " in line]
    assert grid[0].endswith(f"| layers 0-{cut - 1} |") and grid[1].endswith(f"| layers {cut}-{layers - 1} |"), grid
    final = torch.load(sorted((out / "checkpoints").glob("ckpt-*.pt"))[-1], weights_only=True)
    assert final["step"] == 12 and final["stage_bounds"] == other

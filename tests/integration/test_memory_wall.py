"""The memory wall, whole (#49 item 1): a model whose *parameters alone* are 1.5x what a worker may hold after its
fixed overhead, trained by ``flowtrain batch`` under ``--worker-memory``.

The workers build the model on the meta device (``flowtrain.parallel.deferred``): a ZeRO-3 rank makes only the slices
of each parameter it owns, with the values one process gives them; it evaluates the model layer by layer, keeps its
best weights as its own pieces, saves its shards (DCP) and writes ``model.pt`` whole without holding it (streamed,
one gathered layer at a time). The plan refuses one worker in one line naming the smallest layout that fits; that
layout trains the model to completion under the cap (``flowtrain.parallel.memcap``), and its model equals an uncapped
one-process run's to 1e-9 (``--dtype float64``: the check mode; float32 differs in the summation order).

Sizes: in ``make test`` 96 hidden layers of 256 (6.3 M parameters, 48 MiB in float64); in the slow lane 96 hidden
layers of 1,024 (100 M parameters, 0.75 GiB in float64, ``bench memory --size 100m``'s size). Many layers: ZeRO-3
gathers one layer at a time, so a rank's step holds a few layers beside its shards (with a few wide layers the
smallest layout would be 16 or 32 workers).
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SMALL = {"hidden": (256,) * 96, "steps": 4}  # 6.3 M parameters: 48 MiB in float64
LARGE = {"hidden": (1024,) * 96, "steps": 4}  # 100 M parameters: 0.75 GiB in float64
RATIO = 1.5  # the parameters' bytes over (the cap less a worker's fixed overhead)
GIB = 2**30

pytestmark = pytest.mark.timeout(1500)


@pytest.fixture(scope="module")
def wall_dataset(shared_data) -> str:
    return shared_data.flights(every=40)  # the session's (read only: --dataset)


def _batch(*args: str, timeout: float = 1200) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flowtrain.cli", "batch", "--no-progress", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def _parameter_bytes(dataset: str, hidden: tuple[int, ...]) -> int:
    """The model's parameters in float64, from its meta-device skeleton (no memory)."""
    from flowtrain.train.loader import TabularDataset
    from flowtrain.train.models import build_run_model
    from flowtrain.train.plan import TrainConfig

    model = build_run_model(None, TabularDataset(dataset), TrainConfig(hidden=hidden), deferred=True)
    return sum(p.numel() for p in model.parameters()) * 8


def _gib(text: str) -> float:
    value, unit = re.fullmatch(r"([\d.]+) (GiB|MiB)", text).groups()
    return float(value) * (GIB if unit == "GiB" else 2**20)


def _overhead(line: str) -> float:
    """A worker's fixed overhead as the command measured and named it in its one line."""
    found = re.search(r"fixed (?:overhead \()?([\d.]+ (?:GiB|MiB))", line)
    assert found, line
    return _gib(found.group(1))


def _demo(dataset: str, tmp_path: Path, shape: dict) -> None:
    common = ["--dataset", dataset, "--hidden", ",".join(map(str, shape["hidden"])), "--dtype", "float64",
              "--dropout", "0", "--batch-size", "32", "--steps", str(shape["steps"]), "--eval-every", "2",
              "--device", "cpu", "--failure-timeout", "600"]
    params = _parameter_bytes(dataset, shape["hidden"])
    # a worker's fixed overhead, as the command measures it (a cap below it is refused before anything starts)
    below = _batch(*common, "--out", str(tmp_path / "below"), "--worker-memory", "0.01", timeout=300)
    assert below.returncode != 0
    overhead = _overhead(below.stderr.strip().splitlines()[-1])
    cap_gib = round((overhead + params / RATIO) / GIB, 3)
    # one worker: refused in one line, before training, naming the smallest layout that fits
    one = _batch(*common, "--out", str(tmp_path / "one"), "--worker-memory", str(cap_gib), timeout=300)
    assert one.returncode != 0
    line = one.stderr.strip().splitlines()[-1]
    assert line.startswith(f"flowtrain batch: does not fit --worker-memory {cap_gib:.2f} GiB: --workers 1 needs"), line
    # the parameters alone: 1.5x what the cap leaves after the overhead it was made from (each run measures its own
    # overhead, ~10 MB apart from run to run and shown to 0.01 GiB: not the measure of a 48 MiB model)
    assert params >= 0.98 * RATIO * (cap_gib * GIB - overhead), (params, overhead, line)
    assert abs(_overhead(line) - overhead) <= 0.05 * GIB, (overhead, line)  # the same overhead, as it was measured
    layout = re.search(r"`(--workers (\d+) --shard-states (\w+))`", line)
    assert layout and layout.group(3) == "parameters", line  # ZeRO-3: the parameters themselves sharded
    assert not (tmp_path / "one" / "checkpoints").exists()
    # that layout, under the same cap: trains to completion
    capped = _batch(*common, "--out", str(tmp_path / "capped"), "--worker-memory", str(cap_gib),
                    *layout.group(1).split())
    assert capped.returncode == 0, capped.stderr[-3000:]
    assert f"each worker capped at {cap_gib:g} GiB" in capped.stdout
    workers = int(layout.group(2))
    assert len(list((tmp_path / "capped" / "checkpoints").glob("*.dcp/__*_0.distcp"))) >= workers  # its own shards
    # an uncapped one-process run: the same model, to 1e-9
    whole = _batch(*common, "--out", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    got = torch.load(tmp_path / "capped" / "model.pt", weights_only=True)
    want = torch.load(tmp_path / "whole" / "model.pt", weights_only=True)
    assert got.keys() == want.keys() and all(v.dtype == want[k].dtype for k, v in got.items())
    worst = max(float((got[k].double() - v.double()).abs().max()) for k, v in want.items())
    assert worst <= 1e-9, worst
    import json

    memory = json.loads((tmp_path / "capped" / "summary.json").read_text())["training"]["memory"]
    for rank in memory["measured"]:  # every rank held its share, never the whole model
        assert rank["peak_state"] <= memory["plan"]["total"] and rank["peak_state"] < params


# In the slow lane for its run time: each of its two training runs ends with the batch report, whose permutation
# importance over the 96-layer model takes minutes on a 2-core machine. Issue 49's bug (a rank over its cap on a clean
# venv: torch._dynamo loaded after the cap's calibration, and glibc's heap keeping a step's peak) is fixed; see
# docs/parallelism.md. Run it with `make test-slow` or `pytest -m slow -k memory_wall`.
@pytest.mark.slow
def test_memory_wall_small(wall_dataset, tmp_path):
    _demo(wall_dataset, tmp_path, SMALL)


@pytest.mark.slow
def test_memory_wall_large(wall_dataset, tmp_path):
    _demo(wall_dataset, tmp_path, LARGE)

"""Issue 30 item 6: with one process, ``flowtrain batch`` takes the fit result in memory; ``model.pt``,
``fit.json`` and ``training.json`` are written as the run's outputs and never read back as the hand-off. A worker
group (``--workers 2``) still hands its result over in those files.

The observable is Python's own audit events (``sys.addaudithook``, PEP 578): every ``open`` of a file in
the process raises one with the path and mode, ``torch.load`` and ``Path.read_text`` included. Nothing is
patched: the hook only records."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import flowtrain

_OPENED: list[tuple[str, str]] = []
_WATCH: list[Path] = []  # the run directory watched (empty: the hook records nothing)


def _record(event: str, args: tuple) -> None:
    if event == "open" and _WATCH and isinstance(args[0], (str, Path)):
        path = Path(args[0])
        if path.parent == _WATCH[0]:
            _OPENED.append((path.name, str(args[1])))


sys.addaudithook(_record)  # a hook cannot be removed: it is inert while _WATCH is empty


@pytest.fixture(scope="module")
def dataset(shared_data) -> str:
    return shared_data.regression_dataset(rows=600)


@pytest.mark.timeout(300)
def test_one_process_takes_the_fit_result_in_memory_and_writes_the_files_as_outputs(dataset, tmp_path):
    run = tmp_path / "run"
    _WATCH.append(run)
    try:
        summary = flowtrain.batch(dataset=dataset, out=str(run), epochs=2, batch_size=64, threads=1, no_progress=True,
                                  hidden=(16, 8))
    finally:
        _WATCH.clear()
    opened = list(_OPENED)
    _OPENED.clear()
    read_back = [(name, mode) for name, mode in opened
                 if name in ("fit.json", "model.pt", "training.json") and not any(c in mode for c in "wax+")]
    assert read_back == [], f"the in-process run read its hand-off files back: {read_back}"
    assert ("metrics.jsonl", "a") in opened  # the watch was live: the run's own appends were seen
    # the outputs are still written, and they hold what the summary took from memory
    fitted = json.loads((run / "fit.json").read_text())
    assert summary["training"]["steps"] == fitted["steps"] > 0
    assert summary["valid_best"] == fitted["best_valid"]
    training = json.loads((run / "training.json").read_text())
    assert summary["training"]["best_step"] == training["best_step"]
    assert summary["training"]["plan"] == training["plan"] and summary["select_by"] == training["select_by"]
    assert summary["training"]["memory"]["plan"] == training["memory"]["plan"]
    # the model evaluated in memory is the one in model.pt: the bundle's weights equal it
    weights = torch.load(run / "model.pt", weights_only=True)
    predictor = flowtrain.load(str(run / "bundle"))
    bundled = predictor.module.state_dict()
    assert weights.keys() == bundled.keys()
    assert all(torch.equal(weights[k], bundled[k]) for k in weights)


@pytest.mark.timeout(300)
def test_a_worker_group_still_hands_its_result_over_in_files(dataset, tmp_path):
    run = tmp_path / "run2"
    _WATCH.append(run)
    try:
        summary = flowtrain.batch(dataset=dataset, out=str(run), epochs=1, batch_size=64, threads=1, no_progress=True,
                                  hidden=(16, 8), workers=2)
    finally:
        _WATCH.clear()
    opened = list(_OPENED)
    _OPENED.clear()
    assert {("fit.json", "r"), ("model.pt", "r"), ("training.json", "r")} <= set(opened)  # the workers' files
    assert summary["training"]["workers"] == 2
    assert summary["training"]["steps"] == json.loads((run / "fit.json").read_text())["steps"] > 0


def test_the_hook_sees_a_read_of_fit_json(tmp_path):
    """The observable can fail: a read of fit.json in the watched directory is recorded as a read."""
    (tmp_path / "fit.json").write_text("{}")
    torch.save({"w": torch.zeros(2)}, tmp_path / "model.pt")
    _WATCH.append(tmp_path)
    try:
        (tmp_path / "fit.json").read_text()
        torch.load(tmp_path / "model.pt", weights_only=True)
    finally:
        _WATCH.clear()
    seen = list(_OPENED)
    _OPENED.clear()
    assert ("fit.json", "r") in seen and ("model.pt", "r") in seen

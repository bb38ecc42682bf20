"""The checkpoint manager (flowtrain.train.checkpoint_manager): one state dict for batch and stream.

In one process on the data-parallel engine: a checkpoint written by ``collect`` + ``write`` holds the engine's part
and the caller's progress side by side; ``restore`` puts the model, the optimizer and the RNG back exactly, and returns
the best weights saved with it; a checkpoint of another model's shapes is a CheckpointError naming the option, the
file and the fix. The multi-process layouts (ZeRO shards, grids) are the integration tests' (test_resume_*,
test_zero_sharded_checkpoints, test_grid_sharded_checkpoints, test_stream_trainer).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from flowtrain.parallel import DistContext
from flowtrain.train import checkpoint
from flowtrain.train.checkpoint_manager import CheckpointManager, saved_stage_bounds
from flowtrain.train.loader import Batch
from flowtrain.train.plan import TrainConfig
from flowtrain.train.trainer import Trainer, loss_function


class _Net(nn.Module):
    def __init__(self, width: int = 4):
        super().__init__()
        self.layer = nn.Linear(3, width)
        self.out = nn.Linear(width, 1)

    def forward(self, x_num, x_cat):
        return self.out(torch.relu(self.layer(x_num))).squeeze(-1)


def _trained(width: int = 4) -> tuple[nn.Module, Trainer]:
    torch.manual_seed(0)
    model = _Net(width)
    trainer = Trainer(model, DistContext(), TrainConfig(lr=0.05), loss_function("regression"), None, seed=0)
    batch = Batch(torch.randn(16, 3), torch.zeros(16, 0, dtype=torch.int64), torch.randn(16))
    for step in range(3):
        trainer.step(batch, step)
    return model, trainer


def _manager(directory, model, trainer) -> CheckpointManager:
    return CheckpointManager(directory, model, trainer.engine, writer=True, world_size=1, run_id="run-a")


def test_a_checkpoint_restores_model_optimizer_and_rng_and_keeps_the_progress(tmp_path):
    model, trainer = _trained()
    manager = _manager(tmp_path, model, trainer)
    best = manager.weights()
    collected = manager.collect(3, best=best)
    assert collected.shards is None and collected.model_state is not None
    path = manager.write(3, collected, {"step": 3, "positions": {"0": 17}})
    rng_then = torch.get_rng_state()
    weights_then = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer_then = trainer.engine.optimizer_state()["state"][0]["exp_avg"].clone()

    state = checkpoint.load(path)
    assert state["step"] == 3 and state["positions"] == {"0": 17}  # the caller's progress beside the engine's part
    assert set(state) >= {"model", "optimizer", "best_model", "rng", "stage_bounds", "stages", "shards"}
    assert checkpoint.run_of(path) == "run-a"

    with torch.no_grad():  # everything moves on: weights, optimizer state, the RNG
        for p in model.parameters():
            p.add_(1.0)
    trainer.step(Batch(torch.randn(16, 3), torch.zeros(16, 0, dtype=torch.int64), torch.randn(16)), 3)
    torch.rand(5)

    restored_best = manager.restore(path, state, option="--resume", fix="the fix")
    for k, v in weights_then.items():
        assert torch.equal(model.state_dict()[k], v), k
    assert torch.equal(trainer.engine.optimizer_state()["state"][0]["exp_avg"], optimizer_then)
    assert torch.equal(torch.get_rng_state(), rng_then)
    assert restored_best.keys() == best.keys() and all(torch.equal(restored_best[k], best[k]) for k in best)


def test_a_checkpoint_of_another_model_is_an_error_naming_the_option_the_file_and_the_fix(tmp_path):
    model, trainer = _trained(width=4)
    manager = _manager(tmp_path, model, trainer)
    path = manager.write(3, manager.collect(3), {"step": 3})
    other, other_trainer = _trained(width=5)
    with pytest.raises(checkpoint.CheckpointError) as err:
        _manager(tmp_path, other, other_trainer).restore(path, checkpoint.load(path), option="stream train",
                                                         fix="start a new run in another --out")
    message = str(err.value)
    assert message.startswith(f"stream train: {path} does not fit this run's model (size mismatch for "), message
    assert message.endswith(": start a new run in another --out"), message


def test_only_the_writer_writes_and_a_run_without_a_directory_writes_nothing(tmp_path):
    model, trainer = _trained()
    reader = CheckpointManager(tmp_path, model, trainer.engine, writer=False, world_size=1)
    assert reader.write(3, reader.collect(3), {"step": 3}) is None
    nowhere = CheckpointManager(None, model, trainer.engine, writer=True, world_size=1)
    assert nowhere.write(3, nowhere.collect(3), {"step": 3}) is None
    assert list(tmp_path.iterdir()) == []


def test_a_resumed_grid_keeps_its_stage_cut_only_for_the_same_number_of_stages():
    state = {"stage_bounds": [(0, 2), (2, 5)]}
    assert saved_stage_bounds(state, 2) == [[0, 2], [2, 5]]
    assert saved_stage_bounds(state, 3) is None
    assert saved_stage_bounds({"stage_bounds": None}, 2) is None and saved_stage_bounds({}, 2) is None

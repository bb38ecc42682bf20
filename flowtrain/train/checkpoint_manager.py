"""The checkpoint manager: the one owner of a trainer's checkpoint state dict, for batch and stream.

A checkpoint file (``flowtrain.train.checkpoint``: atomic, checksummed, per run) holds two parts:

* **the engine's state**, written and read here only: the model (each ID table whole when the tables are
  sharded over the replicas), the per-stage and per-shard views of a grid, the optimizer (a grid's per
  stage), the best weights a batch run keeps, the RNG and the grid's stage cut; under ``--shard-states``
  (ZeRO) every rank's pieces in DCP shards beside the file instead, the file keeping the optimizer's groups
  and the layout that wrote them;
* **the trainer's progress**, plain data the caller passes as ``progress``: batch its step, epoch, best step
  and validation metrics, data position and config; the stream its version, Kafka positions, seen sources,
  rejected counts and dead-letter ends.

``collect`` gathers the engine's part (a collective: every rank calls it at the same step), ``write`` puts it
and the progress into one file (rank 0), ``restore`` loads a checkpoint's engine part into the engine (a
collective under ZeRO) and the RNG, and returns the best weights it held. The trainer decides when; the manager
decides what the file holds.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from flowtrain.parallel.device import cpu_state
from flowtrain.train import checkpoint


@dataclass
class EngineState:
    """What ``CheckpointManager.collect`` gathered at one step: the file's engine part, the DCP shards' directory
    (``--shard-states``), and the model's whole ``state_dict`` when the file holds it (the stream publishes it)."""
    state: dict
    shards: Path | None
    model_state: dict | None


class CheckpointManager:
    """The checkpoints of one trainer in ``directory`` (``None``: a run without checkpoints): what they hold of
    the model and its engine, written and read in one place.

    ``writer``: this rank writes the files (rank 0); ``run_id``: the run they belong to (a batch run's marker; the
    stream keeps its own in the progress); ``shard_states``: the ``--shard-states`` option the layout records."""

    def __init__(self, directory: Path | None, model: nn.Module, engine, *, writer: bool, world_size: int,
                 shard_states: str = "none", run_id: str | None = None, keep: int = 3):
        self.directory, self.model, self.engine = directory, model, engine
        self.writer, self.world_size, self.shard_states = writer, world_size, shard_states
        self.run_id, self.keep = run_id, keep

    @property
    def sharded(self) -> bool:
        """Every rank writes its own pieces (ZeRO: ``--shard-states``)."""
        return hasattr(self.engine, "shard_pieces")

    def model_state(self) -> dict:
        """The model's ``state_dict``; with ID tables sharded over the replicas, each table whole (a collective)."""
        model = self.model
        return model.full_state_dict() if getattr(model, "sharded", False) else model.state_dict()

    def weights(self) -> dict:
        """A copy of the current weights (a batch run's best so far): whole, or a ZeRO-3 rank's pieces of them."""
        if getattr(self.engine, "holds_shards", False):
            return self.engine.state_pieces()
        return {k: v.detach().clone() for k, v in self.model_state().items()}

    def stage_bounds(self) -> list | None:
        """A grid's stage cut (a resume keeps it: rank 0 cuts by measured time, which varies)."""
        plan = getattr(self.engine, "plan", None)
        return [list(b) for b in plan.bounds] if plan is not None else None

    # --- writing ----------------------------------------------------------------------------------------------
    def collect(self, step: int, *, best: dict | None = None) -> EngineState:
        """The engine's part of the checkpoint of ``step`` (a collective: every rank, the same step). ``best``: the
        best weights a batch run keeps (whole, or a ZeRO-3 rank's pieces), saved with it."""
        engine, shards = self.engine, None
        if self.sharded:  # every rank writes its own shard of parameters, optimizer state and best weights (DCP)
            tensors, chunks = engine.shard_pieces({"best": best} if best is not None else None)
            if self.directory is not None:
                shards = checkpoint.save_shards(self.directory, step, tensors, chunks, run_id=self.run_id)
            state = {"optimizer_groups": [{k: v for k, v in g.items() if k != "params"}
                                          for g in engine.optimizer.param_groups][:1],
                     "layout": {"workers": self.world_size, "shard_states": self.shard_states}}
            model_state = None
        else:
            model_state = self.model_state()
            state = {"model": model_state,
                     "stages": engine.stage_states(), "shards": engine.shard_states(),
                     "optimizer": engine.optimizer_state(),  # a collective under a grid
                     "best_model": best}
        state.update(rng=torch.get_rng_state(), stage_bounds=self.stage_bounds())
        return EngineState(state, shards, model_state)

    def write(self, step: int, engine_state: EngineState, progress: dict, *,
              keep_steps: tuple[int, ...] = ()) -> Path | None:
        """``ckpt-<step>.pt``: the engine's part and the trainer's ``progress`` (rank 0; other ranks write nothing
        and get ``None``). ``keep_steps``: checkpoints kept past ``keep`` (a ZeRO-3 run's best weights)."""
        if self.directory is None or not self.writer:
            return None
        return checkpoint.save(self.directory, step, cpu_state({**engine_state.state, **progress}),  # any machine
                               keep=self.keep, run_id=self.run_id, shards=engine_state.shards, keep_steps=keep_steps)

    # --- reading ----------------------------------------------------------------------------------------------
    def restore(self, path: Path, state: dict, *, option: str, fix: str) -> dict | None:
        """Load checkpoint ``path`` (its loaded ``state``) into the engine and the RNG (a collective under ZeRO);
        returns the best weights it held (whole, or this rank's pieces when the engine holds shards; ``None``: none
        were saved with it). A checkpoint of another model's shapes is a ``CheckpointError`` naming the ``option`` that
        asked for it, the file and ``fix``."""
        engine = self.engine
        try:
            if state.get("sharded_state"):  # each rank reads its pieces, whichever ranks wrote them (DCP)
                best = checkpoint.load_sharded(engine, self.model, path, state)
            else:
                engine.load(state["model"], state["optimizer"])
                best = state.get("best_model")
                if best is not None and getattr(engine, "holds_shards", False):
                    best = engine.pieces_of(best)
        except (RuntimeError, ValueError, KeyError, IndexError) as err:
            if isinstance(err, checkpoint.CheckpointError):
                raise
            lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
            detail = lines[1] if len(lines) > 1 and lines[0].startswith("Error(s) in loading") else lines[0]
            raise checkpoint.CheckpointError(
                f"{option}: {path} does not fit this run's model ({detail[:300]}); its checksum holds, so another model "
                f"wrote it (or it was changed and resealed): {fix}") from None
        if "rng" in state:
            torch.set_rng_state(state["rng"])
        return best


def saved_stage_bounds(state: dict, stages: int) -> list | None:
    """The stage cut a checkpoint's ``state`` recorded, if it has ``stages`` stages: a resumed grid keeps it (rank 0
    cuts by measured time, which varies: another cut gives a stage other layers, and the checkpoint's optimizer
    state would not load). ``None``: the engine cuts anew, and its ``load`` names the layout the checkpoint has."""
    bounds = state.get("stage_bounds")
    return [list(b) for b in bounds] if isinstance(bounds, list) and len(bounds) == stages else None

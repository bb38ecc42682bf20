"""The engine's worker jobs: what ``python -m flowtrain.worker MODULE:FUNCTION JOB.json`` runs on every rank.

``flowtrain batch --workers N`` and ``flowtrain stream train --workers N`` spawn these; across machines
``torchrun ... -m flowtrain.worker flowtrain.train.jobs:train_worker JOB.json`` runs the same function.
"""
from __future__ import annotations

import json
from pathlib import Path


def train_worker(ctx, job: dict) -> None:
    """Train on the dataset of ``job``; every data-parallel rank runs this (rank 0 writes).

    The entry point of ``python -m flowtrain.worker flowtrain.train.jobs:train_worker JOB``.
    """
    import torch

    from flowtrain.train.loader import TabularDataset
    from flowtrain.train.loop import TrainConfig, build_model, fit

    data = TabularDataset(job["dataset"])
    cfg = dict(job["config"])
    cfg["hidden"] = tuple(cfg["hidden"])
    if ctx.distributed:
        cfg["threads"] = None  # the launcher (or torchrun's environment) sets threads per worker
    config = TrainConfig(**cfg)
    run_dir = Path(job["run_dir"])
    result = fit(build_model("mlp", data, config), data, config, run_dir=run_dir, resume=bool(job.get("resume")),
                 ctx=ctx)
    if ctx.is_main:
        torch.save(result.model.state_dict(), run_dir / "model.pt")
        (run_dir / "fit.json").write_text(json.dumps({
            "steps": result.steps, "epochs_run": result.epochs_run, "best_epoch": result.best_epoch,
            "stopped_early": result.stopped_early, "seconds": result.seconds,
            "data_wait_fraction": result.data_wait_fraction, "best_valid": result.best_valid}))


def stream_trainer_worker(ctx, job: dict) -> None:
    """Run the online stream trainer on every data-parallel rank (``flowtrain stream train --workers N``)."""
    from flowtrain.train.stream import StreamTrainConfig, run_stream_trainer

    cfg = dict(job["config"])
    cfg["hidden"] = tuple(cfg["hidden"])
    run_stream_trainer(StreamTrainConfig(**cfg), ctx)

"""The engine's worker jobs: what ``python -m flowtrain.parallel.worker MODULE:FUNCTION JOB.json`` runs on every rank.

``flowtrain batch --workers N`` and ``flowtrain stream train --workers N`` spawn these; across machines
``torchrun ... -m flowtrain.parallel.worker flowtrain.train.jobs:train_worker JOB.json`` runs the same function.
"""
from __future__ import annotations

import json
from pathlib import Path

from flowtrain.train.rundir.files import RunFiles
from flowtrain.train.rundir.marker import run_id_of


def train_worker(ctx, job: dict) -> None:
    """Train on the dataset of ``job``; every data-parallel rank runs this (rank 0 writes).

    The entry point of ``python -m flowtrain.parallel.worker flowtrain.train.jobs:train_worker JOB``: the
    job crosses the process boundary as JSON, the result comes back as ``model.pt`` and ``fit.json``.
    """
    from flowtrain.train.loader import TabularDataset
    from flowtrain.train.plan import TrainConfig

    cfg = dict(job["config"])
    cfg["hidden"] = tuple(cfg["hidden"])
    if ctx.distributed:
        cfg["threads"] = None  # the launcher (or torchrun's environment) sets threads per worker
    train(ctx, TabularDataset(job["dataset"]), TrainConfig(**cfg), Path(job["run_dir"]), model=job.get("model"),
          resume=bool(job.get("resume")))


#: --worker-memory: ``fit`` caps this worker once its data is open (``flowtrain.parallel.launch.cap_worker``): what
#: reading the splits maps (the reader's threads, its allocator's reservations) is a worker's fixed overhead
train_worker.caps_after_setup = True


def train(ctx, data, config, run_dir: Path, *, model: str | None = None, resume: bool = False):
    """Fit a model (``--model MODULE:FACTORY`` or the default family) on ``data`` and return the
    ``FitResult``: in one process the caller takes it as it is. Rank 0 also writes ``model.pt`` and
    ``fit.json`` (whole or not at all): the run's outputs, and the result of a worker group."""
    import torch

    from flowtrain.train.loop import fit
    from flowtrain.train.models import build_run_model

    # built on the meta device (flowtrain.parallel.deferred): the engine makes its values, ZeRO-3 only its slices
    result = fit(build_run_model(model, data, config, deferred=True), data, config, run_dir=run_dir,
                 resume=resume or restarted_with_checkpoint(run_dir), ctx=ctx)
    from connectors.atomic import atomic_file, atomic_write
    files = RunFiles(run_dir)
    if result.write_model is not None:  # ZeRO-3: no rank holds the whole model; rank 0 writes it streamed
        result.write_model(files.model, ctx.is_main)
    elif ctx.is_main:  # written whole or not at all (tmp, fsync, rename)
        with atomic_file(files.model) as fh:
            torch.save(result.model.state_dict(), fh)
    if ctx.is_main:
        atomic_write(files.fit, json.dumps(fit_record(result)))
    return result


def fit_record(result) -> dict:
    """What ``fit.json`` holds of a ``FitResult``."""
    return {"steps": result.steps, "epochs_run": result.epochs_run, "best_epoch": result.best_epoch,
            "stopped_early": result.stopped_early, "seconds": result.seconds,
            "data_wait_fraction": result.data_wait_fraction, "best_valid": result.best_valid}


#: Set by torchrun's elastic agent (and by ``flowtrain batch --max-restarts``) in a restarted worker group.
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"


def restarted_with_checkpoint(run_dir: Path) -> bool:
    """Under torchrun ``--max-restarts``, a restarted worker group (``TORCHELASTIC_RESTART_COUNT`` > 0)
    continues from the run's last checkpoint, when one exists, instead of training again from the start."""
    import os

    if int(os.environ.get(RESTART_ENV, "0") or 0) == 0:
        return False
    from flowtrain.train import checkpoint

    return checkpoint.latest(RunFiles(run_dir).checkpoints, run_id=run_id_of(run_dir)) is not None


def stream_trainer_worker(ctx, job: dict) -> None:
    """Run the online stream trainer on every data-parallel rank (``flowtrain stream train --workers N``).

    The process's entry: SIGTERM (the launcher's graceful stop) or SIGINT asks the trainer to stop;
    the replicas agree on the stop at the next step and write a final checkpoint together.
    """
    import signal
    import threading

    from flowtrain.train.stream.config import StreamTrainConfig
    from flowtrain.train.stream.online import run_stream_trainer

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    from connectors.secrets import secrets_from_env

    config = dict(job["config"])  # the secret client settings come from the parent's environment, not job.json
    config["kafka"] = {**config["kafka"], "config": {**config["kafka"].get("config", {}), **secrets_from_env()}}
    summary = run_stream_trainer(StreamTrainConfig(**config), ctx, should_stop=stop.is_set)
    if ctx.is_main:
        print(stream_summary_line(summary), flush=True)


def stream_summary_line(summary: dict) -> str:
    return (f"stream train: stopped at step {summary['step']} (model version {summary['version']}), "
            f"{summary['rows']:,} rows trained ({summary['rows_per_s']:,.0f} rows/s from first to last message), "
            f"{summary['dropped_duplicates']:,} duplicate rows dropped, "
            f"{sum((summary.get('rejected') or {}).values()):,} feature message(s) rejected (dead letters)")

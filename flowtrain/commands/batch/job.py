"""The batch job: Beam ETL -> dataset directory -> training -> report -> bundle, in one run directory
(its files: ``batch_options.RUN_DIRECTORY``, the epilog of ``flowtrain batch --help``).

``run_batch(BatchJob(...))`` is what ``flowtrain batch`` and ``flowtrain.batch(...)`` run.
"""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from connectors.atomic import atomic_file, atomic_write
from connectors.fields import build, check, to_config
from connectors.paths import is_url
from connectors.secrets import redact
from flowtrain.commands.batch.etl import build_dataset
from flowtrain.commands.batch.frame import check_paths, is_frame, write_frame
from flowtrain.commands.batch.options import BatchJob, training_flags
from flowtrain.commands.batch.report import report_run
from flowtrain.commands.dead_letter_bound import check_dead_letters
from flowtrain.commands.tracking_options import check_tracking
from flowtrain.commands.user_errors import user_error, user_errors
from flowtrain.errors import FlowtrainError
from flowtrain.parallel import DistContext
from flowtrain.parallel.device import backend_for, resolve_device
from flowtrain.parallel.launch import WorkerFailure, spawn
from flowtrain.parallel.memcap import mechanism
from flowtrain.train.baselines import fit_linear
from flowtrain.train.bundle import bundle_key as read_bundle_key
from flowtrain.train.checkpoint import CheckpointError, require_latest
from flowtrain.train.class_weights import class_weights_of
from flowtrain.train.evaluation import check_slice_by
from flowtrain.train.jobs import RESTART_ENV, fit_record, train
from flowtrain.train.loader import TabularDataset
from flowtrain.train.loop import check_label, positive_class_line
from flowtrain.train.memory_plan import fits_line, plan_memory, worker_overhead_bytes
from flowtrain.train.metrics import check_select_by
from flowtrain.train.models import (
    build_run_model,
    check_factory_parallelism,
    choose_ensemble,
    choose_numeric_embedding,
    recipe_line,
    train_rows,
)
from flowtrain.train.plan import plan_training, train_config
from flowtrain.train.rundir.files import RunFiles, usable_dir
from flowtrain.train.rundir.rules import prepare_run_dir
from flowtrain.train.shards import memory_budget_bytes
from flowtrain.train.staging import publish_run, staged_dir
from pipelines.tabular.preflight import check_splits


def train_with_restarts(run_group, max_restarts: int) -> None:
    """``run_group(attempt)`` (a local worker group), run again after a ``WorkerFailure`` up to
    ``max_restarts`` times: attempt k > 0 is a restarted group (``TORCHELASTIC_RESTART_COUNT=k``,
    as torchrun's elastic agent sets it), which resumes from the run's last checkpoint. After the
    last allowed failure, a ``WorkerFailure`` naming every failure in order."""
    failures: list[WorkerFailure] = []
    for attempt in range(max_restarts + 1):
        try:
            run_group(attempt)
            return
        except WorkerFailure as err:
            failures.append(err)
            if attempt == max_restarts:
                break
            print(f"train: worker rank {err.rank} {err.cause}; restarting the worker group from the last "
                  f"checkpoint (restart {attempt + 1} of {max_restarts})", flush=True)
    last = failures[-1]
    if len(failures) == 1:
        raise last
    history = "; ".join(f"{i + 1}) rank {f.rank} {f.cause}" for i, f in enumerate(failures))
    raise WorkerFailure(last.rank, f"{last.cause}; the job failed {len(failures)} times, more than --max-restarts "
                                   f"{max_restarts} allows: {history}",
                        last.log_tail)


def run_batch(job: BatchJob) -> dict:
    """The whole batch job; returns the summary (also written to summary.json). A user's error (bad option,
    input, dataset, run directory, a failed worker) is a ``FlowtrainError`` with a one-line message."""
    job = check(job)
    prepared: list = []  # the run directory, once prepare_run_dir made it this run's

    with ExitStack() as stack:
        stage = None
        if is_url(job.out):  # an object store: the run works in a local copy, published write-then-mark
            if job.job_only:
                raise FlowtrainError(f"--job-only: --out {job.out} is on an object store, but torchrun's hosts "
                                     f"need a run directory they all read and write: give a shared (mounted) --out")
            stage = stack.enter_context(staged_dir(job.out, "--out"))
            job = dataclasses.replace(job, out=str(stage.local))
        try:
            summary = _run_batch(job, prepared, stage)
        except BaseException as err:
            shown = user_error(err) if isinstance(err, user_errors()) else err
            if prepared:  # run.json says "failed" and why: a rerun after a failure that left no model replaces it
                prepared[0].fail(shown)
            if stage is not None:
                shown = stage.failed(shown, published=bool(prepared))
            if shown is not err:
                raise shown from err
            raise
        return publish_run(stage, summary) if stage is not None else summary


def run_batch_options(options: dict[str, Any]) -> dict:
    """``flowtrain.batch(**options)``: the job of the keyword options, run. ``input`` may be a pandas DataFrame or
    a pyarrow Table (``batch.frame``: a temporary Parquet file the ETL reads, removed after the run)."""
    table = options.get("input")
    if is_frame(table):
        with tempfile.TemporaryDirectory(prefix="flowtrain-input-") as tmp:
            return run_batch(build(BatchJob, {**options, "input": [write_frame(table, tmp)]}))
    check_paths(table)
    return run_batch(build(BatchJob, options))


def _check_resumable(run_dir: Path) -> None:
    """--resume needs a loadable checkpoint: none, or all corrupt, is an error, never a fresh start."""
    try:
        require_latest(RunFiles(run_dir).checkpoints)
    except CheckpointError as err:
        raise FlowtrainError(f"--resume: {err}; check --out, or leave out --resume to start the run over") from None


def run_directory(job: BatchJob) -> Path:
    return usable_dir(job.out or f"runs/batch-{time.strftime('%Y%m%d-%H%M%S')}").resolve()


def _run_batch(job: BatchJob, prepared: list, stage=None) -> dict:
    t0 = time.perf_counter()

    bundle_key = read_bundle_key(job.bundle_key_file)  # a bad key file fails now, not after training
    check_tracking(job)  # --mlflow without MLflow: now, not after training

    # --device (and a GPU per local worker): an error before the ETL, not after it (checked again below)
    resolve_device(job.device, local_world=1 if job.job_only else job.workers * job.stages * job.tensor_parallel)
    run_dir = run_directory(job)
    resume = job.resume

    # the run-directory rules (docs/runs.md): a used --out only with --resume (same run) or --overwrite
    run = prepare_run_dir(run_dir, to_config(job), resume=resume, overwrite=job.overwrite)
    prepared.append(run)
    files = run.files
    if stage is not None:  # the remote run.json says "running" before anything of an earlier run is deleted
        stage.push(marker_first=True)
        stage.start_publishing()  # its dataset and checkpoints as they appear: a killed run resumes from the store
    if run.note:
        print(run.note, flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)

    # --- 1. ETL (or an existing dataset) -----------------------------------------------------------
    dataset_path, title = build_dataset(job, run_dir, resume=resume)

    # --- 2. training ---------------------------------------------------------------------------------
    data = TabularDataset(dataset_path)
    counts = data.manifest.get("counts") or {}  # more dead letters than --max-dead-letter-fraction: no training
    check_dead_letters(int(counts.get("in", 0)), int(counts.get("dead_letters", 0)), job.max_dead_letter_fraction,
                       what="rows", where=str(files.dead_letters) if not job.dataset else
                       f"the dead letters of {dataset_path}", reasons="; ".join(
                           f"{r} ({n:,})" for r, n in sorted((counts.get("dead_letters_by_reason") or {}).items(),
                                                            key=lambda kv: -kv[1])[:3]))
    try:
        check_label(data)
        if positive_class_line(data):  # a binary label: which class is positive, and why (once)
            print(positive_class_line(data), flush=True)

        check_slice_by(job.slice_by, list(data.spec.categorical))  # before training, not after
        class_weights_of(job, data)  # --class-weight naming no class of the label: now, not in the workers
    except ValueError as err:
        raise FlowtrainError(str(err)) from None
    given_recipe = {"ensemble": job.ensemble, "numeric_embedding": job.numeric_embedding}  # the report step's flags
    if not job.model and (job.ensemble is None or job.numeric_embedding is None):  # the recipe chosen from the
        rows = train_rows(data)  # table, recorded in config.json (docs/models.md)
        job = dataclasses.replace(job, ensemble=choose_ensemble(rows) if job.ensemble is None else job.ensemble,
                                  numeric_embedding=choose_numeric_embedding(rows) if job.numeric_embedding is None
                                  else job.numeric_embedding)
        print(f"model: {recipe_line(job.ensemble, job.numeric_embedding)} (for {rows:,} training rows; --ensemble "
              f"and --numeric-embedding set them)", flush=True)
    config = train_config(job)

    try:
        memory_budget_bytes(config.memory_budget)  # a malformed --memory-budget fails here, named
        check_select_by(config.select_by, data.kind)  # --select-by that does not fit the task: now
    except ValueError as err:
        raise FlowtrainError(str(err)) from None

    workers = job.workers * config.stages * config.tensor_parallel  # replicas x stages x tensor shards
    # --device (and a GPU for each local worker): an error now, before any training
    device = resolve_device(config.device, local_world=1 if job.job_only else workers)

    check_splits(data.manifest)  # an empty split (the column, its range and the cutoffs), or one that weighs nothing
    if job.model:
        check_factory_parallelism(job.model, data, config)  # a bad factory or --stages with a non-Sequential: now
    if job.print_plan or job.worker_memory:  # the memory plan per rank: printed, or a stop before training
        # a worker's fixed overhead (interpreter, torch, flowtrain, the dataset): measured before the probe
        # model is built here, or its parameters would be counted twice (once as overhead, once as state)
        overhead = worker_overhead_bytes(data)  # with the splits open, as a worker is when it is capped
        probe = build_run_model(job.model, data, config, deferred=True)  # its shapes: on the meta device, no memory
        batch_size = plan_training(config, int(data.manifest["rows"]["train"]), data.kind).batch_size
        dtype = {"float32": torch.float32, "float64": torch.float64}[config.dtype]
        mem = plan_memory(probe, workers=job.workers,
                          shard_states=config.shard_states if job.workers > 1 else "none", stages=config.stages,
                          tensor_parallel=config.tensor_parallel, bucket_mb=config.bucket_mb, batch_size=batch_size,
                          id_rows=int(data.manifest["rows"]["train"]),  # ID tables without --max-ids: an upper bound
                          dtype=dtype, keeps_best=True)
        if job.print_plan:
            print(mem.describe(), flush=True)
            return {"run_dir": str(run_dir), "memory_plan": mem.as_dict()}
        stop = fits_line(mem, probe, int(job.worker_memory * 2**30), overhead=overhead,
                         batch_size=batch_size, id_rows=int(data.manifest["rows"]["train"]), dtype=dtype,
                         bucket_mb=config.bucket_mb, keeps_best=True)
        if stop:
            raise FlowtrainError(stop)

        print(f"{mem.describe()}; each worker capped at {job.worker_memory:g} GiB by {mechanism()}", flush=True)
    # The linear baseline, fitted to convergence on the same features; the model's linear (wide)
    # part starts from it, so the model starts where its baseline ends.

    linear = fit_linear(data, seed=config.seed, memory_budget=config.memory_budget,
                        class_weights=class_weights_of(config, data))  # --class-weight: the linear start weighed too

    with atomic_file(files.linear) as fh:  # final outputs: whole or not at all
        torch.save(linear.model.state_dict(), fh)
    print(f"linear: fitted to convergence by L-BFGS ({linear.iterations} iterations, gradient norm "
          f"{linear.grad_norm:.1e}, L2 {linear.l2:.2e}, {linear.seconds:.1f} s)", flush=True)
    if not job.model:  # the network starts at its linear start, and its weight decay keeps that one's penalty
        config = dataclasses.replace(config, init_wide=str(files.linear),
                                     weight_decay=2 * linear.l2 if job.weight_decay is None else job.weight_decay)
    elif job.weight_decay is not None:
        config = dataclasses.replace(config, weight_decay=job.weight_decay)
    atomic_write(files.config, json.dumps(redact(to_config(job)), indent=1) + "\n")  # no secrets
    job_dict = {"dataset": str(dataset_path), "run_dir": str(run_dir), "resume": resume, "model": job.model,
                "config": {k: (list(v) if isinstance(v, tuple) else v)
                           for k, v in dataclasses.asdict(config).items()}}
    if job.job_only:
        job_path = files.job
        atomic_write(job_path, json.dumps(redact({**job_dict, "failure_timeout_s": job.failure_timeout})))
        print(f"job: {job_path}\nrun on every node (node-rank 0..N-1; the dataset and run directory on a shared "
              f"filesystem):\n  torchrun --nnodes=N --nproc-per-node=1 --node-rank=I --master-addr=NODE0 "
              f"--master-port=29500 -m flowtrain.parallel.worker flowtrain.train.jobs:train_worker {job_path}\n"
              f"then the report: flowtrain batch --dataset {dataset_path} --out {run_dir} --resume"
              f"{training_flags(dataclasses.replace(job, **given_recipe))}", flush=True)  # chosen again, the same
        run.release()  # the nodes' workers and the report step (other processes) take the directory next
        return {"run_dir": str(run_dir), "job": str(job_path)}
    if workers > 1 or job.worker_memory:  # --worker-memory caps spawned workers (also one), never this process
        layout = (f"{job.workers} replica(s) x {config.stages} pipeline stage(s) x {config.tensor_parallel} "
                  f"tensor shard(s)" if workers > job.workers else f"{workers} data-parallel workers")
        print(f"train: {layout} on 127.0.0.1 ({device.type}, {backend_for(device)}), "
              f"{max(1, (os.cpu_count() or 1) // workers)} threads each", flush=True)

        train_with_restarts(lambda attempt: spawn(
            workers, "flowtrain.train.jobs:train_worker", job_dict, failure_timeout_s=job.failure_timeout,
            workdir=files.workers, extra_env={RESTART_ENV: str(attempt)},
            memory_cap=int(job.worker_memory * 2**30) if job.worker_memory else None), job.max_restarts)
        fitted = json.loads(files.fit.read_text())  # the worker group's result: its files
        model = build_run_model(job.model, data, config)
        model.load_state_dict(torch.load(files.model, weights_only=True))
        training = json.loads(files.training.read_text()) if files.training.exists() else {}
    else:  # one process: the fit result in memory (model.pt, fit.json, training.json are outputs only)
        result = train(DistContext(), data, config, run_dir, model=job.model, resume=resume)
        fitted, model = fit_record(result), result.model
        training = {"select_by": result.plan.select_by, "best_step": result.best_step,
                    "plan": dataclasses.asdict(result.plan), "memory": result.memory}

    # --- 3. baselines on the same data, test metrics, report, bundle ------------------------------------

    summary = report_run(run_dir, data, title=title, dataset_path=dataset_path, config=config, model=model,
                         linear=linear, fitted=fitted, training=training, workers=workers, slice_by=job.slice_by,
                         factory=job.model, bundle_key=bundle_key, t0=t0)
    run.complete()  # last: a run.json that says "running" is a run that crashed, failed or goes on
    if job.mlflow:  # the finished run, its report, bundle and registered model (flowtrain[mlflow])
        from flowtrain.commands.mlflow_tracking import log_batch_run  # the extra, only when asked

        summary["mlflow_run_id"] = log_batch_run(job.mlflow, run_dir, experiment=job.mlflow_experiment,
                                                 model_name=job.mlflow_model)
        # summary.json again, with the MLflow run's id (as flowtrain.train.report.write_summary writes it)
        atomic_write(files.summary, json.dumps(summary, indent=2, default=float))
        print(f"mlflow: run {summary['mlflow_run_id']} in {job.mlflow}", flush=True)
    key = {"binary": "auc", "multiclass": "accuracy", "regression": "rmse"}[data.kind]
    print(f"test {key}: model {summary['test']['model'][key]:.4f}, "
          + ", ".join(f"{n} {m[key]:.4f}" for n, m in summary["test"]["baselines"].items()))
    return summary

"""``flowtrain stream train`` as a Python call: the online trainer of a ``StreamTrainJob``.

``run_stream_train(job)`` trains until ``should_stop()`` (or the job's ``idle_exit``) with one process, or
``job.workers`` replicas (x ``job.stages`` x ``job.tensor_parallel``: the engine's grid) in their own
processes. The command line installs the signal handlers (Ctrl-C / SIGTERM: a final checkpoint, then the
end) and passes their flag as ``should_stop``.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Collection
from dataclasses import asdict
from pathlib import Path

from connectors.fields import options_of, to_config
from connectors.kafka import Topics
from connectors.secrets import SECRETS_ENV, split_secrets
from flowtrain.commands.kafka_options import kafka_target
from flowtrain.commands.stream.inputs import dataset_path
from flowtrain.commands.stream.options import StreamTrainJob, with_dataset_topics
from flowtrain.commands.tracking_options import check_tracking
from flowtrain.parallel.launch import spawn
from flowtrain.train.stream.config import StreamTrainConfig, initial_weights
from flowtrain.train.stream.online import run_stream_trainer


def stream_train_config(job: StreamTrainJob, given: Collection[str] = ()):
    """The engine's ``StreamTrainConfig`` of ``job``: its trainer options as they are, and the rest resolved. With
    ``init_weights`` the architecture is the batch run's: a ``hidden``/``dropout``/``seed`` named in ``given`` (the
    options the user set) must agree with it, else a ``ValueError`` naming them."""
    job = with_dataset_topics(job)  # topics left unset: named after the dataset
    # its own options (StreamTrainOptions) as they are; --out is its run directory, the dataset and Kafka resolved
    cfg = StreamTrainConfig(**{opt.name: getattr(job, opt.name) for opt in options_of(StreamTrainConfig)},
                            run_dir=job.out, dataset_dir=dataset_path(job), kafka=kafka_target(job),
                            topics=Topics(raw=job.raw_topic, features=job.features_topic,
                                          dead_letters=job.dead_letter_topic, updates=job.updates_topic))
    if cfg.init_weights and any(k in given for k in ("hidden", "dropout", "seed")):
        arch, _ = initial_weights(cfg)
        mine = {"hidden": tuple(cfg.hidden), "dropout": cfg.dropout, "seed": cfg.seed}
        theirs = {"hidden": arch.hidden, "dropout": arch.dropout, "seed": arch.seed}
        clash = [f"--{k} {_show(mine[k])} (the run has {_show(theirs[k])})" for k in mine
                 if k in given and mine[k] != theirs[k]]
        if clash:
            raise ValueError(f"--init-weights {cfg.init_weights}: the architecture comes from {arch.source}, which "
                             f"disagrees with {', '.join(clash)}; leave those options out")
    return cfg


def _show(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def run_stream_train(job: StreamTrainJob, *, given: Collection[str] = (),
                     should_stop: Callable[[], bool] | None = None) -> dict | None:
    """Run the online trainer of ``job``; returns its summary (one process), or None after the ``job.workers`` x
    ``job.stages`` x ``job.tensor_parallel`` > 1 processes ended. ``ValueError``: a bad option, topic, checkpoint or
    weights (one line naming it); ``flowtrain.parallel.launch.WorkerFailure``: a process died or stalled."""
    tracked = getattr(job, "mlflow", None)  # stream train's --mlflow (the whole `flowtrain stream` job has none)
    if tracked:
        check_tracking(job)  # MLflow missing: an error before training
    cfg = stream_train_config(job, given)
    summary = _train(job, cfg, should_stop)
    if tracked:  # the run, its prequential metrics and its newest version as a registered model
        from flowtrain.commands.mlflow_tracking import log_stream_run

        run_id = log_stream_run(job.mlflow, Path(job.out), config=to_config(job), dataset=cfg.dataset_dir,
                                experiment=job.mlflow_experiment, model_name=job.mlflow_model)
        print(f"mlflow: run {run_id} in {job.mlflow}", flush=True)
    return summary


def _train(job: StreamTrainJob, cfg, should_stop: Callable[[], bool] | None) -> dict | None:
    processes = job.workers * job.stages * job.tensor_parallel  # replicas x pipeline stages x tensor shards
    if processes > 1:
        # secrets reach the replicas through their environment, never job.json or a command line
        public, secret = split_secrets(cfg.kafka.config)
        config = asdict(cfg)
        config["kafka"]["config"] = public
        spawn(processes, "flowtrain.train.jobs:stream_trainer_worker", {"config": config}, failure_timeout_s=job.failure_timeout,
              workdir=Path(job.out) / "workers", stop=should_stop,
              extra_env={SECRETS_ENV: json.dumps(secret)} if secret else None)
        return None

    return run_stream_trainer(cfg, should_stop=should_stop)

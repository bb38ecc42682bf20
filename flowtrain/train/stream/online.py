"""The online trainer: consumes Arrow feature batches from Kafka and trains, exactly once.

For each feature message (one Arrow record batch, in offset order per partition) it first
evaluates the current model on the rows, then trains on them (prequential metrics, with the
task's metrics: BCE/AUC for classification, RMSE/MAE for regression). Every K steps or T seconds
it writes a checkpoint holding the model, its architecture, the optimizer, the step, the RNG,
every replica's Kafka positions *and* the seen-source state, then publishes the model version
(the checkpoint plus a record on the model-updates topic).

Exactly once: positions come only from the checkpoint, never from group commits, so after a
crash the trainer resumes exactly where the model it restores had got to: work after the
checkpoint is redone from the same state, nothing is lost and nothing counts twice. The
pipeline upstream is at least once (it may write a row again after its own crash); each row
carries its source (raw partition, offset), and since the pipeline writes a raw partition's rows
in offset order to one feature partition, the seen-source state is one number per raw partition
(the highest offset trained): bounded, and inside the checkpoint. A checkpoint directory whose
checkpoints are all corrupt is an error, never a fresh start (that would train every row again).

Data parallel (``--workers N``): the feature partitions are split across the replicas and
gradients are reduced by the map/reduce engine. Every decision that ends in a collective is
taken together: each step one small all-reduce carries every replica's "has data", "asked to
stop", "idle for idle_exit" and "checkpoint time is due" flags, so all replicas stop, or
checkpoint (a gather), at the same step; the step count itself comes from the reduced example
count, identical everywhere. The loop heartbeats for the launcher every step, idle or not.

The trainer is a source, the engine and sinks: ``stream_source.FeatureSource`` (this replica's
feature messages, checked, without rows already trained; positions and seen sources),
``trainer.Trainer`` (the step), ``checkpoint_manager.CheckpointManager`` (what a checkpoint holds of the
model and its engine, as a batch run's: this trainer adds its version, positions and counts), ``stream_sinks``
(published versions, the ledger, the status file) and ``prequential`` (the metrics and their plot);
``stream_config`` holds the options and the model it starts from (``init_weights``' batch run, else the
options; a resumed run its own checkpoint).

Stopping is the caller's business: ``should_stop`` is polled every step (the command line
connects it to SIGINT/SIGTERM); the trainer installs no signal handlers.
"""
from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from kafka.errors import KafkaError

from connectors.fields import check
from connectors.kafka import KafkaUnavailable, check_brokers, describe_error
from flowtrain.observe.board import Board
from flowtrain.parallel import DistContext, sum_loss
from flowtrain.parallel.device import cpu_state, local_world_size, move_batch, resolve_device
from flowtrain.parallel.grid import Grid
from flowtrain.parallel.launch import heartbeat
from flowtrain.train import checkpoint
from flowtrain.train.checkpoint_manager import CheckpointManager, saved_stage_bounds
from flowtrain.train.class_weights import class_weights_of
from flowtrain.train.id_fallbacks import IdFallbacks
from flowtrain.train.ids.publish import IdPublisher, published_tables
from flowtrain.train.loader import Batch, TabularDataset, target_scale
from flowtrain.train.metrics import MetricsLog
from flowtrain.train.prequential import plot_prequential, prequential_metrics
from flowtrain.train.published import new_run_id
from flowtrain.train.replicas import all_agree, gather, gather_dict, gather_list, sum_counts
from flowtrain.train.rundir.files import RunFiles
from flowtrain.train.stream.config import NonFiniteModel, StreamTrainConfig, starting_model, weights_finite
from flowtrain.train.stream.rejects import InputRejects, StoppedWaiting
from flowtrain.train.stream.sinks import STOP_KAFKA_S, Ledger, VersionSink, write_status
from flowtrain.train.stream.source import FeatureSource
from flowtrain.train.trainer import Trainer, loss_function


class StreamTrainer:
    """The online trainer's state and its steps; ``run()`` reads top to bottom."""

    def __init__(self, cfg: StreamTrainConfig, ctx: DistContext | None = None, *,
                 should_stop: Callable[[], bool] | None = None):
        cfg = check(cfg)  # the options' ranges and choices (connectors.fields: as the command line checks them)
        self.cfg, self.ctx = cfg, ctx or DistContext()
        self.should_stop = should_stop or (lambda: False)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.device = resolve_device(cfg.device, local_rank=self.ctx.local_rank, local_world=local_world_size())
        self.run_dir = Path(cfg.run_dir)
        self.ckpt_dir = RunFiles(self.run_dir).checkpoints
        self.ledger = Ledger(RunFiles(self.run_dir).ledger, kept=cfg.ledger and self.ctx.is_main)
        # rank 0's metrics.jsonl, mirrored to TensorBoard (<out>/tensorboard: prequential/*, stream/*)
        self.log = MetricsLog(RunFiles(self.run_dir).metrics, board=Board(self.run_dir) if self.ctx.is_main else None)
        self.data = TabularDataset(cfg.dataset_dir)
        self.task = self.data.spec.task
        # the engine's grid: one rank of each replica (stage 0, tensor shard 0) reads that replica's feature
        # partitions; the other ranks of the replica get its rows from the engine's global batch
        pos = Grid.from_world(self.ctx.world_size, stages=cfg.stages, tensor=cfg.tensor_parallel).position(self.ctx.rank)
        spec = self.data.spec  # no rows: the shapes of a batch (the grid measures its layers on 256 of them)
        self.sample = Batch(torch.zeros(256, self.data.n_numeric),
                            torch.zeros(256, len(spec.categorical) + len(spec.id_columns), dtype=torch.int64),
                            torch.zeros(256), torch.zeros(256) if spec.weight_column else None)
        # K classes: cross-entropy over K logits; --class-weight: each example weighed by its class; the dataset's
        # --weight-column: by the weight its events carry (the feature messages' ``weight`` column)
        self.loss_fn = loss_function(self.task, self.data.outputs, class_weights_of(cfg, self.data),
                                     sample_weights=bool(spec.weight_column))
        self.shift, self.scale = target_scale(self.data)  # regression trains on a standardized target
        # progress: restored from the checkpoint, never from Kafka's group offsets
        self.step = self.version = 0
        self.rows_trained = 0
        # the source: this replica's feature messages, checked; positions and seen sources (the exactly-once state)
        self.source = FeatureSource(cfg, self.data, reader=pos.stage == 0 and pos.tensor == 0, replica=pos.replica,
                                    replicas=pos.replicas, should_stop=self.should_stop)
        self.rejects = InputRejects(cfg.kafka.bootstrap, cfg.kafka.config, features_topic=cfg.topics.features,
                                    dead_letter_topic=cfg.topics.dead_letters,
                                    replication_factor=cfg.kafka.replication_factor)
        self.rejected_total: dict[str, int] = {}  # every replica's counts, summed at each checkpoint and the end
        # rows trained whose ID value had no key, so used the fallback vector (summed at each checkpoint)
        self.id_fallbacks = IdFallbacks(self.data.spec.id_columns)
        self.pending_ledger: list[tuple[int, int]] = []
        self.window: list[tuple[np.ndarray, np.ndarray]] = []  # prequential (outputs, labels) since the last log
        self.steps_since_ckpt = 0
        self.last_loss: float | None = None
        now = time.monotonic()
        self.last_ckpt_t = self.last_data_t = self.last_status_t = now
        self.first_data_t: float | None = None
        self.model = self.trainer = self.architecture = None
        self.sharded_ids = False  # ID tables sharded row-wise over the replicas (--workers N with ID columns)
        self.run_id = new_run_id()  # a resumed run keeps its checkpoint's: versions are numbered per run
        # rank 0 publishes the versions: their files (<run_dir>/published) and records on the updates topic
        self.versions = VersionSink(cfg, self.run_dir, self.should_stop) if self.ctx.is_main else None
        self.id_publisher: IdPublisher | None = None  # a model with ID tables: made at this process's first version

    # --- the whole run ------------------------------------------------------------------------------
    def run(self) -> dict:
        """Train until ``should_stop``, ``idle_exit`` or ``max_steps``; returns a summary."""
        missing = [f"--{flag}-topic" for role, flag in (("features", "features"), ("updates", "updates"),
                                                         ("dead_letters", "dead-letter"))
                   if not getattr(self.cfg.topics, role)]
        if missing:
            raise ValueError(f"the stream trainer needs its topics: {', '.join(missing)} (the command names them after "
                             f"the dataset)")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            restored = self._restore()
            self._open_kafka()
            self.last_data_t = self.last_ckpt_t = time.monotonic()  # idle and checkpoint clocks start with the loop
            while True:
                local = self._poll_local_batch()
                agreed = self._agree(has_data=local is not None)
                if agreed["any_data"]:
                    self._train_step(local)
                heartbeat()
                if self._should_end(agreed):
                    # nothing trained since the last version: re-saving it would rewrite that
                    # version's file (named by step) under a new version number
                    if self.steps_since_ckpt or self.version == 0 or agreed["rejects_pending"]:
                        if not agreed["stop"] or self._brokers_answer():
                            self._checkpoint_unless_stopped("final")
                        else:  # a stop is honoured whatever Kafka does (issue 28 item 15)
                            self._not_checkpointed(f"did not answer within {STOP_KAFKA_S:g} s")
                    # every replica's rejections, summed (the same step on every replica: a collective)
                    self.rejected_total = sum_counts(gather(self.ctx, dict(self.rejects.counts)))
                    self.id_fallbacks.commit(self.ctx)
                    break
                self._write_status_every_second()
                if (self.steps_since_ckpt and (self.steps_since_ckpt >= self.cfg.checkpoint_every
                                               or agreed["checkpoint_due"])) \
                        or (agreed["rejects_pending"] and agreed["checkpoint_due"]):  # only rejected messages
                    if not self._checkpoint_unless_stopped("periodic"):
                        break
        finally:
            self.close()
        busy = (self.last_data_t - self.first_data_t) if self.first_data_t else 0.0
        return {"step": self.step, "version": self.version, "rows": self.rows_trained,
                "dropped_duplicates": self.source.dropped, "rows_per_s": self.rows_trained / busy if busy > 0 else 0.0,
                "rejected": self.rejected_total, "id_fallbacks": self.id_fallbacks.base,
                "resumed_from": restored, "architecture": self.architecture.to_dict()}

    # --- state: from the last checkpoint only ------------------------------------------------------------
    def _restore(self) -> str | None:
        """Model, optimizer and positions from the newest loadable checkpoint (a corrupt newest one
        falls back to the one before); else the initial weights. Returns the checkpoint's name."""
        found = None
        if checkpoint.all_checkpoints(self.ckpt_dir):  # all of them corrupt: an error, not a fresh start
            found = checkpoint.require_latest(self.ckpt_dir)
        self.architecture, self.model = starting_model(self.cfg, self.data, self.device, found)
        # the engine reads the config's parallel options and lr; a resumed grid keeps its checkpoint's stage cut
        # (rank 0 cuts by measured time, which varies)
        bounds = saved_stage_bounds(found[1], self.cfg.stages) if found is not None else None
        # every replica starts from rank 0's weights; a step whose gradient is not finite changes nothing
        self.trainer = Trainer(self.model, self.ctx, replace(self.cfg, stage_bounds=bounds), self.loss_fn, self.sample,
                               seed=self.architecture.seed, target_scale=(self.shift, self.scale), local_batches=True,
                               skip_non_finite=True)
        # with ID columns on N replicas each owns the rows of its keys (flowtrain.train.ids): every lookup is a
        # collective, and a checkpoint holds each table whole (so any --workers resumes it)
        self.sharded_ids = bool(getattr(self.model, "sharded", False))
        # what a checkpoint holds of the model and its engine (flowtrain.train.checkpoint_manager); the trainer adds
        # its progress: the version, positions, seen sources, rejections and dead-letter ends
        self.checkpoints = CheckpointManager(self.ckpt_dir, self.model, self.trainer.engine, writer=self.ctx.is_main,
                                             world_size=self.ctx.world_size, shard_states=self.cfg.shard_states)
        if found is None:
            self.rejects.restore(None, self.run_dir, is_main=self.ctx.is_main)
            self.ledger.drop_after(0)
            if self.ctx.is_main and self.log.path.exists():
                self.log.truncate_after(0)
            return None
        path, state = found
        self.checkpoints.restore(path, state, option="stream train", fix="restore the run's own checkpoint, or start "
                                 "a new run in another --out")
        self.step, self.version = int(state["step"]), int(state["version"])
        self.run_id = str(state.get("run_id") or self.run_id)
        self.source.restore(state)
        self.id_fallbacks.restore(state)
        self.rejects.restore(state, self.run_dir, is_main=self.ctx.is_main)
        self.ledger.drop_after(self.version)
        if self.ctx.is_main and self.log.path.exists():
            self.log.truncate_after(self.step)
        if self.ctx.is_main:
            print(f"stream train: resumed from {path.name} (version {self.version}, step {self.step}, positions "
                  f"{self.source.positions})", flush=True)
        return path.name

    def _open_kafka(self) -> None:
        partitions = self.source.open()
        heartbeat()
        self.rejects.open(partitions, self.run_dir, is_main=self.ctx.is_main,
                          progress=heartbeat, should_stop=self.should_stop)
        if self.ctx.distributed:  # no replica rejects a message before rank 0 noted where the dead letters start
            import torch.distributed as dist

            dist.barrier()
        if self.ctx.is_main:
            self.versions.open()

    # --- one step ---------------------------------------------------------------------------------------------
    def _poll_local_batch(self):
        """At most one feature message of this replica's partitions, without rows already trained."""
        msg = self.source.poll()
        if msg is None:
            return None
        self.last_data_t = time.monotonic()
        self.first_data_t = self.first_data_t or self.last_data_t
        return self.source.fresh_rows(msg, self.rejects)

    def _agree(self, *, has_data: bool) -> dict:
        """Every replica's flags, reduced: the decisions below are the same on every replica."""
        now = time.monotonic()
        idle = self.cfg.idle_exit is not None and now - self.last_data_t >= self.cfg.idle_exit
        flags = torch.tensor([float(has_data), float(bool(self.should_stop())), float(idle),
                              float(now - self.last_ckpt_t >= self.cfg.checkpoint_seconds),
                              float(bool(self.rejects.pending))], dtype=torch.float64, device=self.device)
        if self.ctx.distributed:
            import torch.distributed as dist

            dist.all_reduce(flags)
        any_data, stop, idle_count, due, rejected = flags.tolist()  # one device-to-host copy
        # rejects_pending: a rejected message's position is not checkpointed yet (a checkpoint moves it)
        return {"any_data": any_data > 0, "stop": stop > 0, "all_idle": idle_count >= self.ctx.world_size,
                "checkpoint_due": due > 0, "rejects_pending": rejected > 0}

    def _train_step(self, local) -> None:
        """Evaluate (prequential), then train; a replica without data takes part with no rows.

        A message whose rows give a non-finite output or loss is not trained on (it is a dead letter,
        this replica takes part with no rows); a step whose reduced gradient is not finite changes no
        weight on any replica (each sends its message of the step to the dead letters)."""
        trainer = self.trainer
        if not trainer.whole_model_is_current:
            trainer.engine.sync_model()  # a collective: the current whole model, for the prequential evaluation
        scored = batch = None
        if local is None and self.sharded_ids:  # ID tables over the replicas: the lookups are collectives
            self.model.eval()
            with torch.no_grad():
                empty = move_batch(self.sample.take(torch.arange(0)), next(self.model.parameters()).device)
                self.model(empty.x_num, empty.x_cat)
            self.model.train()
        if local is not None:
            b, bp, bo, message = local
            labels = b.y.numpy()
            on_model = move_batch(b, next(self.model.parameters()).device)  # pinned memory, non-blocking on a GPU
            self.model.eval()
            with torch.no_grad():
                scored = self.model(on_model.x_num, on_model.x_cat)
                loss_sum = sum_loss(self.loss_fn, scored, (on_model.y - self.shift) / self.scale)
            self.model.train()
            if not bool(torch.isfinite(loss_sum) & torch.isfinite(scored).all()):  # one device-to-host copy
                self.rejects.reject(*message, "non_finite_loss",
                                    f"the model's output or loss on these {len(b)} finite rows is not finite "
                                    f"(step {self.step}); the rows were not trained on")
                local = None
            else:
                batch = move_batch(b, trainer.device)
        if trainer.local_batches:
            batch = batch if batch is not None else move_batch(self.sample.take(torch.arange(0)), trainer.device)
        else:  # the engine takes a global batch: every replica's rows on every rank (a collective)
            batch = trainer.global_batch(batch)
            if batch is None:  # the same on every rank: no replica has rows left
                return
        done = trainer.step(batch, self.step)
        if done.skipped:  # reduced: the same answer on every replica
            self.last_loss = None
            if local is not None:
                self.rejects.reject(*message, "non_finite_loss",
                                    f"the gradient of step {self.step} is not finite; the step was skipped and "
                                    f"these {len(b)} rows were not trained on")
            return
        self.last_loss = done.loss
        if local is not None:
            self.window.append((scored.cpu().numpy(), labels))
            self.id_fallbacks.count(b)
            self.source.trained(bp, bo)
            if self.cfg.ledger:
                self.pending_ledger.extend((p, o, self.step) for p, o in zip(bp.tolist(), bo.tolist()))
        if done.rows:
            self.step += 1
            self.steps_since_ckpt += 1
            self.rows_trained += done.rows

    def _checkpoint_unless_stopped(self, reason: str) -> bool:
        """``_checkpoint``; False when a stop came while it waited for brokers that do not answer."""
        try:
            self._checkpoint(reason)
            return True
        except _StoppedWithoutKafka as err:
            self._not_checkpointed(f"did not answer before the stop ({str(err).split(':', 2)[0]})")
            return False

    def _not_checkpointed(self, why: str) -> None:
        """The one line a trainer stopped without its final checkpoint prints: what was not committed."""
        if self.ctx.is_main:
            print(f"stream train: stopped without a final checkpoint: Kafka at {self.cfg.kafka.bootstrap} {why}; not "
                  f"committed: {self.steps_since_ckpt} step(s) since checkpoint version {self.version} (step "
                  f"{self.step - self.steps_since_ckpt}), no new version published; a restart trains them again "
                  f"from that checkpoint (exactly once)", file=sys.stderr, flush=True)

    def _brokers_answer(self) -> bool:
        """At a stop: whether Kafka answers within ``STOP_KAFKA_S`` (the final checkpoint needs it: the
        dead-letter topic's end, the published version). Every replica asks; all must be answered."""
        heartbeat()
        try:
            check_brokers(self.cfg.kafka.bootstrap, timeout_s=STOP_KAFKA_S, client_config=self.cfg.kafka.config,
                          cached=False)
            answered = True
        except KafkaUnavailable:
            answered = False
        heartbeat()
        return all_agree(self.ctx, answered, self.device)

    def _should_end(self, agreed: dict) -> bool:
        return bool(agreed["stop"] or (self.cfg.max_steps and self.step >= self.cfg.max_steps)
                    or (agreed["all_idle"] and not agreed["any_data"]))

    # --- checkpoint and publish ----------------------------------------------------------------------------------
    def _checkpoint(self, reason: str) -> None:
        """A collective: every replica gathers positions, seen offsets, ledger and prequential rows."""
        ctx = self.ctx
        self.trainer.engine.sync_model()  # a grid's stages and shards into the whole model (a collective)
        # this replica's (sharded ID tables differ between replicas), agreed: every replica raises, or none does
        # (one alone would leave the rest in a gather)
        if not all_agree(ctx, weights_finite(self.model), self.device):
            raise NonFiniteModel(self._diverged())
        # before the gathers (a barrier): a dead letter sent after these offsets is one of a message
        # past this checkpoint's positions, which a restart reads again
        # rank 0 asks Kafka; every replica waits with it and all leave together on a stop (none left in a gather)
        try:
            dead_letter_ends = self.rejects.end_offsets(self.should_stop, heartbeat, ask=ctx.is_main,
                                                        all_agree=lambda flag: all_agree(ctx, flag, self.device))
        except (KafkaError, KafkaUnavailable) as err:
            if not self.should_stop() and not isinstance(err, StoppedWaiting):
                raise
            # a stop while waiting for the brokers (the brokers' last error)
            raise _StoppedWithoutKafka(str(err) if isinstance(err, StoppedWaiting) else describe_error(err)) from None
        self.version += 1
        collected = self.checkpoints.collect(self.step)  # a collective: the model and its engine
        # the published version: the whole model (each ID table whole: a collective when they are sharded)
        model_state = collected.model_state if collected.model_state is not None else self.checkpoints.model_state()
        positions = gather_dict(ctx, self.source.positions)
        seen = gather_dict(ctx, self.source.seen)
        window = gather_list(ctx, self.window)
        ledger = gather_list(ctx, self.pending_ledger) if self.cfg.ledger else []
        rejected_now = gather_list(ctx, self.rejects.pending) if self.cfg.ledger else []
        rejected = self.rejected_total = sum_counts(gather(ctx, dict(self.rejects.counts)))
        id_fallbacks = self.id_fallbacks.commit(ctx)
        # ID tables: the dense parameters + the rows changed since the last version (a delta), or a snapshot;
        # tables sharded over the replicas: every replica's changed rows gathered to rank 0 (a collective)
        ids = self._id_publisher()
        id_version = ids.publish(self.version, info={"architecture": json.dumps(self.architecture.to_dict())}) \
            if ids is not None else None
        if ctx.is_main:
            preq = prequential_metrics(window, self.task, self.data.classes, shift=self.shift, scale=self.scale)
            self.ledger.append(self.version, ledger, rejected_now)
            path = self.checkpoints.write(self.step, collected, {
                "step": self.step, "version": self.version, "architecture": self.architecture.to_dict(),
                "run_id": self.run_id, "positions": {str(k): v for k, v in positions.items()},
                "seen": {str(k): v for k, v in seen.items()}, "rejected": rejected, "id_fallbacks": id_fallbacks,
                "dead_letter_ends": {str(k): v for k, v in dead_letter_ends.items()}})
            # "rows": scored since the last checkpoint (absent with none), "rows_trained": in all
            self.log.write({"kind": "prequential", "step": self.step, "version": self.version,
                            "rows_trained": self.rows_trained, **preq})
            # the version the scorers load: its own file and retention (the checkpoints keep 3)
            extra = dict(trainer_checkpoint=str(path), positions=positions, metrics=preq, reason=reason,
                         time=time.time())
            if id_version is not None:
                payload, meta = id_version
                self.versions.publish_ids(payload, meta, step=self.step, run_id=self.run_id, **extra)
            else:
                self.versions.publish(model=cpu_state(model_state), architecture=self.architecture.to_dict(),
                                      version=self.version, step=self.step, run_id=self.run_id, **extra)
            plot_prequential(self.log, self.run_dir, self.task)
            self._write_status(preq.get("loss"), positions, rejected, id_fallbacks)
        self.rejects.checkpointed()
        self.pending_ledger.clear()
        self.window.clear()
        self.last_ckpt_t, self.steps_since_ckpt = time.monotonic(), 0

    def _id_publisher(self) -> IdPublisher | None:
        """The publisher of ID versions when the model has ID tables, whole or sharded over the replicas (made at
        the first version of this process, on every replica: a restarted trainer's first version is a snapshot)."""
        if self.id_publisher is None and published_tables(self.model):
            self.id_publisher = IdPublisher(self.model, self.cfg.snapshot_every)
        return self.id_publisher

    def _diverged(self) -> str:
        return (f"the model's weights are not finite after step {self.step}: training diverged (lower --lr); "
                f"nothing after version {self.version} was checkpointed or published, and a restart resumes "
                f"from that version")

    def _write_status(self, loss, positions: dict, rejected: dict, id_fallbacks: dict) -> None:
        """``status.json`` (rank 0): at a checkpoint the replicas' positions and counts gathered, between them
        this replica's positions and its counts (with replicas: the last checkpoint's sums)."""
        write_status(self.run_dir, {"step": self.step, "version": self.version, "rows": self.rows_trained,
                                    "dropped_duplicates": self.source.dropped, "loss": loss, "positions": positions,
                                    "rejected": rejected, "id_fallbacks": id_fallbacks})

    def _write_status_every_second(self) -> None:
        if self.ctx.is_main and time.monotonic() - self.last_status_t >= 1.0:
            self.last_status_t = time.monotonic()
            self._write_status(self.last_loss, self.source.positions,
                               self.rejected_total if self.ctx.distributed else self.rejects.counts,
                               self.id_fallbacks.base if self.ctx.distributed else self.id_fallbacks.local())
            busy = self.last_data_t - self.first_data_t if self.first_data_t else 0.0
            self.log.board.scalars("stream", {"loss": self.last_loss, "rows_trained": self.rows_trained,
                                              "rows_per_s": self.rows_trained / busy if busy > 0 else None,
                                              "version": self.version, "dropped_duplicates": self.source.dropped},
                                   self.step)

    def close(self) -> None:
        if self.log.board is not None:  # TensorBoard: the options beside the last prequential metrics
            board = self.log.board
            board.hparams({**{k: v for k, v in vars(self.cfg).items() if k not in ("kafka", "topics")},
                           **{f"{role}_topic": name for role, name in vars(self.cfg.topics).items() if name}},
                          [t for t in board.last if t.startswith("prequential/")])
            board.close()
        self.source.close()
        if self.versions is not None:
            self.versions.close()
        if self.trainer is not None:
            self.trainer.close()
        self.rejects.close()


def run_stream_trainer(cfg: StreamTrainConfig, ctx: DistContext | None = None, *,
                       should_stop: Callable[[], bool] | None = None) -> dict:
    """Train until ``should_stop()`` (polled every step), ``idle_exit`` or ``max_steps``; returns a summary."""
    return StreamTrainer(cfg, ctx, should_stop=should_stop).run()


class _StoppedWithoutKafka(RuntimeError):
    """A stop requested while a checkpoint waited for brokers that do not answer: no checkpoint."""

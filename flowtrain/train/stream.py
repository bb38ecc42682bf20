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
stop", "idle for idle_exit_s" and "checkpoint time is due" flags, so all replicas stop, or
checkpoint (a gather), at the same step; the step count itself comes from the reduced example
count, identical everywhere. The loop heartbeats for the launcher every step, idle or not.

The architecture (model kind, hidden sizes, dropout, seed) comes from the batch run that
``init_weights`` starts from (its ``config.json``, or a checkpoint's ``config``), else from this
config; a resumed run takes it from its own checkpoint.

Stopping is the caller's business: ``should_stop`` is polled every step (the command line
connects it to SIGINT/SIGTERM); the trainer installs no signal handlers.
"""
from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from kafka.errors import KafkaError

from connectors.id_keys import reason_counts
from connectors.kafka import (
    KafkaDelivery,
    KafkaUnavailable,
    close_client,
    describe_error,
    ensure_topic,
    new_consumer,
    new_producer,
    topic_partitions,
)
from connectors.model_updates import UpdateKeySource
from flowtrain.observe.board import Board
from flowtrain.parallel import DistContext, sum_loss
from flowtrain.parallel.device import cpu_state, local_world_size, move_batch, resolve_device
from flowtrain.parallel.grid import Grid
from flowtrain.parallel.launch import heartbeat
from flowtrain.train import checkpoint
from flowtrain.train.ids.publish import IdPublisher, published_tables
from flowtrain.train.loader import Batch, TabularDataset, target_scale
from flowtrain.train.loop import metrics_of
from flowtrain.train.metrics import MetricsLog
from flowtrain.train.models import Architecture
from flowtrain.train.published import Publisher, new_run_id
from flowtrain.train.stream_input import (
    DEFAULT_MAX_DECODED_BYTES,
    DEFAULT_MAX_SOURCE_GAP,
    BadFeatureMessage,
    FeatureMessageCheck,
    RawTopicEnds,
    SourceCheck,
)
from flowtrain.train.stream_rejects import InputRejects
from flowtrain.train.trainer import EngineOptions, Trainer, loss_function

#: Seconds a stopping trainer waits for Kafka (its final checkpoint and version); a stop is never held
#: longer by brokers that do not answer.
STOP_KAFKA_S = 10.0
#: Seconds the trainer waits at its start for the features topic (and for brokers that do not answer), and the
#: bound on each question about its partitions.
FEATURES_WAIT_S = 30.0
PARTITIONS_ASK_S = 5.0


@dataclass
class StreamTrainConfig:
    bootstrap: str
    run_dir: str
    dataset: str  # the batch dataset: feature spec, statistics, vocabularies
    # the topics: the command names them after the dataset (flowtrain.commands.stream.dataset_topics); run() needs all three
    features_topic: str | None = None
    updates_topic: str | None = None
    # feature messages the input check rejects go here with their reason (the pipeline's dead-letter topic)
    dead_letter_topic: str | None = None
    init_weights: str | None = None  # a batch run's model.pt (its config.json gives the architecture) or a checkpoint
    lr: float = 1e-3
    hidden: tuple[int, ...] = (128, 64)  # architecture without init_weights
    dropout: float = 0.0
    seed: int = 0
    checkpoint_every_steps: int = 50
    checkpoint_every_s: float = 10.0
    idle_exit_s: float | None = None  # stop (with a final checkpoint) after this long without data
    max_steps: int | None = None
    ledger: bool = False  # test hook: trained sources, per checkpoint version, in ledger.jsonl
    kafka_config: dict[str, Any] = field(default_factory=dict)
    max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES  # a feature message decoding to more is a dead letter
    # the raw events topic the features come from: a row whose source offset is past its end is a dead letter
    # (None, or not on the brokers: a step of more than max_source_gap past the highest offset trained is)
    raw_topic: str | None = None
    max_source_gap: int = DEFAULT_MAX_SOURCE_GAP
    device: str = "auto"  # auto (CUDA when present), cpu or cuda: flowtrain.parallel.device
    # torch threads of each replica (None: torch's default). A step is one feature message (up to
    # the pipeline's --batch-size rows): with 2 threads on 2 busy cores shared with the pipeline and
    # the broker, the trainer consumed 3.8k rows/s, with 1 thread 38.7k (the threads wait for each other).
    threads: int | None = 1
    replication_factor: int | None = None  # of the updates topic if this creates it (None: min(3, brokers))
    # published versions: <run_dir>/published keeps this many (its own retention, apart from the checkpoints')
    keep_published: int = 10
    # with ID tables: each version carries only the ID rows changed since the previous one, with a full
    # snapshot every this many versions (flowtrain.train.ids.publish)
    snapshot_every: int = 20
    update_key_file: str | None = None  # signs each published version (else $FLOWTRAIN_UPDATE_KEY; else unsigned)
    # the engine (flowtrain.train.trainer): workers = replicas x stages x tensor_parallel
    stages: int = 1  # pipeline stages of the model
    microbatches: int = 4  # micro-batches per step in the pipeline
    tensor_parallel: int = 1  # tensor shards of each stage
    shard_states: str = "none"  # ZeRO over the replicas: none, optimizer, gradients or parameters

    def __post_init__(self) -> None:
        self.hidden = tuple(int(h) for h in self.hidden)
        checks = {"lr": self.lr > 0, "hidden": bool(self.hidden) and min(self.hidden) >= 1,
                  "dropout": 0 <= self.dropout < 1, "checkpoint_every_steps": self.checkpoint_every_steps >= 1,
                  "checkpoint_every_s": self.checkpoint_every_s > 0,
                  "idle_exit_s": self.idle_exit_s is None or self.idle_exit_s > 0,
                  "max_steps": self.max_steps is None or self.max_steps >= 1,
                  "max_decoded_bytes": not isinstance(self.max_decoded_bytes, bool) and self.max_decoded_bytes >= 1,
                  "max_source_gap": not isinstance(self.max_source_gap, bool) and self.max_source_gap >= 1,
                  "keep_published": self.keep_published >= 1, "stages": self.stages >= 1,
                  "snapshot_every": not isinstance(self.snapshot_every, bool) and self.snapshot_every >= 1,
                  "microbatches": self.microbatches >= 1, "tensor_parallel": self.tensor_parallel >= 1,
                  "shard_states": self.shard_states in ("none", "optimizer", "gradients", "parameters"),
                  "threads": self.threads is None or (not isinstance(self.threads, bool) and self.threads >= 1),
                  "replication_factor": self.replication_factor is None or (
                      not isinstance(self.replication_factor, bool) and self.replication_factor >= 1)}
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError("StreamTrainConfig: out of range: " + ", ".join(f"{n}={getattr(self, n)!r}" for n in bad))


def initial_weights(cfg: StreamTrainConfig) -> tuple[Architecture, dict | None]:
    """The architecture and starting weights: ``init_weights``' batch run, else ``cfg``'s sizes."""
    if not cfg.init_weights:
        return Architecture("mlp", cfg.hidden, cfg.dropout, cfg.seed, "the stream trainer's options"), None
    path = Path(cfg.init_weights)
    if not path.is_file():
        raise ValueError(f"--init-weights {path}: no such file; give the model.pt of a `flowtrain batch` run")
    state = torch.load(path, weights_only=True, map_location="cpu")
    if isinstance(state, dict) and isinstance(state.get("model"), dict) and isinstance(state.get("config"), dict):
        return Architecture.from_dict(state["config"], f"checkpoint {path}"), state["model"]  # a batch checkpoint
    if isinstance(state, dict) and state.get("sharded_state"):  # a --shard-states batch run's: each rank's pieces
        raise ValueError(f"--init-weights {path} is a checkpoint of a --shard-states run (its weights are sharded in "
                         f"{state['sharded_state']}); give that run's model.pt, which is whole")
    run_config = path.parent / "config.json"
    if not run_config.is_file():
        raise ValueError(f"--init-weights {path}: no config.json beside it, so the batch run's architecture "
                         f"(hidden sizes, dropout, seed) is unknown; give the model.pt of a `flowtrain batch` run "
                         f"directory (or one of its checkpoints)")
    recorded = json.loads(run_config.read_text())
    train = recorded.get("train", recorded)  # config.json: the run's options (flat), or {"train": ...} before
    check_same_dataset(path, Path(recorded.get("dataset") or path.parent / "dataset"), cfg.dataset)
    return Architecture.from_dict(train, f"batch run {path.parent}"), state


def check_same_dataset(weights: Path, trained_on: Path, dataset: str) -> None:
    """--init-weights from a batch run on another dataset (another label, columns, classes, vocabularies
    or statistics: weights that would read the features wrongly) is an error naming both."""
    from connectors.dataset import read_manifest

    if not (trained_on / "_manifest.json").is_file():
        return  # the run's dataset is not at hand: the weights' shapes are still checked on loading
    theirs, mine = read_manifest(trained_on), read_manifest(dataset)
    differ = [name for name, a, b in (("spec", theirs.get("spec"), mine.get("spec")),
                                      ("classes", theirs["stats"].get("classes"), mine["stats"].get("classes")),
                                      ("vocabularies", theirs["stats"].get("vocab"), mine["stats"].get("vocab")))
              if a != b]
    a, b = theirs["stats"].get("numeric", {}), mine["stats"].get("numeric", {})
    if set(a) != set(b) or any(not math.isclose(a[c][k], b[c][k], rel_tol=1e-6, abs_tol=1e-9)
                               for c in a for k in ("mean", "std")):
        differ.append("numeric statistics")
    if differ:
        raise ValueError(f"--init-weights {weights}: that run was trained on the dataset {trained_on}, whose "
                         f"{', '.join(differ)} differ from --dataset {dataset}; start from a batch run on the same "
                         f"dataset (or leave --init-weights out)")


class StreamTrainer:
    """The online trainer's state and its steps; ``run()`` reads top to bottom."""

    def __init__(self, cfg: StreamTrainConfig, ctx: DistContext | None = None, *,
                 should_stop: Callable[[], bool] | None = None):
        self.cfg, self.ctx = cfg, ctx or DistContext()
        self.should_stop = should_stop or (lambda: False)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.device = resolve_device(cfg.device, local_rank=self.ctx.local_rank, local_world=local_world_size())
        self.run_dir = Path(cfg.run_dir)
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.ledger_path = self.run_dir / "ledger.jsonl"
        # rank 0's metrics.jsonl, mirrored to TensorBoard (<out>/tensorboard: prequential/*, stream/*)
        self.log = MetricsLog(self.run_dir / "metrics.jsonl", board=Board(self.run_dir) if self.ctx.is_main else None)
        self.data = TabularDataset(cfg.dataset)
        self.task = self.data.spec.task
        # the engine's grid: one rank of each replica (stage 0, tensor shard 0) reads that replica's feature
        # partitions; the other ranks of the replica get its rows from the engine's global batch
        pos = Grid.from_world(self.ctx.world_size, stages=cfg.stages, tensor=cfg.tensor_parallel).position(self.ctx.rank)
        self.reader, self.replica, self.replicas = pos.stage == 0 and pos.tensor == 0, pos.replica, pos.replicas
        spec = self.data.spec  # no rows: the shapes of a batch (the grid measures its layers on 256 of them)
        self.sample = Batch(torch.zeros(256, self.data.n_numeric),
                            torch.zeros(256, len(spec.categorical) + len(spec.id_columns), dtype=torch.int64),
                            torch.zeros(256))
        self.loss_fn = loss_function(self.task, self.data.outputs)  # K classes: cross-entropy over K logits
        self.shift, self.scale = target_scale(self.data)  # regression trains on a standardized target
        # progress: restored from the checkpoint, never from Kafka's group offsets
        self.step = self.version = 0
        self.positions: dict[int, int] = {}  # feature partition -> next offset
        self.seen: dict[int, int] = {}  # raw partition -> highest raw offset trained
        self.rows_trained = self.dropped = 0
        # every feature message is checked against the dataset (flowtrain.train.stream_input); what fails
        # is a dead letter with its reason, counted per kind in the checkpoint (flowtrain.train.stream_rejects)
        self.check = FeatureMessageCheck(self.data, max_decoded_bytes=cfg.max_decoded_bytes)
        # a row's source must exist on the raw topic: an impossible one never moves the seen-source state
        self.raw_ends = RawTopicEnds(cfg.bootstrap, cfg.kafka_config, cfg.raw_topic, should_stop=self.should_stop,
                                     progress=heartbeat) if cfg.raw_topic else None
        self.source_check = SourceCheck(self.raw_ends, raw_topic=cfg.raw_topic, max_gap=cfg.max_source_gap)
        self.rejects = InputRejects(cfg.bootstrap, cfg.kafka_config, features_topic=cfg.features_topic,
                                    dead_letter_topic=cfg.dead_letter_topic,
                                    replication_factor=cfg.replication_factor)
        self.rejected_total: dict[str, int] = {}  # every replica's counts, summed at each checkpoint and the end
        # rows trained whose ID value had no key, so used the fallback vector, by "column: reason"
        # (connectors.id_keys.BAD_KEYS): the checkpoint's total, plus this replica's since (summed at each checkpoint)
        self.id_fallbacks_base: dict[str, int] = {}
        self.id_fallbacks_new: dict[str, int] = {}
        self.pending_ledger: list[tuple[int, int]] = []
        self.window: list[tuple[np.ndarray, np.ndarray]] = []  # prequential (outputs, labels) since the last log
        self.steps_since_ckpt = 0
        self.last_loss: float | None = None
        now = time.monotonic()
        self.last_ckpt_t = self.last_data_t = self.last_status_t = now
        self.first_data_t: float | None = None
        self.model = self.trainer = self.architecture = None
        self.sharded_ids = False  # ID tables sharded row-wise over the replicas (--workers N with ID columns)
        self.consumer = self.producer = self.delivery = None
        self.mine: list = []
        self.run_id = new_run_id()  # a resumed run keeps its checkpoint's: versions are numbered per run
        self.publisher = Publisher(self.run_dir, keep=cfg.keep_published,
                                   key_source=UpdateKeySource.from_options(cfg.update_key_file)) \
            if self.ctx.is_main else None
        self.id_publisher: IdPublisher | None = None  # a model with ID tables: made at this process's first version

    # --- the whole run ------------------------------------------------------------------------------
    def run(self) -> dict:
        """Train until ``should_stop``, ``idle_exit_s`` or ``max_steps``; returns a summary."""
        missing = [f"--{n.replace('_', '-')}" for n in ("features_topic", "updates_topic", "dead_letter_topic")
                   if not getattr(self.cfg, n)]
        if missing:
            raise ValueError(f"the stream trainer needs its topics: {', '.join(missing)} (the command names them after "
                             f"the dataset)")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        restored = self._restore()
        try:
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
                    self.rejected_total = _sum_counts(_gather(self.ctx, dict(self.rejects.counts)))
                    self.id_fallbacks_base = self._id_fallbacks_total()
                    self.id_fallbacks_new = {}
                    break
                self._write_status_every_second()
                if (self.steps_since_ckpt and (self.steps_since_ckpt >= self.cfg.checkpoint_every_steps
                                               or agreed["checkpoint_due"])) \
                        or (agreed["rejects_pending"] and agreed["checkpoint_due"]):  # only rejected messages
                    if not self._checkpoint_unless_stopped("periodic"):
                        break
        finally:
            self.close()
        busy = (self.last_data_t - self.first_data_t) if self.first_data_t else 0.0
        return {"step": self.step, "version": self.version, "rows": self.rows_trained,
                "dropped_duplicates": self.dropped, "rows_per_s": self.rows_trained / busy if busy > 0 else 0.0,
                "rejected": self.rejected_total, "id_fallbacks": self.id_fallbacks_base,
                "resumed_from": restored, "architecture": self.architecture.to_dict()}

    # --- state: from the last checkpoint only ------------------------------------------------------------
    def _restore(self) -> str | None:
        """Model, optimizer and positions from the newest loadable checkpoint (a corrupt newest one
        falls back to the one before); else the initial weights. Returns the checkpoint's name."""
        found = None
        if checkpoint.all_checkpoints(self.ckpt_dir):  # all of them corrupt: an error, not a fresh start
            found = checkpoint.require_latest(self.ckpt_dir)
        init_state = None
        if found is not None:
            path, state = found
            arch = state.get("architecture") or {"hidden": self.cfg.hidden, "dropout": self.cfg.dropout,
                                                 "seed": self.cfg.seed}
            self.architecture = Architecture.from_dict(arch, f"checkpoint {path}")
        else:
            self.architecture, init_state = initial_weights(self.cfg)
        self.model = self.architecture.build(self.data).to(self.device)
        if init_state is not None:
            try:
                self.model.load_state_dict(init_state)
            except RuntimeError as err:
                raise ValueError(f"--init-weights {self.cfg.init_weights} ({self.architecture.source}) does not fit "
                                 f"the dataset {self.cfg.dataset}: {str(err).splitlines()[0]}") from None
        if not _weights_finite(self.model):  # a model that would train and publish NaN
            raise NonFiniteModel(f"the starting weights ({self.architecture.source}) are not finite; start from a "
                                 f"model.pt or checkpoint whose weights are")
        if found is not None and not found[1].get("sharded_state"):
            self.model.load_state_dict(found[1]["model"])  # before the engine: a grid cuts the model it is given
        cfg = self.cfg
        # a resumed grid keeps its checkpoint's stage cut (rank 0 cuts by measured time, which varies)
        options = EngineOptions(lr=cfg.lr, stages=cfg.stages, microbatches=cfg.microbatches,
                                tensor_parallel=cfg.tensor_parallel, shard_states=cfg.shard_states,
                                stage_bounds=_stage_bounds(found[1], cfg.stages) if found is not None else None)
        # every replica starts from rank 0's weights; a step whose gradient is not finite changes nothing
        self.trainer = Trainer(self.model, self.ctx, options, self.loss_fn, self.sample, seed=self.architecture.seed,
                               target_scale=(self.shift, self.scale), local_batches=True, skip_non_finite=True)
        # with ID columns on N replicas each owns the rows of its keys (flowtrain.train.ids): every lookup is a
        # collective, and a checkpoint holds each table whole (so any --workers resumes it)
        self.sharded_ids = bool(getattr(self.model, "sharded", False))
        if found is None:
            self.rejects.restore(None, self.run_dir, is_main=self.ctx.is_main)
            self._drop_ledger_after(0)
            if self.ctx.is_main and self.log.path.exists():
                self.log.truncate_after(0)
            return None
        path, state = found
        if state.get("sharded_state"):  # --shard-states: each rank its pieces, whichever ranks wrote them (DCP)
            checkpoint.load_sharded(self.trainer.engine, self.model, path, state)
        else:
            self.trainer.engine.load(state["model"], state["optimizer"])
        self.step, self.version = int(state["step"]), int(state["version"])
        self.run_id = str(state.get("run_id") or self.run_id)
        self.positions = {int(k): int(v) for k, v in state["positions"].items()}
        self.seen = {int(k): int(v) for k, v in state["seen"].items()}
        self.id_fallbacks_base = {str(k): int(v) for k, v in (state.get("id_fallbacks") or {}).items()}
        self.rejects.restore(state, self.run_dir, is_main=self.ctx.is_main)
        self._drop_ledger_after(self.version)
        if self.ctx.is_main and self.log.path.exists():
            self.log.truncate_after(self.step)
        if self.ctx.is_main:
            print(f"stream train: resumed from {path.name} (version {self.version}, step {self.step}, positions "
                  f"{self.positions})", flush=True)
        return path.name

    def _drop_ledger_after(self, version: int) -> None:
        """The audit ledger keeps only what belongs to the checkpoint restored (or nothing)."""
        if not (self.cfg.ledger and self.ctx.is_main and self.ledger_path.exists()):
            return
        from connectors.atomic import atomic_write

        kept = []
        for line in self.ledger_path.read_text().splitlines():
            try:
                if json.loads(line)["version"] <= version:
                    kept.append(line)
            except (ValueError, KeyError, TypeError):  # a line a crash tore in the middle of an append: no record
                continue
        # a new file renamed over the old one: a crash here leaves the old ledger whole, never a truncated one
        atomic_write(self.ledger_path, "".join(line + "\n" for line in kept))

    def _consumer_config(self) -> dict:
        return {"max_poll_records": 1, "fetch_max_wait_ms": 100, "max_partition_fetch_bytes": 16 * 1024 * 1024,
                **self.cfg.kafka_config}

    def _open_kafka(self) -> None:
        from kafka import TopicPartition

        cfg = self.cfg
        self.consumer = new_consumer(cfg.bootstrap, self._consumer_config(), group_id=None)
        parts = self._features_partitions()
        self.mine = [TopicPartition(cfg.features_topic, p) for p in parts
                     if self.reader and p % self.replicas == self.replica]
        if self.mine:
            self.consumer.assign(self.mine)
            for tp in self.mine:
                if tp.partition in self.positions:
                    self.consumer.seek(tp, self.positions[tp.partition])
                else:
                    self.consumer.seek_to_beginning(tp)
        heartbeat()
        self.rejects.open({tp.partition for tp in self.mine}, self.run_dir, is_main=self.ctx.is_main,
                          progress=heartbeat, should_stop=self.should_stop)
        if self.ctx.distributed:  # no replica rejects a message before rank 0 noted where the dead letters start
            import torch.distributed as dist

            dist.barrier()
        if self.ctx.is_main:
            ensure_topic(cfg.bootstrap, cfg.updates_topic, client_config=cfg.kafka_config,
                         replication_factor=cfg.replication_factor)
            self.producer = new_producer(cfg.bootstrap, cfg.kafka_config)
            self.delivery = KafkaDelivery(self.producer, what="publishing a model version")

    def _features_partitions(self) -> list[int]:
        """The features topic's partitions, waiting up to ``FEATURES_WAIT_S`` for the topic (the pipeline may create
        it just now) and for the brokers, each question within ``PARTITIONS_ASK_S`` (kafka-python's own metadata wait
        has no bound); a stop requested while the brokers do not answer ends the wait. A ``ValueError`` naming the
        brokers and the topic when they never answered, or saying the topic never appeared."""
        cfg = self.cfg
        deadline = time.monotonic() + FEATURES_WAIT_S
        while True:
            try:
                parts = sorted(topic_partitions(self.consumer, cfg.features_topic, timeout_s=PARTITIONS_ASK_S))
                unavailable = None
            except KafkaUnavailable as err:  # a new consumer for the next question (closing this one ends its wait)
                parts, unavailable = [], err
                close_client(self.consumer)
                self.consumer = None
            heartbeat()
            if parts or time.monotonic() >= deadline or (unavailable is not None and self.should_stop()):
                break
            time.sleep(0.5)
            if self.consumer is None:
                self.consumer = new_consumer(cfg.bootstrap, self._consumer_config(), group_id=None)
        if unavailable is not None:  # a one-line error, as a missing topic is (the command says it so)
            raise ValueError(f"the partitions of features topic {cfg.features_topic!r} (asked for "
                             f"{FEATURES_WAIT_S:g} s): {unavailable}") from None
        if not parts:
            raise ValueError(f"features topic {cfg.features_topic!r} does not exist on {cfg.bootstrap}; start the "
                             f"stream pipeline first (flowtrain stream pipeline)")
        return parts

    # --- one step ---------------------------------------------------------------------------------------------
    def _poll_local_batch(self):
        """At most one feature message of this replica's partitions, without rows already trained."""
        if not self.mine:  # more replicas than feature partitions: this one only takes part in the reduce
            if self.reader:  # (a rank of a grid that does not read waits in the collectives)
                time.sleep(0.2)
            return None
        polled = self.consumer.poll(timeout_ms=200)
        msg = next((m for records in polled.values() for m in records), None)
        if msg is None:
            return None
        self.last_data_t = time.monotonic()
        self.first_data_t = self.first_data_t or self.last_data_t
        self.positions[msg.partition] = msg.offset + 1
        try:
            rows = self.check(msg.value)
            self.source_check(rows.src_partition, rows.src_offset, self.seen)
        except BadFeatureMessage as bad:
            self.rejects.reject(msg.partition, msg.offset, msg.value, bad.kind, str(bad))
            return None
        src_p, src_o = rows.src_partition, rows.src_offset
        fresh = _unseen(src_p, src_o, self.seen)
        self.dropped += int((~fresh).sum())
        if not fresh.any():
            return None
        idx = torch.from_numpy(np.flatnonzero(fresh))
        return rows.split.take(idx), src_p[fresh], src_o[fresh], (msg.partition, msg.offset, msg.value)

    def _agree(self, *, has_data: bool) -> dict:
        """Every replica's flags, reduced: the decisions below are the same on every replica."""
        now = time.monotonic()
        idle = self.cfg.idle_exit_s is not None and now - self.last_data_t >= self.cfg.idle_exit_s
        flags = torch.tensor([float(has_data), float(bool(self.should_stop())), float(idle),
                              float(now - self.last_ckpt_t >= self.cfg.checkpoint_every_s),
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
            self._count_id_fallbacks(b)
            for p in np.unique(bp):  # a column at a time: one max per raw partition
                self.seen[int(p)] = max(self.seen.get(int(p), -1), int(bo[bp == p].max()))
            if self.cfg.ledger:
                self.pending_ledger.extend((p, o, self.step) for p, o in zip(bp.tolist(), bo.tolist()))
        if done.rows:
            self.step += 1
            self.steps_since_ckpt += 1
            self.rows_trained += done.rows

    def _count_id_fallbacks(self, batch: Batch) -> None:
        """This replica's rows trained with an ID value that has no key (the fallback vector), by column and reason:
        the ID columns' keys are the last columns of ``x_cat`` (``flowtrain.train.loader``)."""
        ids = self.data.spec.id_columns
        if not ids:
            return
        keys = batch.x_cat[:, batch.x_cat.shape[1] - len(ids):].numpy()
        for i, col in enumerate(ids):
            for kind, n in reason_counts(keys[:, i]).items():
                name = f"{col}: {kind}"
                self.id_fallbacks_new[name] = self.id_fallbacks_new.get(name, 0) + n

    def _id_fallbacks_total(self) -> dict[str, int]:
        """The checkpoint's counts plus every replica's since (a collective)."""
        return _sum_counts([self.id_fallbacks_base, *_gather(self.ctx, dict(self.id_fallbacks_new))])

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
            print(f"stream train: stopped without a final checkpoint: Kafka at {self.cfg.bootstrap} {why}; not "
                  f"committed: {self.steps_since_ckpt} step(s) since checkpoint version {self.version} (step "
                  f"{self.step - self.steps_since_ckpt}), no new version published; a restart trains them again "
                  f"from that checkpoint (exactly once)", file=sys.stderr, flush=True)

    def _brokers_answer(self) -> bool:
        """At a stop: whether Kafka answers within ``STOP_KAFKA_S`` (the final checkpoint needs it: the
        dead-letter topic's end, the published version). Every replica asks; all must be answered."""
        from connectors.kafka import KafkaUnavailable, check_brokers

        heartbeat()
        try:
            check_brokers(self.cfg.bootstrap, timeout_s=STOP_KAFKA_S, client_config=self.cfg.kafka_config,
                          cached=False)
            answered = True
        except KafkaUnavailable:
            answered = False
        heartbeat()
        if self.ctx.distributed:
            import torch.distributed as dist

            flag = torch.tensor([float(answered)], dtype=torch.float64, device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            answered = bool(flag.item() > 0)
        return answered

    def _should_end(self, agreed: dict) -> bool:
        return bool(agreed["stop"] or (self.cfg.max_steps and self.step >= self.cfg.max_steps)
                    or (agreed["all_idle"] and not agreed["any_data"]))

    # --- checkpoint and publish ----------------------------------------------------------------------------------
    def _checkpoint(self, reason: str) -> None:
        """A collective: every replica gathers positions, seen offsets, ledger and prequential rows."""
        ctx = self.ctx
        self.trainer.engine.sync_model()  # a grid's stages and shards into the whole model (a collective)
        finite = _weights_finite(self.model)  # this replica's: sharded ID tables differ between replicas
        if self.ctx.distributed:  # every replica raises, or none does (one alone would leave the rest in a gather)
            import torch.distributed as dist

            flag = torch.tensor([float(finite)], dtype=torch.float64, device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            finite = bool(flag.item() > 0)
        if not finite:
            raise NonFiniteModel(self._diverged())
        # before the gathers (a barrier): a dead letter sent after these offsets is one of a message
        # past this checkpoint's positions, which a restart reads again
        try:
            dead_letter_ends = self.rejects.end_offsets(self.should_stop, heartbeat) if ctx.is_main else {}
        except (KafkaError, KafkaUnavailable) as err:
            if not self.should_stop():
                raise
            raise _StoppedWithoutKafka(describe_error(err)) from None  # a stop while waiting for the brokers
        self.version += 1
        engine, shards = self.trainer.engine, None
        if hasattr(engine, "shard_pieces"):  # --shard-states: every rank writes its own shard (DCP, a collective)
            tensors, chunks = engine.shard_pieces()
            shards = checkpoint.save_shards(self.ckpt_dir, self.step, tensors, chunks)
            whole = {"optimizer_groups": [{k: v for k, v in g.items() if k != "params"}
                                          for g in engine.optimizer.param_groups][:1],
                     "layout": {"workers": ctx.world_size, "shard_states": self.cfg.shard_states}}
        else:
            whole = {"optimizer": engine.optimizer_state()}  # a collective under a grid
        # each ID table whole, whatever the number of replicas that trained it (a collective when sharded)
        model_state = self.model.full_state_dict() if self.sharded_ids else self.model.state_dict()
        if shards is None:  # sharded: the checkpoint holds no whole model (the published version does)
            whole["model"] = model_state
        plan = getattr(self.trainer.engine, "plan", None)  # a grid's stage cut: a restart keeps it
        stage_bounds = [list(b) for b in plan.bounds] if plan is not None else None
        positions = _gather_dict(ctx, self.positions)
        seen = _gather_dict(ctx, self.seen)
        window = _gather_list(ctx, self.window)
        ledger = _gather_list(ctx, self.pending_ledger) if self.cfg.ledger else []
        rejected_now = _gather_list(ctx, self.rejects.pending) if self.cfg.ledger else []
        rejected = self.rejected_total = _sum_counts(_gather(ctx, dict(self.rejects.counts)))
        id_fallbacks = self.id_fallbacks_base = self._id_fallbacks_total()
        self.id_fallbacks_new = {}
        # ID tables: the dense parameters + the rows changed since the last version (a delta), or a snapshot;
        # tables sharded over the replicas: every replica's changed rows gathered to rank 0 (a collective)
        ids = self._id_publisher()
        id_version = ids.publish(self.version, info={"architecture": json.dumps(self.architecture.to_dict())}) \
            if ids is not None else None
        if ctx.is_main:
            preq = self._prequential(window)
            if ledger or rejected_now:
                with open(self.ledger_path, "a") as fh:
                    for p, o, s in ledger:  # s: the step that trained the row (a step's rows: replicas in rank order)
                        fh.write(json.dumps({"version": self.version, "partition": int(p), "offset": int(o),
                                             "step": int(s)}) + "\n")
                    for p, o, kind in rejected_now:  # feature messages (not raw sources) sent to the dead letters
                        fh.write(json.dumps({"version": self.version, "rejected": {"partition": int(p),
                                                                                   "offset": int(o)},
                                             "kind": kind}) + "\n")
            path = checkpoint.save(self.ckpt_dir, self.step, cpu_state({  # opens on any machine
                **whole, "rng": torch.get_rng_state(), "step": self.step, "version": self.version,
                "architecture": self.architecture.to_dict(), "run_id": self.run_id,
                "stage_bounds": stage_bounds,
                "positions": {str(k): v for k, v in positions.items()},
                "seen": {str(k): v for k, v in seen.items()}, "rejected": rejected, "id_fallbacks": id_fallbacks,
                "dead_letter_ends": {str(k): v for k, v in dead_letter_ends.items()}}), keep=3, shards=shards)
            # "rows": scored since the last checkpoint (absent with none), "rows_trained": in all
            self.log.write({"kind": "prequential", "step": self.step, "version": self.version,
                            "rows_trained": self.rows_trained, **preq})
            # the version the scorers load: its own file and retention (the checkpoints keep 3)
            extra = dict(trainer_checkpoint=str(path), positions=positions, metrics=preq, reason=reason,
                         time=time.time())
            if id_version is not None:
                payload, meta = id_version
                self._publish(self.publisher.publish_ids(payload, meta, step=self.step, run_id=self.run_id,
                                                         **extra))
            else:
                self._publish(self.publisher.publish(
                    model=cpu_state(model_state), architecture=self.architecture.to_dict(),
                    version=self.version, step=self.step, run_id=self.run_id, **extra))
            _plot(self.log, self.run_dir, self.task)
            _status(self.run_dir, {"step": self.step, "version": self.version, "rows": self.rows_trained,
                                   "dropped_duplicates": self.dropped, "loss": preq.get("loss"),
                                   "positions": positions, "rejected": rejected, "id_fallbacks": id_fallbacks})
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

    def _publish(self, record: dict) -> None:
        """The model version on the updates topic; a send Kafka does not acknowledge is an error, except
        while stopping: then it waits ``STOP_KAFKA_S`` at most and says the version was not published."""
        from connectors.kafka import KafkaWriteError

        stopping = bool(self.should_stop())
        try:
            self.delivery.send(self.cfg.updates_topic, json.dumps(record).encode(),
                               key=str(record["version"]).encode())
            self.delivery.confirm(within_s=STOP_KAFKA_S if stopping else None)
        except KafkaWriteError as err:
            if not stopping:
                raise
            self.delivery.discard()
            print(f"stream train: not committed: version {record['version']} is checkpointed but was not published "
                  f"on {self.cfg.updates_topic} ({err}); scorers keep the previous version until the next one",
                  file=sys.stderr, flush=True)

    def _prequential(self, window: list[tuple[np.ndarray, np.ndarray]]) -> dict:
        """The task's metrics (flowtrain.train.metrics) on predictions made before training on the rows."""
        if not window:
            return {}
        outputs = torch.from_numpy(np.concatenate([s for s, _ in window]))
        labels = torch.from_numpy(np.concatenate([y for _, y in window]))
        if self.task == "regression":
            outputs = outputs * self.scale + self.shift  # in the label's units
        found = metrics_of(outputs, labels, self.task, self.data.classes)
        out = {k: float(v) for k, v in found.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        return {**out, "rows": int(labels.shape[0])}

    def _write_status_every_second(self) -> None:
        if self.ctx.is_main and time.monotonic() - self.last_status_t >= 1.0:
            self.last_status_t = time.monotonic()
            _status(self.run_dir, {"step": self.step, "version": self.version, "rows": self.rows_trained,
                                   "dropped_duplicates": self.dropped, "loss": self.last_loss,
                                   "positions": self.positions,  # with replicas: the last checkpoint's sum
                                   "rejected": self.rejected_total if self.ctx.distributed else self.rejects.counts,
                                   "id_fallbacks": self.id_fallbacks_base if self.ctx.distributed else
                                   _sum_counts([self.id_fallbacks_base, self.id_fallbacks_new])})
            busy = self.last_data_t - self.first_data_t if self.first_data_t else 0.0
            self.log.board.scalars("stream", {"loss": self.last_loss, "rows_trained": self.rows_trained,
                                              "rows_per_s": self.rows_trained / busy if busy > 0 else None,
                                              "version": self.version, "dropped_duplicates": self.dropped}, self.step)

    def close(self) -> None:
        if self.log.board is not None:  # TensorBoard: the options beside the last prequential metrics
            board = self.log.board
            board.hparams({k: v for k, v in vars(self.cfg).items() if k not in ("kafka_config", "bootstrap")},
                          [t for t in board.last if t.startswith("prequential/")])
            board.close()
        if self.consumer is not None:
            close_client(self.consumer)
        if self.producer is not None:
            close_client(self.producer, timeout=10)
        if self.trainer is not None:
            self.trainer.close()
        self.rejects.close()
        if self.raw_ends is not None:
            self.raw_ends.close()


def run_stream_trainer(cfg: StreamTrainConfig, ctx: DistContext | None = None, *,
                       should_stop: Callable[[], bool] | None = None) -> dict:
    """Train until ``should_stop()`` (polled every step), ``idle_exit_s`` or ``max_steps``; returns a summary."""
    return StreamTrainer(cfg, ctx, should_stop=should_stop).run()


def _stage_bounds(state: dict, stages: int) -> list | None:
    """The stage cut a checkpoint recorded, if it has ``stages`` stages (else the engine cuts anew and its
    ``load`` names the layout the checkpoint was written with)."""
    bounds = state.get("stage_bounds")
    return bounds if isinstance(bounds, list) and len(bounds) == stages else None


def _unseen(partitions: np.ndarray, offsets: np.ndarray, seen: dict[int, int]) -> np.ndarray:
    """Rows whose source is past the highest offset already trained for its raw partition."""
    fresh = np.ones(len(offsets), dtype=bool)
    for p in np.unique(partitions):
        rows = partitions == p
        fresh[rows] = offsets[rows] > seen.get(int(p), -1)
    return fresh


class _StoppedWithoutKafka(RuntimeError):
    """A stop requested while a checkpoint waited for brokers that do not answer: no checkpoint."""


class NonFiniteModel(ValueError):
    """The model's weights stopped being finite: training diverged (no message is to blame)."""


def _weights_finite(model: torch.nn.Module) -> bool:
    tensors = [t for t in model.state_dict().values() if t.is_floating_point()]
    return not tensors or bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())  # one copy to host


def _sum_counts(dicts: list[dict]) -> dict:
    out: dict = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + int(v)
    return out


def _gather(ctx: DistContext, mine) -> list:
    """Every replica's ``mine`` (just ours without a process group), sent as JSON: never unpickled."""
    if not ctx.distributed:
        return [mine]
    from flowtrain.parallel import gather_json

    return gather_json(mine)


def _gather_dict(ctx: DistContext, mine: dict) -> dict:
    """Positions / seen offsets of all replicas: each key's highest value."""
    merged: dict = {}
    for d in _gather(ctx, dict(mine)):
        for k, v in d.items():
            merged[k] = max(v, merged.get(k, v))
    return merged


def _gather_list(ctx: DistContext, mine: list) -> list:
    return [x for part in _gather(ctx, list(mine)) for x in part]


def _plot(log: MetricsLog, run_dir: Path, task: str = "classification") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in log.read() if r.get("kind") == "prequential" and "loss" in r]
    if not rows:
        return
    second = "rmse" if task == "regression" else "auc"
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], "o-", label="prequential loss")
    if any(second in r for r in rows):
        ax2 = ax.twinx()
        ax2.plot([r["step"] for r in rows if second in r], [r[second] for r in rows if second in r], "s--",
                 color="tab:orange", label=f"prequential {second.upper()}")
        ax2.set_ylabel(second.upper())
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("online training (evaluate, then train, per batch)")
    fig.tight_layout()
    tmp = run_dir / "prequential.png.tmp.png"
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    tmp.replace(run_dir / "prequential.png")


def _status(run_dir: Path, status: dict) -> None:
    tmp = run_dir / "trainer-status.json.tmp"
    tmp.write_text(json.dumps({**status, "time": time.time()}, default=str))
    tmp.replace(run_dir / "trainer-status.json")

"""The trainers' options, declared once next to the engine that reads them (``connectors.fields``: each field is
a flag, a ``--config`` key and a ``config.json`` key, with its default, range and help).

- Shared sections, declared once and composed by the batch run and the online trainer (``SECTION = COMPOSED``:
  their options sit in ``train`` in one and ``trainer`` in the other): ``SeedOptions``, ``NetworkOptions`` (hidden
  sizes, dropout), ``OptimizerOptions`` (learning rate, class weights), ``ThreadOptions`` (``flowtrain predict``'s
  too), ``WorkerOptions`` (local workers and how soon a dead one ends the job). The online trainer tailors its own
  defaults (``connectors.fields.tailor``: no dropout, one thread).
- ``ModelOptions``: what a model family reads (``flowtrain.train.models``).
- ``TrainOptions``: a batch run's model and training options; ``ParallelOptions``: how its engine splits the
  work (replicas' buckets, ZeRO, pipeline stages, tensor shards, the device). ``flowtrain batch``'s
  ``BatchJob`` composes both, and the engine's ``plan.TrainConfig`` is them (plus what a run sets, not the user).
- ``EngineSettings``: not options, what a run sets for its engine (a resumed grid's stage cut).
- ``StreamTrainOptions``: the online trainer's engine (``ParallelOptions``), model, optimizer, checkpoint and publishing options;
  ``flowtrain stream train``'s ``StreamTrainJob`` composes them and ``stream_config.StreamTrainConfig`` is them
  (plus the resolved dataset, topics and Kafka client settings).

Ranges and choices are checked in one place, ``connectors.fields.check`` / ``build``. Stdlib only (no torch):
``flowtrain --help`` imports this.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import ClassVar

from connectors.fields import COMPOSED, above, at_least, fraction, option, sizes, store_path, tailor

#: --help sections (``option(..., group=...)``).
TRAINING = "training"
PARALLELISM = "parallelism"
STREAM_TRAINER = "online trainer (`stream train`)"
MODEL_UPDATES = "model updates (trainer and scorer)"

#: --select-by's metrics (``flowtrain.train.metrics.check_select_by`` checks one fits the task).
SELECT_BY = ("auc", "accuracy", "macro_f1", "log_loss", "loss", "rmse", "mae", "r2")
#: --shard-states: ZeRO's levels (``flowtrain.parallel.zero.sharder``).
SHARD_STATES = ("none", "optimizer", "gradients", "parameters")
#: --device (``flowtrain.parallel.device``).
DEVICES = ("auto", "cpu", "cuda")
#: --dtype: the floating-point type of the parameters, gradients, optimizer state and batches
#: (``flowtrain.train.precision``); float64 is the check mode in which layouts equal one process to ~1e-12.
DTYPES = ("float32", "float64")


# --- batch ----------------------------------------------------------------------------------------------
def class_weight_option(value) -> str | None:
    """``--class-weight``: ``balanced``, or ``CLASS=W`` pairs with finite weights > 0 (comma-separated)."""
    if value is None or value == "":
        return None
    text = ",".join(str(v) for v in value) if isinstance(value, (list, tuple)) else str(value).strip()
    if text == "balanced":
        return text
    for pair in text.split(","):
        name, sep, weight = pair.rpartition("=")
        try:
            ok = bool(sep and name.strip()) and math.isfinite(float(weight)) and float(weight) > 0
        except ValueError:
            ok = False
        if not ok:
            raise argparse.ArgumentTypeError(f"expected balanced or CLASS=W,... with weights > 0 (e.g. yes=5), got "
                                             f"{pair!r}")
    return text


class_weight_option.__name__ = "balanced or CLASS=W,..."


#: --class-weight (``flowtrain.train.class_weights``), a batch run's and the online trainer's.
CLASS_WEIGHT_HELP = ("classification: weigh each example's loss by its class: balanced (n / (classes x n_class): "
                     "every class counts as much) or CLASS=W,... (others 1); validation and test metrics add "
                     "weighted_log_loss and weighted_accuracy")


# --- shared sections: declared once, taken by the batch run (section train) and the online trainer (trainer) ------
@dataclass
class SeedOptions:
    """The seed of a run's randomness (``flowtrain replay``'s too: which events --malformed replaces)."""

    SECTION: ClassVar[str] = COMPOSED
    seed: int = option(0, "seed for splits, shuffling and initialization", group=TRAINING)


@dataclass
class NetworkOptions(SeedOptions):
    """The network's shape and its seed, a batch run's (``ModelOptions``) and the online trainer's
    (``StreamTrainOptions``, which tailors their help and its dropout)."""

    SECTION: ClassVar[str] = COMPOSED  # train: {hidden: ...} in a batch run, trainer: {hidden: ...} in a stream
    hidden: tuple[int, ...] = option((128, 64), "MLP hidden sizes, comma-separated", parse=sizes, group=TRAINING)
    dropout: float = option(0.1, "dropout", parse=fraction(), group=TRAINING)


@dataclass
class OptimizerOptions:
    """Adam's learning rate and the loss's class weights, a batch run's (``TrainOptions``) and the online trainer's
    (``StreamTrainOptions``)."""

    SECTION: ClassVar[str] = COMPOSED
    lr: float = option(1e-3, "Adam learning rate", parse=above(0), group=TRAINING)
    class_weight: str | None = option(None, CLASS_WEIGHT_HELP, parse=class_weight_option, group=TRAINING,
                                      metavar="balanced|CLASS=W,...")


@dataclass
class ThreadOptions:
    """torch's threads per process: a batch run's (``TrainOptions``), each online trainer replica's
    (``StreamTrainOptions``, which tailors its default) and each ``flowtrain predict`` worker's. In ``--help`` with the
    options of the set composing it (its ``GROUP``), else with the command's own."""

    SECTION: ClassVar[str] = COMPOSED
    threads: int | None = option(None, "torch threads (default: torch's choice)", parse=at_least(1))


@dataclass
class WorkerOptions:
    """How many local workers train, and how soon a dead one ends the job: a batch run's (``BatchWorkers``, section
    parallel) and the online trainer's replicas (``TrainerWorkers``, section trainer, which tailors the help)."""

    SECTION: ClassVar[str] = COMPOSED
    workers: int = option(1, "data-parallel workers on this machine; each gets a shard of every global batch, "
                          "gradients are reduced as sums and counts", parse=at_least(1), group=PARALLELISM)
    failure_timeout: float = option(60.0, "seconds within which the job ends when a worker dies, fails or stalls",
                                    parse=above(0), group=PARALLELISM)


@dataclass
class ModelOptions(NetworkOptions):
    """The options a model family reads (``flowtrain.train.models.build_model``)."""

    SECTION: ClassVar[str] = "train"  # --config's section (connectors.sections): train: {hidden: [64, 32]}
    GROUP: ClassVar[str] = TRAINING  # --help's section of the shared options it composes
    model: str | None = option(None, "your own model: MODULE:FACTORY, a function (spec) -> torch.nn.Module taking "
                               "(x_num, x_cat) (see docs/python-api.md); flowtrain imports MODULE and runs FACTORY: "
                               "code that runs as you, here and wherever the bundle is loaded with --trust-code; "
                               "default: flowtrain's wide-and-deep MLP", group=TRAINING, metavar="MODULE:FACTORY")
    min_id_count: int = option(1, "an ID gets its own row once seen this many times (before: the shared fallback "
                               "vector)", parse=at_least(1), group=TRAINING)
    id_ttl: int | None = option(None, "an ID row unseen for this many events is evicted (default: never)",
                                parse=at_least(1), group=TRAINING)
    max_ids: int | None = option(None, "at most this many rows per ID table; past it the least recently seen ID's "
                                 "row is reused (default: no bound)", parse=at_least(1), group=TRAINING)
    id_dim: int = option(16, "the width of an ID column's embedding", parse=at_least(1), group=TRAINING)
    ensemble: int | None = option(None, "members of the network's ensemble (TabM-style: they share the MLP's "
                                  "weights, each with its own input adapter and head, trained on its own loss; the "
                                  "prediction is their mean; each costs a step's work); 1: one network (default: "
                                  "chosen from the table, 4 up to 8,192 training rows, 2 up to 16,384, then 1; "
                                  "docs/models.md)", parse=at_least(1), group=TRAINING)
    numeric_embedding: int | None = option(None, "width of each numeric feature's periodic embedding (trained "
                                           "frequencies, then a linear map and ReLU per feature); 0: the numerics "
                                           "enter the MLP as they are (default: chosen from the table, 16 up to "
                                           "65,536 training rows, then 0; docs/models.md)", parse=at_least(0),
                                           group=TRAINING)
    frequency_scale: float = option(1.0, "the periodic embeddings' initial frequencies are drawn from N(0, this) "
                                    "(in standard deviations of the numeric; larger: sharper shapes, e.g. "
                                    "thresholds)", parse=above(0), group=TRAINING)


@dataclass
class TrainOptions(ModelOptions, OptimizerOptions, ThreadOptions):
    """A batch run's training options: budget, batch, schedule, evaluation (``plan.plan_training`` chooses what
    is left unset)."""

    SECTION: ClassVar[str] = "train"
    GROUP: ClassVar[str] = TRAINING
    epochs: int | None = option(None, "training budget in passes over the training split (default: a step budget "
                                "chosen from the table, printed)", parse=at_least(1), group=TRAINING)
    steps: int | None = option(None, "training budget in optimizer steps (default: chosen from the table, printed)",
                               parse=at_least(1), group=TRAINING)
    batch_size: int | None = option(None, "rows per step (default: chosen from the table, at most 1/16 of the "
                                    "training split, 32..2048)", parse=at_least(1), group=TRAINING)
    eval_every: int | None = option(None, "steps between validations (default: chosen from the table, at least "
                                    "once per epoch)", parse=at_least(1), group=TRAINING)
    warmup_steps: int | None = option(None, "learning-rate warm-up steps before the cosine decay (default: 5% of "
                                      "the schedule, at most 200)", parse=at_least(1), group=TRAINING)
    decay_steps: int | None = option(None, "steps the learning-rate schedule spans (warm-up, then cosine decay to 5% "
                                     "of --lr; default: the --steps / --epochs budget, else the table's); give runs "
                                     "that must share their first steps the same value (e.g. a run continued with "
                                     "--resume and a larger budget)", parse=at_least(1), group=TRAINING)
    select_by: str | None = option(None, "validation metric that picks the best model and drives early stopping "
                                   "(default: auc for binary, accuracy for multi-class, rmse for regression)",
                                   choices=SELECT_BY, group=TRAINING)
    weight_decay: float | None = option(None, "Adam's weight decay (an L2 penalty on the weights; default: chosen "
                                        "from the table, the linear start's own penalty: 1/n of the training rows "
                                        "for a classifier, 2/n for a regression, so the fitted linear part stays "
                                        "where its fit put it)", parse=at_least(0.0, float), group=TRAINING)
    patience: int = option(10, "stop after this many validations without a better --select-by metric",
                           parse=at_least(1), group=TRAINING)
    no_progress: bool = option(False, "no progress bars", group=TRAINING)
    memory_budget: str | None = option(None, "memory for a split's tensors, per machine (e.g. 4GB, 512MB, 25%; "
                                       "default 25% of RAM, shared by the local workers); a larger split is "
                                       "streamed from its shards through a bounded shuffle buffer (every row once "
                                       "per epoch)", group=TRAINING)


@dataclass
class DeviceOption:
    """``--device``: where a model runs, a trainer's (``ParallelOptions``, section parallel) and ``flowtrain predict``'s
    forward (which narrows it to cpu or cuda and tailors its default)."""

    SECTION: ClassVar[str] = COMPOSED
    device: str = option("auto", "where training runs: auto (CUDA when present), cpu, or cuda; on CUDA each local "
                         "worker takes its own GPU and workers talk NCCL, on the CPU gloo", choices=DEVICES,
                         group=PARALLELISM)


@dataclass
class ParallelLayout:
    """How a trainer's engine splits the work over its workers: buckets, ZeRO, pipeline stages, tensor shards."""

    SECTION: ClassVar[str] = "parallel"
    bucket_mb: float = option(1.0, "gradient bucket size in MB for the reduce", parse=above(0), group=PARALLELISM)
    shard_states: str = option("none", "ZeRO: shard the data-parallel training state over the workers: optimizer "
                               "(ZeRO-1: Adam's state), gradients (ZeRO-2: and gradients), parameters (ZeRO-3: and "
                               "parameters, gathered per layer); the reduce becomes a reduce-scatter",
                               choices=SHARD_STATES, group=PARALLELISM)
    stages: int = option(1, "pipeline parallelism: cut the model into this many stages, each in its own worker "
                         "(with --workers D: a D x S grid of D*S workers)", parse=at_least(1), group=PARALLELISM)
    microbatches: int = option(4, "micro-batches per global batch in the pipeline", parse=at_least(1),
                               group=PARALLELISM)
    schedule: str = option("1f1b", "pipeline schedule", choices=("1f1b", "gpipe"), group=PARALLELISM)
    tensor_parallel: int = option(1, "tensor parallelism: split each stage's Linear pairs (column/row) and "
                                  "embedding tables (by vocabulary) over this many workers; with --workers D "
                                  "--stages S a D x S x T grid of D*S*T workers", parse=at_least(1),
                                  group=PARALLELISM)


@dataclass
class ParallelOptions(DeviceOption, ParallelLayout):
    """How a trainer's engine splits the work over its workers (``flowtrain.train.trainer``), the batch run's and
    the online trainer's alike: the layout, the device and the floating-point type."""

    SECTION: ClassVar[str] = "parallel"
    dtype: str = option("float32", "the floating-point type of training (parameters, gradients, optimizer state, "
                        "batches): float64 is a check mode, N workers, ZeRO stages, grids and ID tables then equal one "
                        "process to ~1e-12 (float32 Adam amplifies summation order in near-zero gradients); about 2x "
                        "the memory and time", choices=DTYPES, group=PARALLELISM)


@dataclass
class EngineSettings:
    """Not options: what a run sets for its engine besides them (the engine reads ``ParallelOptions``, ``lr`` and
    these; both trainers' configs carry them: ``plan.TrainConfig``, ``stream_config.StreamTrainConfig``)."""

    stage_bounds: list | None = None  # set by a resume: the checkpoint's stage cut (None: rank 0 measures and cuts)


# --- the online trainer ---------------------------------------------------------------------------------
@dataclass
@tailor(hidden={"help": "hidden sizes without --init-weights"},
        # a stream without --init-weights starts from scratch on one feature message per step: no dropout by default
        dropout={"default": 0.0, "help": "dropout without --init-weights"},
        seed={"help": "seed of the initial weights and dropout"},
        # a step is one feature message (up to the pipeline's --batch-size rows): with 2 threads on 2 busy cores
        # shared with the pipeline and the broker, the trainer consumed 3.8k rows/s, with 1 thread 38.7k (threads wait)
        threads={"default": 1, "help": "torch threads of each trainer replica (a step is one feature message, too "
                                       "small for more threads on cores shared with the pipeline and the broker)"})
class StreamTrainOptions(ParallelOptions, NetworkOptions, OptimizerOptions, ThreadOptions):
    """The online trainer's options (``flowtrain.train.stream.online``): its engine's (``ParallelOptions``, the same as a
    batch run's: the replicas' buckets, ZeRO, pipeline stages, tensor shards, the device), its model, optimizer,
    checkpoints and published versions."""

    SECTION: ClassVar[str] = "trainer"
    GROUP: ClassVar[str] = STREAM_TRAINER  # --help lists the shared network and optimizer options with its own
    init_weights: str | None = option(
        None, "start from a batch run's model.pt (or a checkpoint); the architecture (hidden sizes, dropout, model "
              "kind, seed) comes from that run's config.json", group=STREAM_TRAINER,
        parse=store_path("--init-weights", remote=False))
    checkpoint_every: int = option(50, "checkpoint and publish every K steps ...", parse=at_least(1),
                                   group=STREAM_TRAINER)
    checkpoint_seconds: float = option(10.0, "... or every T seconds", parse=above(0), group=STREAM_TRAINER)
    max_decoded_bytes: int = option(
        64 << 20, "a feature message that decodes to more bytes than this is a dead letter (checked from its "
                  "metadata before decompressing)", parse=at_least(1), group=STREAM_TRAINER)
    idle_exit: float | None = option(
        None, "stop (with a final checkpoint) after this many seconds without data on any replica (default: never)",
        parse=above(0), group=STREAM_TRAINER)
    ledger: bool = option(False, "record trained sources per model version (ledger.jsonl; an audit and test hook)",
                          group=STREAM_TRAINER)
    keep_published: int = option(10, "trainer: versions kept in <out>/published, apart from the checkpoints",
                                 parse=at_least(1), group=MODEL_UPDATES)
    snapshot_every: int = option(
        20, "trainer, a model with ID tables: each version carries the dense weights and only the ID rows changed "
            "since the previous one, with a full snapshot every this many versions", parse=at_least(1),
        group=MODEL_UPDATES)


@dataclass
class UpdateOptions:
    """Model versions between the trainer (it signs them) and the scorer (it authenticates them)."""

    SECTION: ClassVar[str] = "updates"
    update_key_file: str | None = option(
        None, "the key that signs (trainer) and authenticates (scorer) model versions, HMAC-SHA256; else "
              "$FLOWTRAIN_UPDATE_KEY; without either, versions are unsigned and the scorer warns (default: none)",
        metavar="FILE", group=MODEL_UPDATES)

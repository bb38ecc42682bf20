"""The options of ``flowtrain batch`` (``BatchJob``: each field is a flag, a ``--config`` key and a ``config.json``
key): what it trains on and where its run goes (``BatchInputs``), the engine's sections (``flowtrain.train.options``),
the local workers (``BatchWorkers``) and where its Beam pipeline runs. ``flowtrain.commands.batch.job`` runs the job;
``batch.etl``, ``batch.export`` and ``tune`` read these options without importing the job; ``ExportJob`` is
``flowtrain export``'s (a batch run's bundle)."""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import ClassVar

from connectors.fields import above, at_least, narrow, option, options_of, store_path, tailor
from flowtrain.commands.dead_letter_bound import DeadLetterBound
from flowtrain.commands.shared_options import (
    BeamArgs,
    BundleKey,
    Dataset,
    Input,
    LabelColumn,
    Out,
    Overwrite,
    RunnerOptions,
    TimeColumn,
    TimeFormat,
)
from flowtrain.commands.tracking_options import TrackingOptions
from flowtrain.train.options import PARALLELISM, ParallelOptions, TrainOptions, WorkerOptions
from pipelines.features.options import FeatureOptions
from pipelines.presets import preset_name
from pipelines.serving.options import MaxIdBytes

_DATA = "your own data (instead of the demo)"
_PAR = PARALLELISM
_RUN = "where the Beam pipeline runs"
_TASKS = ("regression", "classification")


def numeric_ranges(value) -> tuple[str, ...]:
    """``--numeric-range`` values (a list, or one text): each ``COL=LO:HI`` with two numbers."""
    pairs = tuple(str(v).strip() for v in (value if isinstance(value, (list, tuple)) else [value]))
    for pair in pairs:
        try:
            col, (lo, hi) = range_of(pair)
        except ValueError:
            col, lo, hi = "", 0.0, 0.0
        if not col or not (math.isfinite(lo) and math.isfinite(hi) and lo <= hi):
            raise argparse.ArgumentTypeError(f"expected COL=LO:HI with finite numbers LO <= HI, e.g. "
                                             f"dep_delay=-120:1800, got {pair!r}")
    return pairs


numeric_ranges.__name__ = "column ranges"


#: What ``flowtrain batch --help`` ends with: the job and its run directory's files.
RUN_DIRECTORY = """The batch job: Beam ETL -> dataset directory -> training -> report -> bundle, in one run directory.

``run_batch(BatchJob(...))`` is what ``flowtrain batch`` and ``flowtrain.batch(...)`` run.

Run directory::

    dataset/            the ETL's output (Parquet shards + _manifest.json)
    dead_letters.jsonl  rows the ETL rejected, with reasons
    checkpoints/        ckpt-<step>.pt (+ .sha256), loadable with torch.load(weights_only=True)
    model.pt            the best weights (state_dict)
    linear.pt           the linear baseline (fitted to convergence; the model's wide part starts from it)
    training.json       the training plan (chosen batch size, budget, schedule) and the best step
    confusion.png       multi-class labels: the test confusion matrix
    metrics.jsonl       training and validation metrics, one JSON object per line
    loss.png metric.png curves
    roc.png pr.png calibration.png importance.png ...  evaluation figures (by task)
    tensorboard/        TensorBoard event files: tensorboard --logdir <out>/tensorboard
    report.md           test metrics with intervals next to the baselines, curves, importance, slices
    report.html         the same report in one file, figures embedded
    summary.json        the same numbers for machines
    config.json         every option of this run: a valid --config of `flowtrain batch`
    bundle/             everything needed to predict (``flowtrain.load``, ``flowtrain predict``)
"""


@dataclass
@tailor(max_dead_letter_fraction={"help": "stop with exit status 3 when more than this fraction of the rows the "
                                          "ETL reads are dead letters (their reasons in the dead-letter file); "
                                          "default: no bound, but rows the ETL reads that are all dead letters are "
                                          "an error where something had to be used", "group": _DATA},
        time_format={"group": _DATA},
        time_column={"help": "split by this time column (else at random by --seed)", "group": _DATA},
        label={"group": _DATA},
        overwrite={"help": "--out holds an earlier flowtrain run with other options: replace it (only the files "
                           "flowtrain wrote are deleted; docs/runs.md)"},
        out={"help": "run directory, local or on an object store (gs://, s3://, az://: docs/object-stores.md; default "
                     "runs/batch-<time>)"},
        dataset={"help": "skip the ETL and train on this existing dataset directory"},
        input={"help": "CSV, Parquet, Avro or JSON-lines files or globs (repeat or comma-separate)", "group": _DATA},
        # a batch run's ID columns (users, items) are short keys: 256 bytes since ID columns were added
        max_id_bytes={"default": 256, "help": "an ID value longer than this uses the fallback vector", "group": _DATA})
@narrow(dataset={"parse": store_path("--dataset")}, input={"parse": store_path("--input", many=True)})
class BatchInputs(MaxIdBytes, Input, Dataset, Out, DeadLetterBound, TimeFormat, TimeColumn, LabelColumn, Overwrite):
    """What ``flowtrain batch`` trains on and where its run goes."""

    resume: bool = option(False, "continue the run in --out from its last checkpoint (reuses its dataset); only "
                          "the budget (--epochs/--steps/--patience) and where it runs may change")
    preset: str | None = option(None, "without --input: the dataset preset whose dataset the ETL builds, NAME or "
                                      "MODULE:NAME (default: the demo's; docs/presets.md)", group=_DATA,
                                parse=preset_name)  # a preset that is not there: an error before --out is touched
    task: str | None = option(None, "what the label is (default: from its type: text or booleans are classes, "
                              "integers with few values too, other numbers a regression target; the choice is "
                              "printed)", choices=_TASKS, group=_DATA)
    numeric: tuple[str, ...] = option((), "numeric feature columns, comma-separated (a missing value is a dead "
                                      "letter; without --numeric/--categorical they are inferred, see --exclude)",
                                      group=_DATA)
    optional_numeric: tuple[str, ...] = option((), "numeric columns where a missing value becomes the mean",
                                               group=_DATA)
    categorical: tuple[str, ...] = option((), "categorical feature columns, comma-separated", group=_DATA)
    exclude: tuple[str, ...] = option((), "without --numeric/--categorical the feature columns are inferred from the "
                                      "files' first rows (numbers, text with few values, the time column; printed "
                                      "once): leave these columns out, comma-separated", group=_DATA)
    positive_above: float | None = option(None, "classification: label > this is the positive class (else the "
                                          "classes are the label's values in the training split: text, booleans "
                                          "or integers)", group=_DATA)
    positive_class: str | None = option(None, "a two-class label: the class that is positive (whose probability "
                                        "is predicted; default: the later of the two in sorted order, e.g. yes of "
                                        "no/yes; printed)", group=_DATA, metavar="VALUE")
    valid_from: str | None = option(None, "with --time-column: first time of the validation split (read like the "
                                    "column: ISO date/time, YYYY/MM/DD, a number, or --time-format)", group=_DATA)
    test_from: str | None = option(None, "with --time-column: first time of the test split", group=_DATA)
    min_count: int = option(1, "categories seen fewer times in training map to out-of-vocabulary",
                            parse=at_least(1), group=_DATA)
    id_columns: tuple[str, ...] = option((), "high-cardinality ID columns (users, items), comma-separated: each gets a "
                                         "dynamic embedding table that grows with new IDs, no vocabulary (docs/ids.md)",
                                         group=_DATA)
    required_ids: tuple[str, ...] = option((), "ID columns (of --id-columns) whose value must have a key: a row with "
                                           "one missing, empty or over --max-id-bytes is a dead letter with its "
                                           "reason (else it uses the fallback vector, counted)", group=_DATA)
    weight_column: str | None = option(None, "a numeric column of per-row sample weights (>= 0, not a feature): a "
                                       "row of weight w counts w times in the loss and the weighted metrics; a bad "
                                       "weight is a dead letter (docs/batch.md)", group=_DATA, metavar="COL")
    max_record_bytes: int = option(8 << 20, "the longest CSV record or JSON line read; a longer one is a dead "
                                   "letter (docs/limits.md)", parse=at_least(1), group=_DATA)
    numeric_range: tuple[str, ...] = option(
        (), "a numeric column's range, COL=LO:HI (repeat): a value outside it is a dead letter, in training, the "
            "stream and predict (default: from the training split, magnitudes below about a million times the "
            "column's 99th percentile; docs/limits.md)", parse=numeric_ranges, repeat=True,
        group=_DATA, metavar="COL=LO:HI")
    clip_outliers: bool = option(False, "clip a numeric value outside its column's range (declared or from the "
                                 "training split) to that range instead of making its row a dead letter",
                                 group=_DATA)
    slice_by: str | None = option(None, "report: test metrics per value of this categorical feature column",
                                  group=_DATA, metavar="COLUMN")


@dataclass
class BatchWorkers(WorkerOptions):
    """How many local workers (``WorkerOptions``), and how a failed one ends (or restarts) the job."""

    SECTION: ClassVar[str] = "parallel"  # --config's section: with the engine's ParallelOptions
    max_restarts: int = option(0, "with --workers (or --stages/--tensor-parallel) > 1: when a worker dies, fails "
                               "or stalls, restart the whole group from the run's last checkpoint, up to this "
                               "many times (torchrun's --max-restarts on one machine); then the job stops naming "
                               "each failure", parse=at_least(0), group=_PAR)


@dataclass
class BatchJob(BundleKey, BeamArgs, RunnerOptions, TrackingOptions, ParallelOptions, BatchWorkers, TrainOptions,
               FeatureOptions, BatchInputs):
    """The options of ``flowtrain batch`` (each field is a flag, a ``--config`` key and a ``config.json`` key):
    what it trains on, features over time computed from it (``--aggregate``/``--join``: the backfill runs before
    the ETL, docs/features.md), the engine's options (``flowtrain.train.options``: the model, training and
    parallelism) and its own."""

    worker_memory: float | None = option(None, "GiB each worker may hold (enforced on each worker: cgroup v2 "
                                         "memory.max where delegated, else RLIMIT_AS; over it, one line): a layout "
                                         "whose memory plan (plus a "
                                         "worker's fixed overhead) does not fit stops before training, naming the "
                                         "smallest layout that fits", parse=above(0), group=_PAR)
    print_plan: bool = option(False, "print the memory plan per rank of this layout (parameters, gradients, "
                              "optimizer state, activations) and stop before training", group=_PAR)
    job_only: bool = option(False, "run the ETL, write <out>/job.json for torchrun across machines, print the "
                            "torchrun command and stop", group=_PAR)




def training_flags(job: BatchJob) -> str:
    """The training options this run was given, as flags (the report step must repeat them)."""
    defaults = BatchJob()
    flags = ""
    for opt in (*options_of(TrainOptions), *options_of(ParallelOptions)):
        value = getattr(job, opt.name)
        if value is not None and value != getattr(defaults, opt.name):
            value = ",".join(map(str, value)) if isinstance(value, (tuple, list)) else value
            flags += f" {opt.flag}" if opt.parse is None else f" {opt.flag} {value}"
    return flags


def range_of(text: str) -> tuple[str, list[float]]:
    """``COL=LO:HI`` (``--numeric-range``) as (column, [lo, hi]); a ValueError when LO or HI is no number."""
    col, _, rest = text.partition("=")
    lo, _, hi = rest.rpartition(":")
    return col.strip(), [float(lo), float(hi)]


@dataclass
@tailor(overwrite={"help": "replace an existing --out bundle"},
        bundle_key_file={"help": "sign the bundle with this key (HMAC-SHA256; a file only you may read; else "
                                 "$FLOWTRAIN_BUNDLE_KEY; default: none, not signed)"},
        out={"help": "the bundle directory to write"})
class ExportJob(Out, Overwrite, BundleKey):
    """The options of ``flowtrain export``."""

    run: str | None = option(None, "a `flowtrain batch` run directory", metavar="RUN", parse=store_path("RUN"))
    torch_export: bool = option(False, "also write model.pt2, a torch.export program of the model for use without "
                                "flowtrain (its inputs: see docs/predict.md)")

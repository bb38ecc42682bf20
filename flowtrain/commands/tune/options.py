"""``flowtrain tune``: an Optuna study over ``flowtrain batch`` runs that share one ETL'd dataset.

This module holds the options (``TuneJob``); ``tune_run.run_tune(TuneJob(...))`` is what ``flowtrain tune`` runs
(Optuna and the engine load only then):

1. the dataset once: ``--dataset``, or the batch ETL of the same data options into ``<out>/dataset``;
2. the study (Optuna; ``--storage``, by default SQLite in ``<out>/study.db``; any SQLAlchemy URL): each trial
   samples the search space (``flowtrain.commands.tune.space``: ``--search``, or the default space) and runs
   ``flowtrain batch --dataset ... --out <out>/trials/<study>-<number>`` in its own process (``--parallel K``
   at once; every trial its own run directory, never shared), with the job's other training options as they
   are; the objective is the run's validation metric (``--select-by``, the task's by default: AUC, accuracy,
   RMSE), never a test metric;
3. pruning on the validation curve: while a trial runs, each validation it writes (``metrics.jsonl``) is
   reported to Optuna's pruner (``--pruner median``, or ``none``); a pruned trial's run is stopped;
4. resume: the same command with the same ``--out`` / ``--storage`` continues the study. Trials send heartbeats;
   a trial whose process was killed (``kill -9`` of the tune process) stops beating, is marked failed and is
   retried with its parameters (Optuna's ``RetryFailedTrialCallback``); finished trials are kept, and
   ``--trials`` counts every finished (complete or pruned) trial of the study;
5. the result: ``<out>/best`` (a link to the best trial's run directory, its bundle in ``best/bundle``),
   ``best.json``, ``tune_report.md`` (trials, best parameters, parameter importances, plots) and
   ``trials.json``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from connectors.fields import above, at_least, narrow, option, store_path, tailor
from flowtrain.commands.batch.options import BatchJob
from flowtrain.commands.shared_options import Timeout

_TUNE = "the study (`flowtrain tune`)"


@dataclass
@tailor(timeout={"default": None, "help": "stop starting trials after this many seconds (default: no limit)",
                 "group": _TUNE})  # no limit unless asked: a study runs until its --trials
@narrow(timeout={"parse": above(0)})
class TuneOptions(Timeout):
    """The study's own options (``flowtrain tune``); the rest are ``flowtrain batch``'s, for every trial."""

    SECTION: ClassVar[str] = "tune"  # --config's section: tune: {trials: 30, parallel: 2}

    trials: int = option(20, "finished trials the study should have (complete or pruned; a resumed study counts "
                         "the ones it has)", parse=at_least(1), group=_TUNE)
    search: str | None = option(None, "the search space: name=LOW:HIGH[:log][:int] or name=A|B|C, comma-separated "
                                "(names: flowtrain batch options, or width and depth for --hidden), or a YAML "
                                "file of them; default: lr, width, depth, dropout, weight_decay, "
                                "numeric_embedding, frequency_scale, ensemble (docs/tune.md)", group=_TUNE, metavar="SPACE")
    parallel: int = option(1, "trials at once, each its own flowtrain batch process", parse=at_least(1),
                           group=_TUNE)
    storage: str | None = option(None, "the study's storage, an SQLAlchemy URL (default: sqlite:///<out>/study.db); "
                                 "the same storage resumes the study", group=_TUNE, metavar="URL")
    study_name: str = option("flowtrain", "the study's name in the storage", group=_TUNE)
    pruner: str = option("median", "stop a trial whose validation curve falls below the median of the trials "
                         "before it at the same step (Optuna's MedianPruner), or none", choices=("median", "none"),
                         group=_TUNE)
    heartbeat: int = option(5, "seconds between a running trial's heartbeats in the storage; a trial silent for 4 of "
                            "them (its process gone, e.g. the study killed) is marked failed and retried",
                            parse=at_least(1), group=_TUNE)
    trial_timeout: float | None = option(None, "seconds a trial may run before it is stopped and marked failed "
                                         "(default: no limit)", parse=above(0), group=_TUNE)


@dataclass
@tailor(out={"help": "the study's directory (default runs/tune-<time>): dataset/, trials/, study.db, best, "
                     "tune_report.md"})
@narrow(out={"parse": store_path("--out", remote=False)})  # the study's SQLite storage and links: a local directory
class TuneJob(TuneOptions, BatchJob):
    """``flowtrain tune``'s options: the study's and ``flowtrain batch``'s (the data, the ETL once, and every
    trial's fixed training options)."""


__all__ = ["TuneJob", "TuneOptions"]

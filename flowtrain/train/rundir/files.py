"""The files of a run directory, in one table: each one's name in the code, its path (or glob) in the directory, and
what it holds. ``RunFiles(path).model`` is ``path/model.pt``; what a later batch run of the same ``--out`` may
delete (``RUN_FILES``) and the directories it may remove when empty (``RUN_DIRS``) are read from the table, so a new
file is declared here once (docs/runs.md lists them for users).

A ``replaced`` file is deleted by a later run of the same ``--out`` that replaces this one (``--overwrite``, the
same options again, a failed run), and recorded in ``run.json``'s ``files`` when the run ends. ``bundle/`` and
``dataset/`` are replaced whole, by their own manifests; ``checkpoints/`` only the run's own. A ``stream`` file is
only a streaming job's (``flowtrain stream``): its run directory is continued, never replaced.

``usable_dir`` checks that a path can be a run directory at all (not a file, writable) before the rules run.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from connectors.atomic import TMP_INFIX
from connectors.fields import OptionError
from flowtrain.train.rundir.marker import RUN_MARKER

__all__ = ["RUN_DIRS", "RUN_FILES", "RunFile", "RunFiles", "TABLE", "file_name", "usable_dir"]


@dataclass(frozen=True)
class RunFile:
    #: the name the code uses (``RunFiles(path).<name>``)
    name: str
    #: the path relative to the run directory (a glob pattern for a family of files)
    path: str
    #: "replaced": deleted with its run when a later one replaces it; "stream": only a streaming job's; "dir": a
    #: directory a run makes (removed when empty); "marker": run.json
    kind: str
    what: str


TABLE: tuple[RunFile, ...] = (
    RunFile("marker", RUN_MARKER, "marker", "the run marker: command, run id, options, status, the files written"),
    RunFile("model", "model.pt", "replaced", "the chosen model's state dict (the network, or its linear start)"),
    RunFile("linear", "linear.pt", "replaced", "the linear start fitted by L-BFGS (the network's wide part starts here)"),
    RunFile("training", "training.json", "replaced", "the training plan, best step and memory of the fit"),
    RunFile("fit", "fit.json", "replaced", "the fit's result, as the workers hand it to the report step"),
    RunFile("metrics", "metrics.jsonl", "replaced", "one JSON line per evaluation (and per stream version)"),
    RunFile("loss_png", "loss.png", "replaced", "the training and validation loss by step"),
    RunFile("metric_png", "metric.png", "replaced", "the validation metric by step"),
    RunFile("confusion_png", "confusion.png", "replaced", "the test confusion matrix (classification)"),
    RunFile("roc_png", "roc.png", "replaced", "the test ROC curve (binary)"),
    RunFile("pr_png", "pr.png", "replaced", "the test precision-recall curve (binary)"),
    RunFile("calibration_png", "calibration.png", "replaced", "the test calibration curve (binary)"),
    RunFile("residuals_png", "residuals.png", "replaced", "the test residuals (regression)"),
    RunFile("predicted_png", "predicted_vs_actual.png", "replaced", "predicted against actual (regression)"),
    RunFile("importance_png", "importance.png", "replaced", "permutation importance of the features"),
    RunFile("report_md", "report.md", "replaced", "the report"),
    RunFile("report_html", "report.html", "replaced", "the report, one HTML file"),
    RunFile("summary", "summary.json", "replaced", "the run's summary: test metrics, baselines, timings"),
    RunFile("config", "config.json", "replaced", "every option of the run, secrets redacted: a valid --config"),
    RunFile("job", "job.json", "replaced", "--job-only: the job torchrun's nodes run"),
    RunFile("dead_letters", "dead_letters.jsonl", "replaced", "the ETL's rejected rows, each with its reason"),
    RunFile("temporaries", f".*{TMP_INFIX}*", "replaced", "files being written (atomic writes' temporaries)"),
    RunFile("workers_job", "workers/job.json", "replaced", "the job spawned workers read"),
    RunFile("worker_logs", "workers/rank-*.log", "replaced", "each spawned worker's log"),
    RunFile("heartbeats", "workers/heartbeats/*", "replaced", "the workers' heartbeats (the launcher's watch)"),
    RunFile("tensorboard_events", "tensorboard/events.out.tfevents.*", "replaced", "TensorBoard's events"),
    RunFile("tensorboard_series", "tensorboard/*/events.out.tfevents.*", "replaced", "TensorBoard's per-series events"),
    RunFile("ledger", "ledger.jsonl", "replaced", "--ledger: the sources each model version trained on"),
    RunFile("drift_reference", "drift_reference.json", "replaced", "the training data's profile drift compares with"),
    RunFile("trainer_status", "trainer-status.json", "stream", "the online trainer's status (the status page's)"),
    RunFile("pipeline_status", "pipeline-status.json", "stream", "the feature pipeline's counters (a prefix)"),
    RunFile("score_status", "score-status.json", "stream", "the scorer's counters (a prefix)"),
    RunFile("prequential_png", "prequential.png", "stream", "the online trainer's prequential loss by step"),
    RunFile("feature_state", "feature-state", "stream", "--aggregate's per-partition feature state"),
    RunFile("workers_dir", "workers/heartbeats", "dir", ""),
    RunFile("workers", "workers", "dir", "spawned workers' job, logs and heartbeats"),
    RunFile("tensorboard_dirs", "tensorboard/*", "dir", ""),
    RunFile("tensorboard", "tensorboard", "dir", "TensorBoard's log directory"),
    RunFile("checkpoints", "checkpoints", "dir", "the run's checkpoints (a later run deletes only its own)"),
    RunFile("bundle", "bundle", "dir", "the served bundle (replaced whole, by its manifest)"),
    RunFile("dataset", "dataset", "dir", "the ETL's dataset (replaced whole, by its manifest)"),
)
_BY_NAME = {f.name: f for f in TABLE}
#: What a run writes in its directory and a run replacing it deletes (glob patterns relative to it), besides ``dataset/`` (removed only if it
#: holds nothing but a dataset flowtrain wrote) and ``checkpoints/`` (only the run's own).
RUN_FILES = tuple(f.path for f in TABLE if f.kind == "replaced")
#: The directories a run makes, deepest first (``bundle/`` and ``dataset/`` are replaced whole, only when they hold
#: nothing but what their manifest lists); a link in their place is never followed.
RUN_DIRS = tuple(f.path for f in TABLE if f.kind == "dir")


def file_name(name: str) -> str:
    """The path (relative to a run directory) of the file the code calls ``name`` (``TABLE``)."""
    try:
        return _BY_NAME[name].path
    except KeyError:
        raise KeyError(f"a run directory has no file named {name!r} (flowtrain.train.rundir.files.TABLE)") from None


class RunFiles:
    """The paths of one run directory's files: ``RunFiles(path).summary`` is ``path/summary.json`` (``TABLE``)."""

    __slots__ = ("root",)

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def __getattr__(self, name: str) -> Path:
        try:
            return self.root / file_name(name)
        except KeyError as err:
            raise AttributeError(str(err.args[0])) from None

    def __repr__(self) -> str:
        return f"RunFiles({str(self.root)!r})"


def usable_dir(path: str | Path, option: str = "--out") -> Path:
    """A directory we can create or write: an existing file, or a parent we cannot write, is an error."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OptionError(f"{option} {path} is a file, not a directory: give the path of a new or an existing "
                          f"run directory")
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise OptionError(f"{option} {path}: {probe} is a file, so the directory cannot be created there; "
                          f"choose another path")
    target = path if path.exists() else probe
    if not os.access(target, os.W_OK | os.X_OK):
        raise OptionError(f"{option} {path}: {target} is not writable; choose a directory you can write")
    return path

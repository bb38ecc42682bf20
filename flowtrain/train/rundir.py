"""The run directory (``--out``): who may write into it, what is replaced, and when a run is complete.

Every run directory flowtrain writes holds ``run.json``, the run marker, written first::

    {"format": "flowtrain.run/1", "command": "batch", "run_id": "...", "options_hash": "...",
     "options": {...}, "status": "running" | "complete", "created": ..., "updated": ...}

``status`` becomes ``complete`` last, after every final output is written (``mark_complete``):
a directory whose marker says ``running`` holds a run that is in progress, crashed or failed.

The rules (``prepare_run_dir``; the CLI and the Python API both call it before writing anything):

* a new or empty ``--out``: a fresh run (a new run id);
* a non-empty ``--out`` without ``run.json``: an error, with or without ``--overwrite``: flowtrain
  never writes into, or deletes from, a directory it cannot prove is its own;
* ``--resume``: the marker must be there and the options that define the run must be the same
  (the budget ``--epochs``/``--steps``/``--patience`` and where it runs may change:
  ``RESUME_MAY_CHANGE``); options not given are taken from the marker; the checkpoint resumed from
  must belong to this run id (``flowtrain.train.checkpoint``);
* ``--overwrite``, or a run of the same options again: the earlier run's files are deleted first
  (only those flowtrain writes, ``RUN_FILES``; the dataset only if it holds nothing else; the
  checkpoints only of that run id), then a fresh run starts with a new run id; files of others
  in the directory stay;
* anything else (a run with other options there): an error naming the options that differ.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from connectors.atomic import TMP_INFIX, atomic_write
from connectors.dataset import DatasetError, owned_files, remove_dataset
from connectors.secrets import REDACTED, is_secret, redact
from flowtrain.errors import FlowtrainError
from flowtrain.fields import OptionError
from flowtrain.train import checkpoint

__all__ = ["RUN_MARKER", "RUN_FILES", "RESUME_MAY_CHANGE", "RunDir", "RunDirError", "prepare_run_dir",
           "mark_complete", "read_marker", "run_id_of", "options_hash"]

RUN_MARKER = "run.json"
FORMAT = "flowtrain.run/1"
#: Options that are not part of a run's identity at all (where it is, how it is shown).
NOT_IDENTITY = frozenset({"out", "resume", "overwrite", "config", "no_progress"})
#: Options a ``--resume`` may change: the budget, and where and how fast it runs.
RESUME_MAY_CHANGE = NOT_IDENTITY | {"epochs", "steps", "patience", "threads", "workers", "failure_timeout",
                                    "job_only", "dataset", "device", "memory_budget", "runner", "flink_master"}
#: What a run writes in its directory (glob patterns relative to it), besides ``dataset/`` (removed
#: only if it holds nothing but a dataset flowtrain wrote) and ``checkpoints/`` (only the run's own).
RUN_FILES = ("model.pt", "linear.pt", "training.json", "fit.json", "confusion.png", "metrics.jsonl", "loss.png",
             "metric.png", "roc.png", "pr.png", "calibration.png", "residuals.png", "predicted_vs_actual.png",
             "importance.png", "report.md", "report.html", "summary.json", "config.json", "job.json",
             "dead_letters.jsonl", f".*{TMP_INFIX}*", "workers/job.json", "workers/rank-*.log", "workers/heartbeats/*",
             "tensorboard/events.out.tfevents.*", "tensorboard/*/events.out.tfevents.*", "bundle/*")
_RUN_DIRS = ("workers/heartbeats", "workers", "tensorboard/*", "tensorboard", "checkpoints", "bundle")


class RunDirError(FlowtrainError):
    """``--out`` cannot be used as asked; the message names the directory and what to do."""


@dataclass
class RunDir:
    path: Path
    run_id: str
    #: the options of the run: for a resume, the recorded ones updated with those given
    options: dict
    resumed: bool = False
    #: a line for the user when an earlier run's files were replaced (None otherwise)
    note: str | None = None


def _identity(options: Mapping[str, Any], ignore: frozenset | set) -> dict:
    return {k: v for k, v in sorted(options.items()) if k not in ignore and v is not None}


def options_hash(options: Mapping[str, Any]) -> str:
    """SHA-256 of the options that define a run (all but ``NOT_IDENTITY``), canonical JSON."""
    body = json.dumps(_identity(options, NOT_IDENTITY), sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()


def _recordable(options: Mapping[str, Any]) -> dict:
    """The options as stored in the marker: secrets replaced (they still count in the hash), by the one
    redaction every run file goes through (connectors.secrets: also ``--s3_secret_access_key=...`` inside
    ``beam_args``)."""
    return redact(_identity(options, NOT_IDENTITY))


def read_marker(path: str | Path) -> dict | None:
    """The run marker of directory ``path``, or None when it has none; a damaged one is a ``RunDirError``."""
    marker = Path(path) / RUN_MARKER
    if not marker.exists():
        return None
    try:
        data = json.loads(marker.read_text())
    except (OSError, ValueError) as err:
        raise RunDirError(f"{marker} cannot be read ({err}); it is not a flowtrain run marker") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not data.get("run_id"):
        raise RunDirError(f"{marker} is not a flowtrain run marker (format {FORMAT})")
    return data


def run_id_of(path: str | Path | None) -> str | None:
    """The run id recorded in ``path/run.json`` (None: no marker, e.g. a run dir given to ``fit`` by hand)."""
    if path is None:
        return None
    marker = read_marker(path)
    return marker["run_id"] if marker else None


def _write_marker(path: Path, marker: dict) -> None:
    marker["updated"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    atomic_write(path / RUN_MARKER, json.dumps(marker, indent=2, default=str))


def mark_complete(path: str | Path) -> None:
    """Record that the run in ``path`` finished: call it after the last final output is written."""
    path = Path(path)
    marker = read_marker(path)
    if marker is None:
        raise RunDirError(f"{path} has no {RUN_MARKER}: prepare_run_dir was not called for it")
    marker["status"] = "complete"
    _write_marker(path, marker)


def _show(key: str, value) -> str:
    return REDACTED if is_secret(key) else ("(not given)" if value is None else repr(redact(value)))


def _differences(recorded: Mapping, given: Mapping, may_change) -> list[str]:
    keys = sorted((set(recorded) | set(given)) - set(may_change))
    out = []
    for k in keys:
        a, b = recorded.get(k), redact({k: given.get(k)})[k]  # compared as recorded: secrets redacted
        if a == REDACTED:  # a secret: its value is not kept, only its part of the hash
            continue
        if json.dumps(a, default=str, sort_keys=True) != json.dumps(b, default=str, sort_keys=True):
            out.append(f"--{k.replace('_', '-')}: {_show(k, a)} in the run, {_show(k, b)} now")
    return out


def _run_files(path: Path, old_run_id: str | None) -> list[Path]:
    """The files of ``RUN_FILES`` in ``path`` and the checkpoints (with checksums) of run ``old_run_id``."""
    files = {p for pattern in RUN_FILES for p in path.glob(pattern) if p.is_file() or p.is_symlink()}
    ckpts = path / "checkpoints"
    if ckpts.is_dir():
        for ckpt in checkpoint.all_checkpoints(ckpts):
            if checkpoint.run_of(ckpt) == old_run_id:
                files |= {ckpt, ckpt.with_suffix(".sha256")}
    return sorted(f for f in files if f.exists())


def _clear(path: Path, marker: dict, *, keep_dataset: bool = False) -> int:
    """Delete what the run of ``marker`` wrote in ``path``; returns how many files. Checks first:
    a dataset holding anything else is an error before anything is deleted. ``keep_dataset``: the
    new run reads ``dataset/`` (``--dataset <out>/dataset``), so it stays."""
    dataset = path / "dataset"
    if keep_dataset:
        pass
    elif dataset.exists():
        try:
            owned_files(dataset)
        except DatasetError as err:
            raise RunDirError(f"{path} holds an earlier flowtrain run, but {err}") from None
    files = [f for f in _run_files(path, marker.get("run_id"))
             if not (keep_dataset and f.name == "dead_letters.jsonl")]  # the dataset's own dead letters
    for f in files:
        f.unlink(missing_ok=True)
    checkpoint.remove_temporaries(path / "checkpoints", marker.get("run_id"))
    n = len(files) + (len(remove_dataset(dataset)) if dataset.exists() and not keep_dataset else 0)
    for pattern in _RUN_DIRS:
        for d in sorted(path.glob(pattern), key=lambda q: len(q.parts), reverse=True):
            if d.is_dir():
                try:
                    d.rmdir()  # only when empty: what others put there stays
                except OSError:
                    pass
    return n


def prepare_run_dir(path: str | Path, options: Mapping[str, Any], *, resume: bool = False,
                    overwrite: bool = False, command: str = "batch") -> RunDir:
    """Apply the run-directory rules (module docstring) to ``path`` before a run writes anything.

    Returns the ``RunDir`` (its ``run_id``; its ``options``, for a resume the recorded ones with
    those given on top). Raises ``RunDirError`` (a ``ValueError``: exit 2 from the CLI) naming the
    directory and the fix when ``path`` is not empty and is not a flowtrain run of the same options,
    unless ``resume`` (the same run continues) or ``overwrite`` (an earlier flowtrain run's files are
    deleted). The marker is written (status ``running``) before this returns; call
    ``mark_complete(path)`` when the run's last output is written.

    Both the command line (``flowtrain batch --out``) and the Python API call this; pass the run's
    options as a dict keyed by option name (``"epochs"``, ``"input"``, ...; unset ones absent or None).
    """
    path = Path(path).resolve()
    if resume and overwrite:
        raise RunDirError("--resume and --overwrite contradict each other: --resume continues the run in --out, "
                          "--overwrite replaces it; give one")
    if path.exists() and not path.is_dir():
        raise RunDirError(f"--out {path} is a file, not a directory")
    given = dict(options)
    entries = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    marker = read_marker(path) if entries else None
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())

    def fresh(note: str | None = None) -> RunDir:
        path.mkdir(parents=True, exist_ok=True)
        run_id = uuid.uuid4().hex[:16]
        _write_marker(path, {"format": FORMAT, "command": command, "run_id": run_id,
                             "options_hash": options_hash(given), "options": _recordable(given),
                             "status": "running", "created": now})
        return RunDir(path, run_id, given, resumed=False, note=note)

    if not entries:
        if resume:
            raise RunDirError(f"--resume: {path} holds no checkpoint: there is no run to resume there; leave out "
                              f"--resume to start one")
        return fresh()
    if marker is None:
        shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
        raise RunDirError(f"--out {path} is not empty ({shown}) and is not a flowtrain run directory (no "
                          f"{RUN_MARKER}); flowtrain never writes into or deletes from a directory it cannot "
                          f"prove is its own{', --overwrite included' if overwrite else ''}: choose a new or "
                          f"empty --out")
    if marker.get("command", command) != command:
        raise RunDirError(f"--out {path} holds a 'flowtrain {marker.get('command')}' run, not a '{command}' run; "
                          f"choose another --out")
    recorded = dict(marker.get("options") or {})
    if resume:
        may_change = set(RESUME_MAY_CHANGE)
        dataset = given.get("dataset")
        if dataset is not None and Path(dataset).resolve() not in (path / "dataset", Path(str(recorded.get(
                "dataset", path / "dataset"))).resolve()):
            raise RunDirError(f"--resume: --dataset {dataset} is not the dataset of the run in {path} "
                              f"({recorded.get('dataset') or path / 'dataset'}); a resume trains on the same data")
        # options not given now (None or empty) are the run's own (taken from the marker); those given must agree
        now = {k: v for k, v in given.items() if v is not None and v not in ((), [], "")}
        diffs = [d for d in _differences(recorded, now, may_change) if not d.endswith("(not given) now")]
        if diffs:
            raise RunDirError(f"--resume: the run in {path} was started with other options ({'; '.join(diffs)}); "
                              f"resume it with the same options, or give --overwrite to start it over")
        try:  # a loadable checkpoint of this very run: never another run's state, never a silent start over
            checkpoint.require_latest(path / "checkpoints", run_id=marker["run_id"])
        except checkpoint.CheckpointError as err:
            raise RunDirError(f"--resume: {err}; check --out, or leave out --resume (with --overwrite) to start "
                              f"the run over") from None
        merged = {**{k: v for k, v in recorded.items() if v != "<redacted>"}, **given}
        marker["status"] = "running"
        _write_marker(path, marker)
        return RunDir(path, marker["run_id"], merged, resumed=True)
    if overwrite or marker.get("options_hash") == options_hash(given):
        reads_own = given.get("dataset") is not None and Path(str(given["dataset"])).resolve() == path / "dataset"
        n = _clear(path, marker, keep_dataset=reads_own)
        why = "--overwrite" if overwrite else "the same options"
        return fresh(f"{path}: replaced the earlier run {marker['run_id']} ({why}; {n} file(s) it wrote deleted)")
    diffs = "; ".join(_differences(recorded, _identity(given, NOT_IDENTITY), NOT_IDENTITY)) or "options differ"
    raise RunDirError(f"--out {path} holds a flowtrain run with other options ({diffs}); "
                      f"give --resume to continue it, --overwrite to replace it, or choose another --out")


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

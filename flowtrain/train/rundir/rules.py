"""The run directory (``--out``): who may write into it, what is replaced, and when a run is complete.

Every run directory flowtrain writes holds ``run.json``, the run marker, written first::

    {"format": "flowtrain.run/1", "command": "batch", "run_id": "...", "options_hash": "...",
     "options": {...}, "status": "running" | "complete", "created": ..., "updated": ...}

``status`` becomes ``complete`` last, after every final output is written (``mark_complete``), or
``failed`` with the ``error`` when the run stops on an error (``mark_failed``); both record ``files``,
the files the run wrote (relative paths). A directory whose marker says ``running`` holds a run that
is in progress or crashed. A run whose process died without a word (a native crash such as SIGSEGV,
SIGKILL, a lost machine) is found by the next command on that ``--out``: it holds the directory's lock,
so no process on this host runs the run the marker names (its ``pid`` and ``host``); the marker is then
recorded ``failed`` ("its process ... died") and the rules below apply to a failed run.

The rules (``prepare_run_dir``; the CLI and the Python API both call it before writing anything):

* a new or empty ``--out``: a fresh run (a new run id);
* a non-empty ``--out`` without ``run.json``: an error, with or without ``--overwrite``: flowtrain
  never writes into, or deletes from, a directory it cannot prove is its own;
* ``--resume``: the marker must be there and the options that define the run must be the same
  (the budget ``--epochs``/``--steps``/``--patience`` and where it runs may change:
  ``RESUME_MAY_CHANGE``); options not given are taken from the marker; the checkpoint resumed from
  must belong to this run id (``flowtrain.train.checkpoint``);
* ``--overwrite``, or a run of the same options again, or any run after a failed one that left no
  model: the earlier run's files are deleted first (only those it recorded in ``files``, or for a run
  that crashed before recording them, those of ``RUN_FILES``; the bundle and the dataset only if they
  hold nothing else; the checkpoints only of that run id), then a fresh run starts with a new run id;
  files of others in the directory stay. A symbolic link where a run file or directory belongs, or a
  file flowtrain did not write in ``bundle/``, is an error naming it before anything is deleted:
  flowtrain never follows a link when it deletes or replaces run files;
* anything else (a run with other options there): an error naming the options that differ.

One run at a time: ``prepare_run_dir`` and ``prepare_stream_dir`` take an exclusive lock on the directory
(``fcntl.flock`` on the directory itself: no lock file is left in it) before they look at what it holds, and
the run keeps it until ``mark_complete`` or ``mark_failed`` (``release``), or until its process ends (a killed
run's lock goes with it, so ``--resume`` works at once). A second run of the same ``--out`` meanwhile is a
``RunDirError`` naming the directory and the running run's pid (``run.json`` records ``pid`` and ``host``
while a run holds it).

The marker's format, reading and writing are ``flowtrain.train.rundir.marker``; the lock is
``flowtrain.train.rundir.lock``; the table of a run's files is ``flowtrain.train.rundir.files``.
"""
from __future__ import annotations

import calendar
import hashlib
import json
import os
import socket
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from connectors.dataset import DatasetError, owned_files, remove_dataset
from connectors.secrets import REDACTED, is_secret, redact
from connectors.spill import remove_stale_spills
from flowtrain.errors import FlowtrainError
from flowtrain.train import checkpoint
from flowtrain.train.bundle import owned_bundle_files, remove_bundle
from flowtrain.train.rundir.files import RUN_DIRS, RUN_FILES, RunFiles
from flowtrain.train.rundir.lock import held, lock, lockable, release
from flowtrain.train.rundir.marker import FORMAT, RUN_MARKER, RunDirError, read_marker, running, write_marker

__all__ = ["RESUME_MAY_CHANGE", "RunDir", "prepare_run_dir", "mark_complete", "mark_failed",
           "options_hash", "prepare_stream_dir", "STREAM_IDENTITY"]

#: Options that are not part of a run's identity at all (where it is, how it is shown).
NOT_IDENTITY = frozenset({"out", "resume", "overwrite", "config", "no_progress"})
#: Options a ``--resume`` may change: the budget, and where and how fast it runs.
RESUME_MAY_CHANGE = NOT_IDENTITY | {"epochs", "steps", "patience", "threads", "workers", "failure_timeout",
                                    "job_only", "dataset", "device", "memory_budget", "runner", "flink_master",
                                    "shard_states", "worker_memory", "print_plan"}  # a ZeRO checkpoint is whole


@dataclass
class RunDir:
    """A run directory made this process's (``prepare_run_dir``, ``prepare_stream_dir``): its files (``files``), its
    run id and options, and its end (``complete``, ``fail``; ``release`` lets go of the lock without an end, for the
    processes that take the run over)."""
    path: Path
    run_id: str
    #: the options of the run: for a resume, the recorded ones updated with those given
    options: dict
    resumed: bool = False
    #: a line for the user when an earlier run's files were replaced (None otherwise)
    note: str | None = None

    @property
    def files(self) -> RunFiles:
        return RunFiles(self.path)

    def complete(self) -> None:
        """The run's last output is written: ``run.json`` says complete, lists the files, the lock is let go."""
        mark_complete(self.path)

    def fail(self, error: BaseException | str) -> None:
        """The run stopped on ``error``: ``run.json`` says failed and why, the lock is let go."""
        mark_failed(self.path, self.run_id, error)

    def release(self) -> None:
        """Let go of the directory's lock, the run going on elsewhere (``--job-only``: torchrun's nodes)."""
        release(self.path)


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


def mark_complete(path: str | Path) -> None:
    """Record that the run in ``path`` finished: call it after the last final output is written. The
    marker records the files the run wrote (``files``): what a later run that replaces it may delete."""
    path = Path(path)
    marker = read_marker(path)
    if marker is None:
        raise RunDirError(f"{path} has no {RUN_MARKER}: prepare_run_dir was not called for it")
    marker["status"] = "complete"
    for key in ("error", "pid", "host"):
        marker.pop(key, None)
    marker["files"] = _written(path, marker)
    write_marker(path, marker)
    release(path)


def mark_failed(path: str | Path, run_id: str, error: BaseException | str) -> None:
    """Record that run ``run_id`` in ``path`` stopped on ``error``: ``status`` ``failed``, the error's first
    line, and the files it wrote. A later run of the same ``--out`` replaces a failed run that left no
    model without ``--overwrite``. Nothing happens when ``path`` holds another run's marker (or none)."""
    path = Path(path)
    try:
        marker = read_marker(path)
        if marker is not None and marker.get("run_id") == run_id:
            _record_failure(path, marker, error)
    except RunDirError:
        pass
    finally:
        release(path)  # the run has ended, whatever its marker says


def _record_failure(path: Path, marker: dict, error: BaseException | str) -> None:
    marker.pop("pid", None)
    marker.pop("host", None)
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    what = type(error).__name__ if isinstance(error, BaseException) else ""
    marker["status"] = "failed"
    marker["error"] = redact(f"{what}: {text}" if what and not isinstance(error, FlowtrainError) else text or what)[:1000]
    marker["files"] = _written(path, marker)
    write_marker(path, marker)


def _found_dead(path: Path, marker: dict | None) -> str | None:
    """When ``marker`` says a run is running but its process has ended without recording it (this process
    holds the directory's lock, and the marker names this host): the marker recorded ``failed``, and the line
    saying so. None otherwise (no run, one that ended, or one on another host: not provably dead)."""
    if marker is None or marker.get("status") != "running" or not held(path) \
            or marker.get("host", socket.gethostname()) != socket.gethostname() \
            or marker.get("pid") == os.getpid():  # this very process's run, not ended yet: alive
        return None
    who = f"pid {marker['pid']} on host {marker.get('host')}" if marker.get("pid") else "pid not recorded"
    error = (f"its process ({who}) died without recording the run's end (a native crash such as SIGSEGV, "
             f"SIGKILL, or the machine stopped); found by the next run on this --out")
    _record_failure(path, marker, error)
    return f"{path}: the earlier {marker.get('command', 'flowtrain')} run {marker.get('run_id')}: {error}; recorded " \
           f"as failed in {RUN_MARKER}"


def _link_on_the_way(path: Path, rel: str) -> Path | None:
    """The first of ``path/rel``'s components below ``path`` (``rel`` itself included) that is a symbolic link."""
    here = path
    for part in Path(rel).parts:
        here = here / part
        if here.is_symlink():
            return here
    return None


def _created(marker: dict) -> float | None:
    try:
        return float(calendar.timegm(time.strptime(str(marker.get("created")), "%Y-%m-%dT%H:%M:%SZ")))
    except (TypeError, ValueError, OverflowError):
        return None


def _written(path: Path, marker: dict) -> list[str]:
    """The files of ``RUN_FILES`` in ``path`` written since the run of ``marker`` was created (relative paths,
    sorted): found without following any link (a file behind a linked directory is not the run's)."""
    since = _created(marker)
    found = set()
    for pattern in RUN_FILES:
        for p in path.glob(pattern):
            rel = str(p.relative_to(path))
            if _link_on_the_way(path, rel) is None and p.is_file() and (
                    since is None or p.stat().st_mtime >= since - 1):
                found.add(rel)
    return sorted(found)


def _recorded(path: Path, marker: dict) -> list[str]:
    """What the run of ``marker`` wrote: the ``files`` it recorded (a run that completed or failed); for a run
    that crashed before recording them, what ``_written`` finds."""
    files = marker.get("files")
    if not isinstance(files, list):
        return _written(path, marker)
    good = []
    for rel in files:
        if not isinstance(rel, str) or not rel or Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise RunDirError(f"{path / RUN_MARKER} lists {rel!r} among the run's files, which is not a path inside "
                              f"the run directory; flowtrain deletes nothing: check the marker, or choose another "
                              f"--out")
        if Path(rel).parts[0] not in ("bundle", "dataset"):  # replaced whole, by their own manifests
            good.append(rel)
    return good


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


def _links(path: Path) -> list[Path]:
    """The run's directories that are symbolic links (``RUN_DIRS``, found without following one)."""
    found = []
    for pattern in RUN_DIRS:
        for d in path.glob(pattern):
            link = _link_on_the_way(path, str(d.relative_to(path)))
            if link is not None and link not in found:
                found.append(link)
    return found


def _clear(path: Path, marker: dict, *, keep_dataset: bool = False) -> int:
    """Delete what the run of ``marker`` wrote in ``path``; returns how many files. Checks first, and an
    error names what fails before anything is deleted: a symbolic link in place of a run file or
    directory (never followed), a dataset or bundle holding anything flowtrain did not write.
    ``keep_dataset``: the new run reads ``dataset/`` (``--dataset <out>/dataset``), so it stays."""
    run_id = marker.get("run_id")
    files = [rel for rel in _recorded(path, marker)
             if not (keep_dataset and rel == "dead_letters.jsonl")]  # the dataset's own dead letters
    links = _links(path) + [link for rel in files if (link := _link_on_the_way(path, rel)) is not None]
    if links:
        shown = ", ".join(f"{p.relative_to(path)} -> {os.readlink(p)}" for p in dict.fromkeys(links))
        raise RunDirError(f"{path} holds an earlier flowtrain run, but {shown} is a symbolic link where the run "
                          f"wrote its files; flowtrain never follows a link when it replaces or deletes run files, "
                          f"and deleted nothing: remove the link, or choose another --out")
    dataset, bundle = path / "dataset", path / "bundle"
    try:
        if dataset.exists() and not keep_dataset:
            owned_files(dataset)
        owned_bundle_files(bundle, "--out: its bundle/")
    except (DatasetError, FlowtrainError) as err:
        raise RunDirError(f"{path} holds an earlier flowtrain run, but {err}") from None
    ckpts = path / "checkpoints"
    for ckpt in checkpoint.all_checkpoints(ckpts) if ckpts.is_dir() else []:
        if checkpoint.run_of(ckpt) == run_id:
            files += [str(ckpt.relative_to(path)), str(ckpt.with_suffix(".sha256").relative_to(path))]
    gone = 0
    for rel in dict.fromkeys(files):
        f = path / rel
        if f.is_file() and not f.is_symlink():
            f.unlink()
            gone += 1
    checkpoint.remove_temporaries(ckpts, run_id)
    gone += len(remove_bundle(bundle, "--out: its bundle/"))
    gone += len(remove_dataset(dataset)) if dataset.exists() and not keep_dataset else 0
    for pattern in RUN_DIRS:
        for d in sorted(path.glob(pattern), key=lambda q: len(q.parts), reverse=True):
            if d.is_dir() and not d.is_symlink():
                try:
                    d.rmdir()  # only when empty: what others put there stays
                except OSError:
                    pass
    return gone


def _has_model(path: Path, marker: dict) -> bool:
    """Whether the run of ``marker`` left a model: ``model.pt``, a bundle or a checkpoint of its own."""
    ckpts = path / "checkpoints"
    return (path / "model.pt").exists() or (path / "bundle").exists() or any(
        checkpoint.run_of(c) == marker.get("run_id") for c in (checkpoint.all_checkpoints(ckpts)
                                                               if ckpts.is_dir() and not ckpts.is_symlink() else []))


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

    The directory is locked for this run first (module docstring): a run of it in progress is a
    ``RunDirError`` naming its pid. ``mark_complete``/``mark_failed`` let go of the lock.
    """
    path = Path(path).resolve()
    if resume and overwrite:
        raise RunDirError("--resume and --overwrite contradict each other: --resume continues the run in --out, "
                          "--overwrite replaces it; give one")
    if path.exists() and not path.is_dir():
        raise RunDirError(f"--out {path} is a file, not a directory")
    if not lockable(path, resume):  # says why (not flowtrain's, nothing to resume): nothing made, nothing locked
        return _prepare(path, options, resume=resume, overwrite=overwrite, command=command)
    path.mkdir(parents=True, exist_ok=True)
    lock(path)
    try:
        return _prepare(path, options, resume=resume, overwrite=overwrite, command=command)
    except BaseException:
        release(path)
        raise


def _prepare(path: Path, options: Mapping[str, Any], *, resume: bool, overwrite: bool, command: str) -> RunDir:
    given = dict(options)
    entries = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    marker = read_marker(path) if entries else None
    died = _found_dead(path, marker)  # a run whose process died is a failed run from here on
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())

    def fresh(note: str | None = None) -> RunDir:
        path.mkdir(parents=True, exist_ok=True)
        run_id = uuid.uuid4().hex[:16]
        write_marker(path, running({"format": FORMAT, "command": command, "run_id": run_id,
                                      "options_hash": options_hash(given), "options": _recordable(given),
                                      "status": "running", "created": now}))
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
        links = _links(path) + [p for pattern in RUN_FILES for p in path.glob(pattern) if p.is_symlink()]
        if links:  # the resumed run would write (and prune) through them
            shown = ", ".join(f"{p.relative_to(path)} -> {os.readlink(p)}" for p in dict.fromkeys(links))
            raise RunDirError(f"--resume: in {path}, {shown} is a symbolic link where the run writes its files; "
                              f"flowtrain never writes or deletes through a link: remove it, or choose another --out")
        try:  # the bundle the resumed run replaces at its end must be flowtrain's: said now, not after training
            owned_bundle_files(path / "bundle", "--out: its bundle/")
        except FlowtrainError as err:
            raise RunDirError(f"--resume: {err}") from None
        try:  # a loadable checkpoint of this very run: never another run's state, never a silent start over
            checkpoint.require_latest(path / "checkpoints", run_id=marker["run_id"])
        except checkpoint.CheckpointError as err:
            raise RunDirError(f"--resume: {err}; check --out, or leave out --resume (with --overwrite) to start "
                              f"the run over") from None
        merged = {**{k: v for k, v in recorded.items() if REDACTED not in json.dumps(v, default=str)}, **given}
        marker["status"] = "running"
        for key in ("files", "error"):  # recorded again when the resumed run ends
            marker.pop(key, None)
        write_marker(path, running(marker))
        remove_stale_spills(path / "dataset")
        return RunDir(path, marker["run_id"], merged, resumed=True, note=died)
    failed = marker.get("status") == "failed" and not _has_model(path, marker)
    if overwrite or marker.get("options_hash") == options_hash(given) or failed:
        reads_own = given.get("dataset") is not None and Path(os.path.abspath(str(given["dataset"]))) == \
            path / "dataset"
        n = _clear(path, marker, keep_dataset=reads_own)
        remove_stale_spills(path / "dataset")
        if failed and not overwrite:
            error = str(marker.get("error") or "no error recorded")
            return fresh(f"{path}: replaced flowtrain's own failed run {marker['run_id']} (it failed: "
                         f"{error[:200]}; it left no model; {n} file(s) it wrote deleted)")
        why = "--overwrite" if overwrite else "the same options"
        return fresh("\n".join(filter(None, [died, f"{path}: replaced the earlier run {marker['run_id']} ({why}; "
                                                    f"{n} file(s) it wrote deleted)"])))
    diffs = "; ".join(_differences(recorded, _identity(given, NOT_IDENTITY), NOT_IDENTITY)) or "options differ"
    raise RunDirError(f"--out {path} holds a flowtrain run with other options ({diffs}"
                      f"{'; it failed: its process died' if died else ''}); "
                      f"give --resume to continue it, --overwrite to replace it, or choose another --out")


#: The options that define an online trainer's run (``flowtrain stream train``): what it trains on and the
#: model. Everything else (budget, workers, checkpoint cadence, Kafka settings, keys) may change between starts.
STREAM_IDENTITY = ("dataset", "features_topic", "updates_topic", "init_weights", "hidden", "dropout", "seed", "lr")


def prepare_stream_dir(path: str | Path, options: Mapping[str, Any], *, command: str = "stream train") -> RunDir:
    """The run-directory rules for an online trainer's ``--out``, before it writes anything: a new or empty
    directory starts a run (``run.json`` written first); a directory holding the same trainer's run
    (``STREAM_IDENTITY`` equal) continues it, as a restarted trainer does from its checkpoint; anything
    else is a ``RunDirError`` naming the directory, and the options that differ: a directory that is not a
    flowtrain run (flowtrain never writes into it), another command's run, or a run of other options."""
    path = Path(os.path.abspath(path))
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise RunDirError(f"--out {path} is {'a symbolic link' if path.is_symlink() else 'a file'}, not a "
                          f"directory; choose another --out")
    if not lockable(path, False):  # not flowtrain's: said without making or locking anything
        return _prepare_stream(path, options, command)
    path.mkdir(parents=True, exist_ok=True)
    lock(path)  # held while this process runs the trainer (one trainer per --out)
    try:
        return _prepare_stream(path, options, command)
    except BaseException:
        release(path)
        raise


def _prepare_stream(path: Path, options: Mapping[str, Any], command: str) -> RunDir:
    given = {k: options.get(k) for k in STREAM_IDENTITY if options.get(k) not in (None, (), [], "")}
    entries = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    marker = read_marker(path) if entries else None
    died = _found_dead(path, marker)  # recorded failed; a trainer continues from its checkpoint all the same
    if died:
        print(died, file=sys.stderr, flush=True)
    if not entries:
        path.mkdir(parents=True, exist_ok=True)
        run_id = uuid.uuid4().hex[:16]
        write_marker(path, running({"format": FORMAT, "command": command, "run_id": run_id,
                                      "options_hash": options_hash(given), "options": _recordable(given),
                                      "status": "running",
                                      "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}))
        return RunDir(path, run_id, dict(options))
    if marker is None:
        shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
        raise RunDirError(f"--out {path} is not empty ({shown}) and is not a flowtrain run directory (no "
                          f"{RUN_MARKER}); flowtrain never writes into a directory it cannot prove is its own: "
                          f"choose a new or empty --out")
    if marker.get("command") != command:
        raise RunDirError(f"--out {path} holds a 'flowtrain {marker.get('command')}' run, not a '{command}' run; "
                          f"choose another --out")
    if marker.get("options_hash") != options_hash(given):
        diffs = "; ".join(_differences(dict(marker.get("options") or {}), redact(given), ())) or "options differ"
        raise RunDirError(f"--out {path} holds a flowtrain {command} run with other options ({diffs}); a trainer "
                          f"continues its run only with the options it started with: give those, or choose "
                          f"another --out")
    marker["status"] = "running"
    write_marker(path, running(marker))
    return RunDir(path, marker["run_id"], dict(options), resumed=True)

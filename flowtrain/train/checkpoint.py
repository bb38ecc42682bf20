"""Checkpoints: temp file, fsync, rename, with a SHA-256 beside it.

A checkpoint is a dict of tensors and plain Python values, so ``torch.load(path,
weights_only=True)`` opens it without running any pickled code. ``latest`` finds the newest
one whose checksum matches: a torn or corrupted file is skipped, never loaded.
``load_latest`` loads the newest checkpoint that verifies *and* loads, falling back to the one
before when the newest is corrupt; ``require_latest`` makes "no loadable checkpoint" an error
that names every file and why (a resume must never silently start over).

Runs: ``save(..., run_id=ID)`` records the run in the checksum file beside the checkpoint. Pruning
(``keep``) only ever deletes checkpoints of that same run, and ``latest`` / ``load_latest`` /
``require_latest`` given a ``run_id`` only consider that run's checkpoints: another run's files in
the same directory are never loaded, resumed from or deleted. A checkpoint is written as
``ckpt-<step>.pt.tmp-<run id>`` first; a failed save removes it, and ``remove_temporaries(directory,
run_id)`` (called when a run starts) removes those a crash of the same run left.
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path
from typing import Any

import torch

from connectors.atomic import atomic_file

_NAME = re.compile(r"^ckpt-(\d{9})\.pt$")
_log = logging.getLogger(__name__)
#: ``run_id`` default of the readers: any run's checkpoints (callers that keep no run id).
ANY_RUN = object()


class CheckpointError(ValueError):
    """No loadable checkpoint where one is required; the message names the files and why."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class _HashingWriter:
    """A binary file that also hashes what is written to it (the checksum without reading the file back)."""

    def __init__(self, fh):
        self._fh, self._h = fh, hashlib.sha256()

    def write(self, data) -> int:
        self._h.update(data)
        return self._fh.write(data)

    def flush(self) -> None:
        self._fh.flush()

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def _tmp_suffix(run_id: str | None) -> str:
    return f".tmp-{run_id}" if run_id else ".tmp"


def save(directory: str | Path, step: int, state: dict[str, Any], *, keep: int = 3, run_id: str | None = None) -> Path:
    """Write ``ckpt-<step>.pt`` and its ``.sha256`` (which records ``run_id``) atomically; keep the
    newest ``keep`` checkpoints *of this run* (another run's are never deleted)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"ckpt-{step:09d}.pt"
    side = final.with_suffix(".sha256")
    # the one atomic writer (tmp beside the target, fsync, rename); a failed save removes its tmp
    with atomic_file(final, tmp_name=final.name + _tmp_suffix(run_id)) as fh:
        hashing = _HashingWriter(fh)
        torch.save(state, hashing)
    with atomic_file(side, tmp_name=side.name + _tmp_suffix(run_id)) as fh:
        fh.write(json.dumps({"file": final.name, "sha256": hashing.hexdigest(), "step": step,
                             "run_id": run_id}).encode())
    if keep:
        mine = [p for p in all_checkpoints(directory) if run_of(p) == run_id]
        for old in mine[:-keep]:
            old.unlink(missing_ok=True)
            old.with_suffix(".sha256").unlink(missing_ok=True)
    return final


def run_of(path: str | Path) -> str | None:
    """The run id recorded beside checkpoint ``path`` (None: none recorded, or no readable checksum file)."""
    try:
        return json.loads(Path(path).with_suffix(".sha256").read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def remove_temporaries(directory: str | Path, run_id: str | None) -> list[Path]:
    """Delete the ``ckpt-*.pt.tmp-<run_id>`` (and checksum) files a crash of run ``run_id`` left."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    suffix = _tmp_suffix(run_id)
    gone = [p for p in directory.iterdir() if p.name.startswith("ckpt-") and p.name.endswith(suffix)
            and (p.name.endswith(".pt" + suffix) or p.name.endswith(".sha256" + suffix))]
    for p in gone:
        p.unlink(missing_ok=True)
    return gone


def _mine(directory: str | Path, run_id) -> list[Path]:
    files = all_checkpoints(directory)
    return files if run_id is ANY_RUN else [p for p in files if run_of(p) == run_id]


def all_checkpoints(directory: str | Path) -> list[Path]:
    directory = Path(directory)
    if not directory.exists():
        return []
    return sorted(p for p in directory.iterdir() if _NAME.match(p.name))


def verify(path: Path) -> bool:
    side = path.with_suffix(".sha256")
    try:
        return json.loads(side.read_text())["sha256"] == _sha256(path)
    except (OSError, ValueError, KeyError):
        return False


def latest(directory: str | Path, *, run_id=ANY_RUN) -> Path | None:
    """The newest checkpoint (of run ``run_id``, when given) whose checksum matches, or None."""
    for path in reversed(_mine(directory, run_id)):
        if verify(path):
            return path
    return None


def load(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not verify(path):
        raise ValueError(f"checkpoint {path} does not match its checksum ({path.with_suffix('.sha256').name}); "
                         f"it is torn or corrupted")
    return torch.load(path, weights_only=True, map_location="cpu")


def _problem(path: Path) -> str | None:
    side = path.with_suffix(".sha256")
    if not side.exists():
        return f"has no {side.name} (an interrupted save)"
    if not verify(path):
        return f"does not match its checksum in {side.name} (torn or corrupted)"
    return None


def load_latest(directory: str | Path, *, run_id=ANY_RUN) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint (of run ``run_id``, when given) that verifies and loads, with its state;
    None when there is none. A corrupt newer one is skipped (logged with the reason) in favour of the
    one before."""
    skipped = []
    for path in reversed(_mine(directory, run_id)):
        reason = _problem(path)
        if reason is None:
            try:
                state = torch.load(path, weights_only=True, map_location="cpu")
            except Exception as err:  # noqa: BLE001 - any unloadable file falls back to the previous one
                reason = f"cannot be loaded ({type(err).__name__}: {err})"
            else:
                for bad, why in skipped:
                    _log.warning("checkpoint %s skipped: it %s; using %s", bad.name, why, path.name)
                return path, state
        skipped.append((path, reason))
    return None


def require_latest(directory: str | Path, *, run_id=ANY_RUN) -> tuple[Path, dict[str, Any]]:
    """``load_latest``, but no loadable checkpoint is a ``CheckpointError`` naming each file and why;
    with ``run_id``, checkpoints of another run are named as such and never loaded."""
    found = load_latest(directory, run_id=run_id)
    if found is not None:
        return found
    files = _mine(directory, run_id)
    if not files:
        others = all_checkpoints(directory)
        if others:
            owners = sorted({str(run_of(p)) for p in others})
            raise CheckpointError(f"{directory} holds {len(others)} checkpoint(s) ({others[-1].name}, ...) of "
                                  f"another run (run id {', '.join(owners)}), none of this run ({run_id}); "
                                  f"a resume never continues another run's state")
        raise CheckpointError(f"{directory} holds no checkpoint (ckpt-<step>.pt)")
    reasons = "; ".join(f"{p.name} {_problem(p) or 'cannot be loaded'}" for p in reversed(files))
    raise CheckpointError(f"none of the {len(files)} checkpoint(s) in {directory} can be loaded: {reasons}")

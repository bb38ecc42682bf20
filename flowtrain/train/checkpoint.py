"""Checkpoints: temp file, fsync, rename, with a SHA-256 beside it.

A checkpoint is a dict of tensors and plain Python values, so ``torch.load(path,
weights_only=True)`` opens it without running any pickled code. ``latest`` finds the newest
one whose checksum matches: a torn or corrupted file is skipped, never loaded.
``load_latest`` loads the newest checkpoint that verifies *and* loads, falling back to the one
before when the newest is corrupt; ``require_latest`` makes "no loadable checkpoint" an error
that names every file and why (a resume must never silently start over).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch

from connectors.atomic import fsync_dir

_NAME = re.compile(r"^ckpt-(\d{9})\.pt$")
_log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """No loadable checkpoint where one is required; the message names the files and why."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def save(directory: str | Path, step: int, state: dict[str, Any], *, keep: int = 3) -> Path:
    """Write ``ckpt-<step>.pt`` and its ``.sha256`` atomically; keep the newest ``keep``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"ckpt-{step:09d}.pt"
    tmp = final.with_suffix(".pt.tmp")
    with open(tmp, "wb") as fh:
        torch.save(state, fh)
        fh.flush()
        os.fsync(fh.fileno())
    digest = _sha256(tmp)
    os.replace(tmp, final)
    side = final.with_suffix(".sha256")
    side_tmp = side.with_suffix(".sha256.tmp")
    side_tmp.write_text(json.dumps({"file": final.name, "sha256": digest, "step": step}))
    os.replace(side_tmp, side)
    fsync_dir(directory)
    for old in sorted(all_checkpoints(directory))[:-keep] if keep else []:
        old.unlink(missing_ok=True)
        old.with_suffix(".sha256").unlink(missing_ok=True)
    return final


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


def latest(directory: str | Path) -> Path | None:
    """The newest checkpoint whose checksum matches, or None."""
    for path in reversed(all_checkpoints(directory)):
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


def load_latest(directory: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that verifies and loads, with its state; None when the directory has
    none. A corrupt newer one is skipped (logged with the reason) in favour of the one before."""
    skipped = []
    for path in reversed(all_checkpoints(directory)):
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


def require_latest(directory: str | Path) -> tuple[Path, dict[str, Any]]:
    """``load_latest``, but no loadable checkpoint is a ``CheckpointError`` naming each file and why."""
    found = load_latest(directory)
    if found is not None:
        return found
    files = all_checkpoints(directory)
    if not files:
        raise CheckpointError(f"{directory} holds no checkpoint (ckpt-<step>.pt)")
    reasons = "; ".join(f"{p.name} {_problem(p) or 'cannot be loaded'}" for p in reversed(files))
    raise CheckpointError(f"none of the {len(files)} checkpoint(s) in {directory} can be loaded: {reasons}")

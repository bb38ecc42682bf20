"""Files that appear whole or not at all: written under a temporary name in the same directory,
fsynced, then renamed over the final name (and the directory fsynced, so the rename survives a
crash).

Every final output of a run (``model.pt``, ``summary.json``, ``report.md``, ``config.json``, the
plots, ...) and every checkpoint is written through ``atomic_write`` or ``atomic_file``: a reader
(or a crash) sees the old file or the new one, never a truncated one. The temporary name is
``.<name>.tmp-<id>`` beside the target; a failed write removes it.

Local (or mounted) paths only: object stores make an object visible when its writer closes,
which is atomic already. ``file_sha256`` is the checksum readers compare with the one recorded
beside a file (checkpoints, bundles) to tell a whole file from a damaged one.
"""
from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

__all__ = ["atomic_write", "atomic_file", "file_sha256", "fsync_dir", "TMP_INFIX"]

#: ``.<name>.tmp-<id>``: how a file being written is named beside its target.
TMP_INFIX = ".tmp-"


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or a new file in ``path`` durable (fsync of the directory itself)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "wb", *, tmp_name: str | None = None) -> Iterator[IO]:
    """Open a temporary file beside ``path``; on a clean exit it is flushed, fsynced and renamed to
    ``path``; on an exception it is removed and ``path`` is left as it was.

    ``tmp_name``: the temporary file's name in the same directory (default ``.<name>.tmp-<id>``).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(tmp_name or f".{path.name}{TMP_INFIX}{uuid.uuid4().hex[:12]}")
    fh = open(tmp, mode)
    try:
        yield fh
        fh.flush()
        os.fsync(fh.fileno())
        fh.close()
        os.replace(tmp, path)
    except BaseException:
        fh.close()
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write(path: str | os.PathLike, data: bytes | str) -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` atomically; returns the path."""
    with atomic_file(path, "wb") as fh:
        fh.write(data.encode("utf-8") if isinstance(data, str) else data)
    return Path(path)


def file_sha256(path: str | os.PathLike) -> str:
    """The SHA-256 of the file at ``path`` (hex), read in blocks (``hashlib.file_digest``)."""
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()

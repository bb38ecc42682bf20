"""Paths on any Beam filesystem: a local path made absolute (workers may run elsewhere), a URL as given."""
from __future__ import annotations

import os
from pathlib import Path

from apache_beam.io.filesystems import FileSystems
from apache_beam.io.localfilesystem import LocalFileSystem

__all__ = ["absolute_path", "is_local_path"]


def is_local_path(path: str | os.PathLike) -> bool:
    """True for a path on the local (or a mounted) filesystem, where a directory rename commits."""
    return isinstance(FileSystems.get_filesystem(str(path)), LocalFileSystem)


def absolute_path(path: str | os.PathLike) -> str:
    """An absolute local path, or the URL as given (without a trailing slash)."""
    path = str(path)
    return str(Path(path).resolve()) if FileSystems.get_scheme(path) is None else path.rstrip("/")

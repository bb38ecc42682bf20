"""Paths on any Beam filesystem: a local path made absolute (workers may run elsewhere), a URL as given.

``check_path(path, option)`` is the one check every path option goes through (``connectors.fields.store_path``):
a URL (``scheme://...``) whose scheme has no installed filesystem is a ``StoreError`` naming the scheme and the
extra to install (``pip install 'flowtrain[gcs]'``), never a local folder named ``gs:``. Object stores:
docs/object-stores.md.
"""
from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

__all__ = ["absolute_path", "is_local_path", "url_scheme", "is_url", "check_path", "StoreError", "STORE_EXTRAS",
           "note_origin", "origin_of", "origins"]

#: ``scheme://`` at the start of a path (RFC 3986 scheme characters; one letter is a Windows drive, not a URL).
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]+)://")

#: The object stores flowtrain names: scheme -> (the flowtrain extra, the Python package it installs, its
#: import name). ``azfs`` is Beam's name for Azure Blob Storage (``azfs://ACCOUNT/CONTAINER/PATH``); flowtrain
#: reads and writes it through adlfs as it does ``az://CONTAINER/PATH``.
STORE_EXTRAS: dict[str, tuple[str, str, str]] = {
    "gs": ("gcs", "gcsfs", "gcsfs"), "gcs": ("gcs", "gcsfs", "gcsfs"),
    "s3": ("s3", "s3fs", "s3fs"), "s3a": ("s3", "s3fs", "s3fs"),
    "az": ("azure", "adlfs", "adlfs"), "abfs": ("azure", "adlfs", "adlfs"), "abfss": ("azure", "adlfs", "adlfs"),
    "azfs": ("azure", "adlfs", "adlfs"),
    "hdfs": ("", "pyarrow (with Hadoop's libhdfs and $HADOOP_HOME)", "pyarrow"),
}


class StoreError(ValueError):
    """A path on a filesystem that is not installed or not supported there; the message says what to do."""


def url_scheme(path: str | os.PathLike | None) -> str | None:
    """The scheme of a URL (``gs`` of ``gs://b/x``, lower case); None for a local path (``file://`` too)."""
    if path is None:
        return None
    m = _URL.match(str(path))
    if m is None:
        return None
    scheme = m.group(1).lower()
    return None if scheme in ("file", "local") else scheme


def is_url(path: str | os.PathLike | None) -> bool:
    """True for a path on an object store or another remote filesystem (``scheme://...``, not ``file://``)."""
    return url_scheme(path) is not None


def _fsspec_known(scheme: str) -> tuple[bool, str | None]:
    """(known to fsspec, the class's module) for a scheme flowtrain does not name itself."""
    try:
        from fsspec.registry import known_implementations, registry
    except ImportError:
        return False, None
    if scheme in registry:
        return True, None
    known = known_implementations.get(scheme)
    if known is None:
        return False, None
    return True, known["class"].rsplit(".", 1)[0]


def check_path(path: str | os.PathLike, option: str = "path", *, remote: bool = True) -> str:
    """``path`` as given when it is local, or a URL whose filesystem is installed; else a ``StoreError`` (one line)
    naming ``option``, the scheme and what to install. ``remote=False``: this option takes a local (or mounted)
    path only, and a URL is an error saying so."""
    text = str(path)
    scheme = url_scheme(text)
    if scheme is None:
        return text
    if not remote:
        raise StoreError(f"{option} {text}: this option takes a local (or mounted) path, not a URL ({scheme}://); "
                         f"object stores are for --out, --dataset, --model, --input of batch, predict and export "
                         f"(docs/object-stores.md)")
    if scheme in STORE_EXTRAS:
        extra, package, module = STORE_EXTRAS[scheme]
        if importlib.util.find_spec(module) is None:
            how = f"pip install 'flowtrain[{extra}]' ({package})" if extra else f"install {package}"
            raise StoreError(f"{option} {text}: no filesystem for {scheme}:// is installed; {how}")
        return text
    known, module = _fsspec_known(scheme)
    if not known:
        raise StoreError(f"{option} {text}: {scheme}:// is not a filesystem flowtrain knows (gs, s3, az, azfs, hdfs "
                         f"or another fsspec filesystem); give a local path or a supported URL "
                         f"(docs/object-stores.md)")
    if module is not None and importlib.util.find_spec(module.split(".")[0]) is None:
        raise StoreError(f"{option} {text}: no filesystem for {scheme}:// is installed; pip install "
                         f"{module.split('.')[0]} (fsspec's implementation of {scheme}://)")
    return text


def is_local_path(path: str | os.PathLike) -> bool:
    """True for a path on the local (or a mounted) filesystem, where a directory rename commits."""
    if not is_url(path):  # a plain path or file://: no need to import Beam (flowtrain.load stays Beam-free)
        return True
    if url_scheme(path) not in _beam_schemes():
        return False
    from apache_beam.io.filesystems import FileSystems
    from apache_beam.io.localfilesystem import LocalFileSystem

    return isinstance(FileSystems.get_filesystem(str(path)), LocalFileSystem)


def _beam_schemes() -> set:
    from apache_beam.io.filesystem import FileSystem

    return {c.scheme() for c in FileSystem.get_all_subclasses()}


#: Local copies of files downloaded from an object store in this process -> the URL each came from.
_ORIGINS: dict[str, str] = {}


def note_origin(local: str | os.PathLike, url: str) -> None:
    """Record that ``local`` is this process's downloaded copy of ``url``: wherever a source is recorded (a row's
    ``_source_file``, a dead letter's source, ``pred_source``, a dataset manifest's ``inputs``) it is named
    ``url``, never the temporary local name."""
    _ORIGINS[os.path.realpath(local)] = url


def origin_of(path: str | os.PathLike) -> str:
    """The URL a downloaded local copy came from (``note_origin``); any other path as given."""
    text = str(path)
    if is_url(text) or not _ORIGINS:
        return text
    return _ORIGINS.get(os.path.realpath(text.removeprefix("file://")), text)


def origins(paths) -> dict[str, str]:
    """``{path: URL}`` of the downloaded copies among ``paths`` (their local and real names both)."""
    out = {}
    for path in paths:
        url = origin_of(path)
        if url != str(path):
            out[str(path)] = out[os.path.realpath(str(path))] = url
    return out


def absolute_path(path: str | os.PathLike) -> str:
    """An absolute local path, or the URL as given (without a trailing slash)."""
    path = str(path)
    if not is_url(path) and not path.startswith("file://"):
        return str(Path(path).resolve())
    from apache_beam.io.filesystems import FileSystems

    return str(Path(path).resolve()) if FileSystems.get_scheme(path) is None else path.rstrip("/")

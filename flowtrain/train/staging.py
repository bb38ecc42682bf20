"""Run directories, datasets, bundles and predictions on object stores (``gs://``, ``s3://``, ``az://``,
``azfs://``...), through fsspec: a local working copy, published write-then-mark.

Object stores have no directory rename, so a directory cannot appear whole at once. flowtrain works in a local
staging directory (the engine, the ETL and the run-directory rules of ``flowtrain.train.rundir`` run there,
unchanged) and publishes it file by file; each object appears whole (an object store replaces an object
atomically), and the marker that says a directory is complete is written after everything it vouches for:

* ``Staged.pull()`` downloads the remote directory (a ``--resume`` needs its checkpoints, the run-directory rules
  its ``run.json``; an earlier run's files are deleted only as the local rules delete them);
* ``Staged.push(marker_first=True)`` right after the run's marker says ``running``: ``run.json`` first, then the
  deletions of what the rules removed (only files that the pull saw and the local rules deleted);
* ``Staged.push()`` at the end (and after a failure): deletions, new or changed files, then the markers of their
  directories (``dataset/_manifest.json``, ``bundle/bundle.json``, a checkpoint's ``.sha256``), ``run.json``
  last. A reader that sees ``status: complete`` sees every file of the run; a crash mid-push leaves ``running``.

Inputs on an object store (``--input``, ``--dataset``, ``--model``, a run for ``export``) are downloaded once
into a temporary directory (removed when the process ends); a bundle's and a checkpoint's checksums are then
verified as for a local one. Credentials come from the environment as each filesystem reads them (adlfs:
``$AZURE_STORAGE_CONNECTION_STRING`` or ``$AZURE_STORAGE_ACCOUNT_NAME`` + key / Azure identity; gcsfs: Google's
application default credentials; s3fs: the AWS variables and profiles); never from a command line.
"""
from __future__ import annotations

import atexit
import os
import posixpath
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from connectors.atomic import TMP_INFIX
from connectors.paths import check_path, is_url, note_origin, url_scheme
from flowtrain.errors import FlowtrainError

__all__ = ["StoreAccessError", "Staged", "staged_dir", "remote_fs", "fetch_dir", "fetch_inputs", "fetch_bundle",
           "staged_outputs", "publish_run", "ROOT_MARKER", "DIR_MARKERS"]

ROOT_MARKER = "run.json"
#: Files that vouch for others in their directory: published after them.
DIR_MARKERS = ("_manifest.json", "bundle.json")


class StoreAccessError(FlowtrainError):
    """An object store could not be read or written; the message names the URL, the option and the cause."""


def _fail(option: str, url: str, what: str, err: BaseException) -> StoreAccessError:
    cause = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return StoreAccessError(f"{option} {url}: {what} failed ({type(err).__name__}: {cause[:300]}); check the URL "
                            f"and the store's credentials in the environment (docs/object-stores.md)")


def remote_fs(url: str, option: str = "path") -> tuple[Any, str]:
    """(fsspec filesystem, path on it without a trailing slash) of ``url``; ``azfs://ACCOUNT/CONTAINER/PATH``
    (Beam's form) is Azure Blob Storage through adlfs, as ``az://CONTAINER/PATH`` with that account."""
    check_path(url, option)
    import fsspec

    try:
        if url_scheme(url) == "azfs":
            account, _, rest = url.split("://", 1)[1].partition("/")
            fs = fsspec.filesystem("az", account_name=account)
            return fs, rest.rstrip("/")
        fs, root = fsspec.core.url_to_fs(url)
    except Exception as err:  # noqa: BLE001 - the filesystem's own error, named for the user
        raise _fail(option, url, "opening the filesystem", err) from None
    return fs, root.rstrip("/")


def _files_under(fs, root: str) -> dict[str, int]:
    """{relative path: size} of the objects under ``root`` (none when it does not exist)."""
    try:
        found = fs.find(root, detail=True, withdirs=False)
    except FileNotFoundError:
        return {}
    out = {}
    for key, info in found.items():
        key = key.rstrip("/")
        if info.get("type") == "directory" or key == root:
            continue
        rel = posixpath.relpath(key, root)
        if rel.startswith(".."):
            continue
        out[rel] = int(info.get("size") or 0)
    return out


def _scratch() -> Path:
    """A temporary directory of this process (removed when it ends)."""
    path = Path(tempfile.mkdtemp(prefix="flowtrain-store-"))
    atexit.register(shutil.rmtree, path, True)
    return path


def _stat(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


def _local_files(root: Path) -> dict[str, Path]:
    """The regular files under ``root`` (relative paths), without following or publishing a symbolic link."""
    out = {}
    if not root.is_dir():
        return out
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if not (here / d).is_symlink() and TMP_INFIX not in d]
        for name in filenames:
            p = here / name
            if p.is_symlink() or not p.is_file() or TMP_INFIX in name:
                continue
            out[p.relative_to(root).as_posix()] = p
    return out


def _publish_order(rels: Sequence[str]) -> list[str]:
    """Data first, then the markers of their directories (deepest first, a checkpoint's ``.sha256`` after its
    ``.pt``), ``run.json`` last."""
    def rank(rel: str) -> tuple:
        name = posixpath.basename(rel)
        if rel == ROOT_MARKER:
            return (3, 0, rel)
        if name in DIR_MARKERS:
            return (2, -rel.count("/"), rel)
        if name.endswith(".sha256"):
            return (1, 0, rel)
        return (0, 0, rel)

    return sorted(rels, key=rank)


@dataclass
class Staged:
    """A directory option (``--out``) as a local working directory; for a URL, a copy published to it."""

    option: str
    url: str
    local: Path
    remote: bool = False
    fs: Any = None
    root: str = ""
    #: what the working copy held after the pull / the last push: {relative path: (size, mtime_ns)}
    seen: dict = field(default_factory=dict)
    #: the file that says the directory is flowtrain's (``run.json``; an exported bundle's ``bundle.json``)
    marker: str = ROOT_MARKER
    _lock: Any = field(default_factory=threading.Lock, repr=False)
    _publisher: Any = field(default=None, repr=False)

    def pull(self) -> int:
        """Download the remote directory into the working copy; returns how many files."""
        if not self.remote:
            return 0
        try:
            files = _files_under(self.fs, self.root)
            if files and self.marker not in files:  # not flowtrain's: the rules refuse it; nothing is read
                for top in {rel.split("/", 1)[0] for rel in files}:
                    self.local.mkdir(parents=True, exist_ok=True)
                    (self.local / top).touch()  # its names, for the error that names them
                return 0
            for rel in files:
                target = self.local / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                self.fs.get_file(f"{self.root}/{rel}", str(target))
                self.seen[rel] = _stat(target)
        except FlowtrainError:
            raise
        except Exception as err:  # noqa: BLE001 - the store's own error, named for the user
            raise _fail(self.option, self.url, "reading", err) from None
        return len(files)

    def push(self, *, marker_first: bool = False, under: str | tuple[str, ...] | None = None) -> int:
        """Publish the working copy (module docstring: deletions, data, markers, ``run.json`` last; with
        ``marker_first`` ``run.json`` first; ``under``: only those folders, e.g. ``checkpoints/``). Returns how
        many objects were written or deleted."""
        if not self.remote:
            return 0
        with self._lock:
            return self._push(marker_first, under)

    def start_publishing(self, under: str | tuple[str, ...] = ("checkpoints/", "dataset/"),
                         every_s: float = 30.0) -> None:
        """While the run trains: publish ``under`` every ``every_s`` seconds (a checkpoint's ``.pt`` before its
        ``.sha256``, pruned ones deleted), so that a run killed mid-training can be resumed from the store."""
        if not self.remote or self._publisher is not None:
            return
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(every_s):
                try:
                    self.push(under=under)
                except (StoreAccessError, OSError) as err:  # the final publish says it again, or succeeds
                    print(f"flowtrain: {err}", file=sys.stderr, flush=True)

        thread = threading.Thread(target=loop, name="flowtrain-publish", daemon=True)
        thread.start()
        self._publisher = (stop, thread)

    def stop_publishing(self) -> None:
        if self._publisher is not None:
            stop, thread = self._publisher
            stop.set()
            thread.join(timeout=600)
            self._publisher = None

    def _push(self, marker_first: bool, under: str | tuple[str, ...] | None) -> int:
        now = _local_files(self.local)
        if under is not None:
            now = {rel: p for rel, p in now.items() if rel.startswith(under)}
        changed = []
        for rel, p in list(now.items()):
            try:
                if self.seen.get(rel) != _stat(p):
                    changed.append(rel)
            except FileNotFoundError:  # removed by the run since it was listed (a pruned checkpoint)
                now.pop(rel)
        deleted = [rel for rel in self.seen if rel not in now and (under is None or rel.startswith(under))]
        order = _publish_order(changed)
        if marker_first and ROOT_MARKER in order:
            order = [ROOT_MARKER] + [r for r in order if r != ROOT_MARKER]
            first, order = order[:1], order[1:]
        else:
            first = []
        try:
            for rel in first:
                self._put(rel, now[rel])
            for rel in deleted:  # only what the pull saw and the local rules (or the run) removed
                self.fs.rm_file(f"{self.root}/{rel}")
                self.seen.pop(rel, None)
            for rel in order:
                self._put(rel, now[rel])
        except Exception as err:  # noqa: BLE001 - the store's own error, named for the user
            raise _fail(self.option, self.url, "publishing", err) from None
        return len(first) + len(deleted) + len(order)

    def failed(self, err: BaseException, *, published: bool) -> BaseException:
        """After a run failed: publish what it left (its ``run.json`` says ``failed``, when it got that far) and
        return the error with the URL in place of the working copy's path."""
        self.stop_publishing()
        if published:
            try:
                self.push()
            except StoreAccessError as push_err:
                print(f"flowtrain: {push_err}", file=sys.stderr, flush=True)
        text = str(err)
        if isinstance(err, FlowtrainError) and str(self.local) in text:
            shown = text.replace(str(self.local), self.url)
            try:
                return type(err)(shown)
            except TypeError:
                return FlowtrainError(shown)
        return err

    def _put(self, rel: str, path: Path) -> None:
        stat = _stat(path)
        self.fs.put_file(str(path), f"{self.root}/{rel}")
        self.seen[rel] = stat


@contextmanager
def staged_dir(path: str | os.PathLike, option: str = "--out", *, pull: bool = True,
               marker: str = ROOT_MARKER) -> Iterator[Staged]:
    """``path`` as a ``Staged`` directory: a local path as it is (nothing staged); a URL as a working copy in a
    temporary directory named like the URL's last part (pulled first: only when ``marker`` is there, else just
    the names of what is there), removed when the block ends."""
    path = str(path)
    if not is_url(path):
        yield Staged(option, path, Path(path))
        return
    fs, root = remote_fs(path, option)
    tmp = Path(tempfile.mkdtemp(prefix="flowtrain-stage-"))
    staged = Staged(option, path.rstrip("/"), tmp / (posixpath.basename(root) or "run"), True, fs, root,
                    marker=marker)
    try:
        if pull:
            staged.pull()
        yield staged
    finally:
        staged.stop_publishing()
        shutil.rmtree(tmp, ignore_errors=True)


def publish_run(stage: Staged, summary: dict) -> dict:
    """A finished run in ``stage``: its ``config.json`` and ``summary.json`` name the URL (not the working copy),
    then everything is published, ``run.json`` (``complete``) last. Returns the summary, naming the URL."""
    import json

    from connectors.atomic import atomic_write

    for name, key in (("config.json", "out"), ("summary.json", "run_dir")):
        path = stage.local / name
        if path.is_file():
            data = json.loads(path.read_text())
            if isinstance(data, dict) and key in data:
                data[key] = stage.url
                atomic_write(path, json.dumps(data, indent=1, default=str) + "\n")
    stage.stop_publishing()
    stage.push()
    return {**summary, "run_dir": stage.url}


def fetch_dir(url: str, option: str, *, marker: str | None = None) -> Path:
    """Download the directory ``url`` (a dataset, a bundle, a run) into a temporary directory of this process;
    ``marker``: the file that must be there (``_manifest.json``...), else an error naming it."""
    fs, root = remote_fs(url, option)
    local = _scratch() / (posixpath.basename(root) or "dir")
    try:
        files = _files_under(fs, root)
        if marker is not None and marker not in files:
            raise StoreAccessError(f"{option} {url}: no {marker} there (nothing, or not a complete flowtrain "
                                   f"{'dataset' if marker == '_manifest.json' else 'directory'}); check the URL")
        for rel in files:
            (local / rel).parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(f"{root}/{rel}", str(local / rel))
    except FlowtrainError:
        raise
    except Exception as err:  # noqa: BLE001 - the store's own error, named for the user
        raise _fail(option, url, "reading", err) from None
    local.mkdir(parents=True, exist_ok=True)
    return local


def fetch_bundle(url: str, option: str = "--model") -> Path:
    """A bundle, or a run directory's ``bundle/``, on an object store: downloaded (only the bundle); its
    checksums are verified by the reader as for a local one."""
    fs, root = remote_fs(url, option)
    try:
        run_bundle = fs.exists(f"{root}/bundle/bundle.json")
    except Exception as err:  # noqa: BLE001 - the store's own error, named for the user
        raise _fail(option, url, "reading", err) from None
    return fetch_dir(f"{url.rstrip('/')}/bundle" if run_bundle else url, option, marker="bundle.json")


def fetch_inputs(patterns: Sequence[str], option: str = "--input") -> list[str]:
    """Input files and globs: local ones as given, those on an object store downloaded (each to a file of the
    same name under a temporary directory, its URL noted: ``connectors.paths.origin_of`` names it, so sources and
    manifests record the URL); a pattern that matches nothing is an error naming it."""
    out: list[str] = []
    scratch: Path | None = None
    for pattern in patterns:
        if not is_url(pattern):
            out.append(pattern)
            continue
        fs, path = remote_fs(pattern, option)
        scratch = scratch or _scratch()
        try:
            keys = sorted(fs.glob(path)) if any(c in path for c in "*?[") else ([path] if fs.isfile(path) else [])
            if not keys:
                raise StoreAccessError(f"{option} {pattern} matches no file; check the URL")
            # the URL of each file: the pattern itself, or the pattern's URL prefix + the key it matched
            tail = path.lstrip("/")
            prefix = pattern[:len(pattern) - len(tail)] if pattern.endswith(tail) else f"{url_scheme(pattern)}://"
            for i, key in enumerate(keys):
                target = scratch / f"{len(out)}-{i}" / posixpath.basename(key)
                target.parent.mkdir(parents=True)
                fs.get_file(key, str(target))
                note_origin(target, pattern if key == path else prefix + key.lstrip("/"))  # sources name the URL
                out.append(str(target))
        except FlowtrainError:
            raise
        except Exception as err:  # noqa: BLE001 - the store's own error, named for the user
            raise _fail(option, pattern, "reading", err) from None
    return out


@contextmanager
def staged_outputs(outputs: dict[str, str], *, overwrite: bool, last: str | None = None) -> Iterator[dict[str, str]]:
    """Output files (``{option: path}``) as local paths: those on an object store are written into a temporary
    directory and uploaded when the block ends without an error (``last`` after the others: the file that says
    the outputs are complete). An existing object is an error unless ``overwrite``."""
    local, remote = {}, {}
    scratch = None
    for option, path in outputs.items():
        if not is_url(path):
            local[option] = path
            continue
        fs, key = remote_fs(path, option)
        try:
            exists = fs.exists(key)
        except Exception as err:  # noqa: BLE001 - the store's own error, named for the user
            raise _fail(option, path, "reading", err) from None
        if exists and not overwrite:
            raise FlowtrainError(f"{option} {path} exists; give a new path, or --overwrite to replace it")
        scratch = scratch or Path(tempfile.mkdtemp(prefix="flowtrain-out-"))
        target = scratch / posixpath.basename(key)  # side by side, as <out>'s sidecars are
        if str(target) in local.values():
            target = scratch / str(len(local)) / posixpath.basename(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        local[option] = str(target)
        remote[option] = (fs, key, path)
    try:
        yield local
        for option in sorted(remote, key=lambda o: o == last):
            fs, key, url = remote[option]
            if Path(local[option]).is_file():
                try:
                    fs.put_file(local[option], key)
                except Exception as err:  # noqa: BLE001 - the store's own error, named for the user
                    raise _fail(option, url, "publishing", err) from None
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)

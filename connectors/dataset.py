"""Dataset directories: Parquet shards plus ``_manifest.json``, written last.

Layout of ``path`` (any Beam filesystem: a local path, ``gs://``, ``s3://``, ...)::

    _manifest.json            schema, splits with per-shard row counts, user metadata
    <split>/part-<id>.parquet one or more shards per split

Every read and write goes through Beam's ``FileSystems``, so a dataset written by workers on a
cluster is a path every worker and the trainer can reach. The commit is the manifest, written
after every shard is closed: no manifest, no dataset.

* On a local (or mounted) filesystem ``WriteDataset`` writes the shards into
  ``<path>.tmp-<id>/``, then the manifest there (fsynced), then renames the directory to
  ``path``: the whole dataset appears at once, and an overwrite swaps it whole.
* On a filesystem without directories or atomic renames (object stores) the shards go straight
  to ``path/<split>/`` under fresh names and the manifest is the last object written; a reader
  only opens the shards the manifest lists, so shards of an unfinished or retried write are
  never seen. Files the new manifest does not list (strays of retried bundles, an overwritten
  dataset's shards) are deleted after the commit.

Replacing a dataset (``overwrite=True``) deletes only what flowtrain can prove it wrote: the path
must be empty or hold a flowtrain manifest and nothing but the files it names (and shards named
the way flowtrain names them, ``<split>/part-<12 hex digits>.parquet``). Anything else there
(a user's notes, a CSV in a sub-directory) makes the write a ``DatasetError`` naming the path and
the files, before any shard is written; nothing is deleted.

A manifest's shard paths must be relative paths inside the dataset directory: an absolute path,
a URL or a ``..`` component is a ``DatasetError`` naming the manifest, never a file read from
elsewhere.
"""
from __future__ import annotations

import json
import logging
import os
import posixpath
import re
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import apache_beam as beam
import pyarrow as pa
import pyarrow.parquet as pq
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems
from apache_beam.transforms.window import GlobalWindow
from apache_beam.utils.windowed_value import WindowedValue

from connectors.atomic import fsync_dir
from connectors.files import ReadFromFiles
from connectors.paths import absolute_path, is_local_path

__all__ = ["MANIFEST", "DatasetError", "WriteDataset", "ReadDataset", "read_manifest", "shard_paths",
           "read_shard", "finalize_dataset", "dataset_exists", "is_local_path", "owned_files", "remove_dataset"]

MANIFEST = "_manifest.json"
FORMAT = "flowtrain.dataset/1"
_RAW = CompressionTypes.UNCOMPRESSED  # Parquet compresses itself; never let a suffix decide
#: How ``WriteDataset`` names a shard, relative to the dataset directory.
_SHARD_NAME = re.compile(r"^[A-Za-z0-9_.=-]+/part-[0-9a-f]{12}\.parquet$")
_log = logging.getLogger(__name__)


class DatasetError(ValueError):
    """A path is not a complete dataset, or a split is missing; the message says which."""


def dataset_exists(path: str | os.PathLike) -> bool:
    return FileSystems.exists(FileSystems.join(absolute_path(path), MANIFEST))


def read_manifest(path: str | os.PathLike) -> dict:
    manifest = FileSystems.join(absolute_path(path), MANIFEST)
    if not FileSystems.exists(manifest):
        raise DatasetError(f"{path} is not a finished dataset: it has no {MANIFEST} (the write did "
                           f"not finish, or the path is wrong). Re-run the ETL that writes it.")
    with FileSystems.open(manifest, compression_type=_RAW) as fh:
        data = json.loads(fh.read())
    if data.get("format") != FORMAT:
        raise DatasetError(f"{manifest} has format {data.get('format')!r}, expected {FORMAT!r}")
    return data


def _contained(rel, manifest_path: str) -> str:
    """A shard path of a manifest, checked: relative, inside the dataset directory."""
    if not isinstance(rel, str) or not rel:
        raise DatasetError(f"{manifest_path} lists a shard without a file name ({rel!r}); re-run the ETL "
                           f"that wrote this dataset")
    parts = rel.replace("\\", "/").split("/")
    if (FileSystems.get_scheme(rel) is not None or rel.startswith(("/", "\\")) or posixpath.isabs(rel)
            or re.match(r"^[A-Za-z]:", rel) or ".." in parts or "" in parts or "\0" in rel):
        raise DatasetError(f"{manifest_path} lists shard {rel!r}, which is not a relative path inside the "
                           f"dataset directory (absolute paths, URLs and '..' are refused); the manifest is "
                           f"damaged or not flowtrain's: re-run the ETL that wrote it")
    return rel


def shard_paths(path: str | os.PathLike, split: str) -> list[str]:
    """The files of ``split``, each checked to lie inside the dataset directory."""
    manifest = read_manifest(path)
    if split not in manifest["splits"]:
        raise DatasetError(f"dataset {path} has no split {split!r}; it has "
                           f"{', '.join(sorted(manifest['splits'])) or 'none'}")
    base = absolute_path(path)
    where = FileSystems.join(base, MANIFEST)
    files = [FileSystems.join(base, *_contained(shard.get("file") if isinstance(shard, dict) else None,
                                                where).split("/"))
             for shard in manifest["splits"][split]]
    if is_local_path(base):
        for file in files:
            _inside(file, base)
    return files


def _inside(file: str, base: str) -> None:
    """A local shard whose path (a symlinked split directory, a symlinked shard) leads outside the dataset
    directory ``base`` (itself resolved) is a ``DatasetError`` naming it and where it leads."""
    real = os.path.realpath(file)
    if real != base and not real.startswith(base.rstrip(os.sep) + os.sep):
        link = next((str(p) for p in [Path(file), *Path(file).parents] if p.is_symlink()), file)
        raise DatasetError(f"dataset {base}: shard {file} leads outside the dataset directory ({link} is a "
                           f"symlink to {os.path.realpath(link)}); a dataset's shards must lie inside it. Copy "
                           f"the files in, or re-run the ETL that writes the dataset")


def read_shard(path: str, *, columns=None) -> pa.Table:
    """One shard as a table: memory-mapped from a local path, through FileSystems otherwise."""
    if is_local_path(path):
        return pq.read_table(path, columns=columns)
    with FileSystems.open(path, compression_type=_RAW) as fh:
        return pq.read_table(pa.BufferReader(fh.read()), columns=columns)


def _build_manifest(shards: list[dict], metadata: Mapping[str, Any]) -> dict:
    splits: dict[str, list[dict]] = {}
    schema = None
    for shard in sorted(shards, key=lambda s: s["file"]):
        splits.setdefault(shard["split"], []).append({"file": shard["file"], "rows": shard["rows"]})
        schema = schema or shard["schema"]
    return {
        **dict(metadata),  # user keys first: the built-in keys below always win
        "format": FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "schema": schema,
        "splits": splits,
        "rows": {name: sum(s["rows"] for s in parts) for name, parts in splits.items()},
    }


def _shard_files(base: str) -> list[str]:
    """Every ``<split>/*.parquet`` under ``base``, as paths relative to it."""
    found = FileSystems.match([FileSystems.join(base, "*", "*.parquet")])[0].metadata_list
    prefix = base.rstrip("/") + "/"
    return [m.path[len(prefix):] if m.path.startswith(prefix) else os.path.relpath(m.path, base) for m in found]


def _listing(base: str) -> list[str]:
    """Every file under ``base`` (any filesystem), relative to it, with ``/`` separators."""
    if is_local_path(base):
        root = Path(base)
        if not root.is_dir():
            return []
        return sorted(str(p.relative_to(root)).replace(os.sep, "/") for p in root.rglob("*")
                      if p.is_file() or p.is_symlink())
    prefix = base.rstrip("/") + "/"
    found = FileSystems.match([prefix + "**"])[0].metadata_list
    return sorted(m.path[len(prefix):] for m in found if m.path.startswith(prefix))


def owned_files(path: str | os.PathLike) -> list[str]:
    """The files of the dataset at ``path`` that flowtrain wrote (relative paths, the manifest last),
    or ``[]`` when nothing is there; a ``DatasetError`` naming the path when anything else is there.

    Provably flowtrain's: ``_manifest.json`` in flowtrain's format, and besides it only the shards
    it lists or files named the way ``WriteDataset`` names shards (strays of a retried write).
    """
    base = absolute_path(path)
    if is_local_path(base) and Path(base).exists() and not Path(base).is_dir():
        raise DatasetError(f"{base} is a file, not a dataset directory; flowtrain will not replace it: "
                           f"remove it yourself or choose another path")
    files = _listing(base)
    if not files:
        return []
    if MANIFEST not in files:
        foreign = [f for f in files if not _SHARD_NAME.match(f)]
        if not foreign:  # shards of a write that never committed
            return files
        raise DatasetError(f"{base} is not empty and holds no {MANIFEST} ({_some(foreign)}): it is not a "
                           f"dataset flowtrain wrote, so flowtrain will not delete or replace it; move those "
                           f"files or choose another path")
    try:
        manifest = read_manifest(base)
    except (DatasetError, ValueError, OSError) as err:
        raise DatasetError(f"{base}: {MANIFEST} is not a flowtrain manifest ({err}); flowtrain will not "
                           f"delete or replace this directory: choose another path") from None
    where = FileSystems.join(base, MANIFEST)
    listed = {_contained(shard.get("file") if isinstance(shard, dict) else None, where)
              for shards in (manifest.get("splits") or {}).values() for shard in shards}
    foreign = [f for f in files if f != MANIFEST and f not in listed and not _SHARD_NAME.match(f)]
    if foreign:
        raise DatasetError(f"{base} holds files its {MANIFEST} does not name ({_some(foreign)}): flowtrain "
                           f"replaces a dataset only when it holds nothing but what flowtrain wrote; move those "
                           f"files or choose another path")
    return [f for f in files if f != MANIFEST] + [MANIFEST]


def _some(files: list[str], n: int = 5) -> str:
    return ", ".join(files[:n]) + (f" and {len(files) - n} more" if len(files) > n else "")


def remove_dataset(path: str | os.PathLike) -> list[str]:
    """Delete the dataset at ``path`` if flowtrain provably wrote it (``owned_files``), else a
    ``DatasetError`` and nothing is deleted. The manifest goes first (no reader sees a dataset with
    missing shards), then the shards, then the directories if empty. Returns what was deleted."""
    base = absolute_path(path)
    files = owned_files(base)
    if not files:
        if is_local_path(base) and Path(base).is_dir():
            Path(base).rmdir()
        return []
    ordered = ([MANIFEST] if MANIFEST in files else []) + [f for f in files if f != MANIFEST]
    if is_local_path(base):
        root = Path(base)
        for rel in ordered:
            (root / rel).unlink(missing_ok=True)
        for d in sorted({(root / rel).parent for rel in ordered}, key=lambda q: len(q.parts), reverse=True):
            try:
                d.rmdir()
            except OSError as err:  # something appeared meanwhile: it is not ours, it stays
                _log.warning("left %s in place: %s", d, err)
    else:
        for rel in ordered:  # the manifest first, one by one: a stop half way leaves no dataset
            FileSystems.delete([FileSystems.join(base, *rel.split("/"))])
    return ordered


def _commit_local(tmp: Path, final: Path, body: str, listed: set[str], *, overwrite: bool) -> None:
    """Manifest into the staging directory (fsynced), then one directory rename to ``final``.

    An existing ``final`` is replaced only if it is empty or provably a flowtrain dataset
    (``owned_files``); it is renamed aside and then only the files it owned are deleted."""
    tmp.mkdir(parents=True, exist_ok=True)
    for stray in tmp.rglob("*.parquet"):  # shards of bundle attempts the runner retried
        if str(stray.relative_to(tmp)) not in listed:
            stray.unlink()
    with open(tmp / MANIFEST, "w") as fh:
        fh.write(body)
        fh.flush()
        os.fsync(fh.fileno())
    fsync_dir(tmp)
    old, old_files = None, []
    if final.exists() or final.is_symlink():
        if not overwrite:
            raise DatasetError(f"{final} exists; pass overwrite=True (or --overwrite) or choose another path")
        if final.is_symlink():
            raise DatasetError(f"{final} is a symbolic link; flowtrain will not replace it: choose another path")
        old_files = owned_files(final)  # a DatasetError naming foreign files: nothing is touched
        old = final.with_name(f"{final.name}.old-{uuid.uuid4().hex[:8]}")
        final.rename(old)
    tmp.rename(final)
    fsync_dir(final.parent)
    if old is not None:
        for rel in old_files:  # the manifest is last in the list: first removed is fine either way
            (old / rel).unlink(missing_ok=True)
        for d in sorted({(old / rel).parent for rel in old_files} | {old}, key=lambda q: len(q.parts), reverse=True):
            try:
                d.rmdir()
            except OSError as err:  # a file appeared in the old dataset meanwhile: not ours to delete
                _log.warning("left %s in place: %s", d, err)


def _commit_in_place(staging: str, final: str, body: str, listed: set[str], *, overwrite: bool) -> None:
    """No rename: shards are already under ``final``; the manifest, written last, commits them."""
    manifest = FileSystems.join(final, MANIFEST)
    if FileSystems.exists(manifest) and not overwrite:
        raise DatasetError(f"{final} exists; pass overwrite=True (or --overwrite) or choose another path")
    if staging != final:  # shards staged elsewhere by a caller: move them in first (copy + delete)
        rels = sorted(listed)
        FileSystems.rename([FileSystems.join(staging, r) for r in rels], [FileSystems.join(final, r) for r in rels])
    with FileSystems.create(manifest, mime_type="application/json", compression_type=_RAW) as fh:
        fh.write(body.encode())
    # after the commit: an overwritten dataset's shards, strays of retried bundles (only files named
    # the way WriteDataset names shards: nothing flowtrain did not write)
    unlisted = [FileSystems.join(final, rel) for rel in _shard_files(final)
                if rel not in listed and _SHARD_NAME.match(rel)]
    if unlisted:
        FileSystems.delete(unlisted)


def finalize_dataset(tmp_dir: str, final_dir: str, shards: list[dict], metadata: Mapping[str, Any],
                     *, overwrite: bool) -> dict:
    """Commit the ``shards`` written under ``tmp_dir`` as the dataset ``final_dir``; returns the manifest.

    Local paths: manifest into ``tmp_dir``, then a rename to ``final_dir``. Other filesystems:
    the shards are under ``final_dir`` (``tmp_dir`` is the same path) and the manifest, written
    last, is the commit.
    """
    manifest = _build_manifest(shards, metadata)
    body = json.dumps(manifest, indent=2, default=str)
    listed = {s["file"] for s in shards}
    if is_local_path(final_dir):
        _commit_local(Path(tmp_dir), Path(final_dir), body, listed, overwrite=overwrite)
    else:
        _commit_in_place(absolute_path(tmp_dir), absolute_path(final_dir), body, listed, overwrite=overwrite)
    return manifest


def _schema_json(schema: pa.Schema) -> list[dict]:
    return [{"name": f.name, "type": str(f.type), "nullable": f.nullable} for f in schema]


class _ShardWriter:
    """One open Parquet shard on any Beam filesystem."""

    def __init__(self, path: str, schema: pa.Schema, compression: str):
        self.sink = FileSystems.create(path, mime_type="application/vnd.apache.parquet", compression_type=_RAW)
        self.writer = pq.ParquetWriter(self.sink, schema, compression=compression)
        self.schema, self.rows = schema, 0

    def close(self) -> None:
        self.writer.close()
        self.sink.close()  # on an object store the shard appears only now


class _WriteShardsFn(beam.DoFn):
    """One Parquet shard per split per bundle; emits the shard's description at bundle end."""

    def __init__(self, staging_dir: str, compression: str, row_group_rows: int):
        self._dir, self._compression, self._row_group_rows = staging_dir, compression, row_group_rows

    def start_bundle(self):
        self._writers: dict[str, tuple[_ShardWriter, str]] = {}

    def process(self, element):
        split, batch = element if isinstance(element, tuple) else ("data", element)
        if batch.num_rows == 0:
            return
        if split not in self._writers:
            rel = f"{split}/part-{uuid.uuid4().hex[:12]}.parquet"
            self._writers[split] = (_ShardWriter(FileSystems.join(self._dir, *rel.split("/")),
                                                 batch.schema, self._compression), rel)
        shard, _ = self._writers[split]
        if not batch.schema.equals(shard.schema, check_metadata=False):
            raise DatasetError(f"WriteDataset: split {split!r} got batches with different schemas:\n"
                               f"{shard.schema}\nvs\n{batch.schema}")
        shard.writer.write_batch(batch, row_group_size=self._row_group_rows)
        shard.rows += batch.num_rows

    def finish_bundle(self) -> Iterator[WindowedValue]:
        for split, (shard, rel) in self._writers.items():
            shard.close()
            desc = {"split": split, "file": rel, "rows": shard.rows, "schema": _schema_json(shard.schema)}
            yield WindowedValue(desc, GlobalWindow().max_timestamp(), [GlobalWindow()])
        self._writers = {}


class _FinalizeFn(beam.DoFn):
    def __init__(self, staging_dir: str, final_dir: str, overwrite: bool):
        self._staging, self._final, self._overwrite = staging_dir, final_dir, overwrite

    def process(self, shards: list[dict], metadata) -> Iterator[dict]:
        yield finalize_dataset(self._staging, self._final, shards, metadata or {}, overwrite=self._overwrite)


class WriteDataset(beam.PTransform):
    """Writes ``RecordBatch``es (or ``(split, RecordBatch)`` pairs) as a dataset directory.

    Args:
      path: the dataset directory, on any Beam filesystem (a local path is made absolute).
      metadata: JSON-able dict stored in the manifest, or a PCollection of one such dict (for
        statistics computed by the same pipeline, e.g. ``beam.pvalue.AsSingleton``-style).
      overwrite: replace an existing dataset at ``path`` (by rename where the filesystem has
        one; elsewhere by the new manifest, after which the old shards are deleted). Only a path
        that is empty or holds nothing but a dataset flowtrain wrote is replaced (``owned_files``);
        anything else is a ``DatasetError`` naming the path, raised before any shard is written.
    Returns a PCollection with the one manifest written.
    """

    def __init__(self, path: str | os.PathLike, *, metadata: Mapping[str, Any] | beam.PCollection | None = None,
                 overwrite: bool = False, compression: str = "zstd", row_group_rows: int = 131_072):
        super().__init__()
        self._path = absolute_path(path)
        self._staging = f"{self._path}.tmp-{uuid.uuid4().hex[:12]}" if is_local_path(self._path) else self._path
        self._metadata = metadata
        self._overwrite = overwrite
        self._compression, self._row_group_rows = compression, row_group_rows

    def expand(self, batches):
        if not self._overwrite and dataset_exists(self._path):  # before any shard is written
            raise DatasetError(f"{self._path} exists; pass overwrite=True (or --overwrite) or choose another path")
        if self._overwrite:
            owned_files(self._path)  # anything there flowtrain did not write: an error now, nothing deleted
        shards = (batches
                  | "WriteShards" >> beam.ParDo(_WriteShardsFn(self._staging, self._compression,
                                                               self._row_group_rows))
                  | "AllShards" >> beam.combiners.ToList())
        if isinstance(self._metadata, beam.PCollection):
            meta = beam.pvalue.AsSingleton(self._metadata)
        else:
            meta = beam.pvalue.AsSingleton(
                batches.pipeline | "Metadata" >> beam.Create([dict(self._metadata or {})]))
        return shards | "CommitManifest" >> beam.ParDo(
            _FinalizeFn(self._staging, self._path, self._overwrite), meta)


class ReadDataset(beam.PTransform):
    """Reads one split of a finished dataset directory (any Beam filesystem) as ``RecordBatch``es."""

    def __init__(self, path: str | os.PathLike, *, split: str = "data", columns=None,
                 batch_rows: int = 65_536):
        super().__init__()
        self._files = shard_paths(path, split)  # fails now, at construction, if unfinished
        self._columns, self._batch_rows = columns, batch_rows

    def expand(self, pbegin):
        if not self._files:
            return pbegin | "Empty" >> beam.Create([])
        return pbegin | "Read" >> ReadFromFiles(self._files, file_format="parquet", columns=self._columns,
                                                batch_rows=self._batch_rows)

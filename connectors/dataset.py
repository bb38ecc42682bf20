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
"""
from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Iterator, Mapping

import apache_beam as beam
import pyarrow as pa
import pyarrow.parquet as pq
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems
from apache_beam.transforms.window import GlobalWindow
from apache_beam.utils.windowed_value import WindowedValue

from connectors.files import ReadFromFiles
from connectors.paths import absolute_path, is_local_path

__all__ = ["MANIFEST", "DatasetError", "WriteDataset", "ReadDataset", "read_manifest", "shard_paths",
           "read_shard", "finalize_dataset", "fsync_dir", "dataset_exists", "is_local_path"]

MANIFEST = "_manifest.json"
FORMAT = "flowtrain.dataset/1"
_RAW = CompressionTypes.UNCOMPRESSED  # Parquet compresses itself; never let a suffix decide


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


def shard_paths(path: str | os.PathLike, split: str) -> list[str]:
    manifest = read_manifest(path)
    if split not in manifest["splits"]:
        raise DatasetError(f"dataset {path} has no split {split!r}; it has "
                           f"{', '.join(sorted(manifest['splits'])) or 'none'}")
    base = absolute_path(path)
    return [FileSystems.join(base, shard["file"]) for shard in manifest["splits"][split]]


def read_shard(path: str, *, columns=None) -> pa.Table:
    """One shard as a table: memory-mapped from a local path, through FileSystems otherwise."""
    if is_local_path(path):
        return pq.read_table(path, columns=columns)
    with FileSystems.open(path, compression_type=_RAW) as fh:
        return pq.read_table(pa.BufferReader(fh.read()), columns=columns)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable (fsync of the directory itself)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def _commit_local(tmp: Path, final: Path, body: str, listed: set[str], *, overwrite: bool) -> None:
    """Manifest into the staging directory (fsynced), then one directory rename to ``final``."""
    tmp.mkdir(parents=True, exist_ok=True)
    for stray in tmp.rglob("*.parquet"):  # shards of bundle attempts the runner retried
        if str(stray.relative_to(tmp)) not in listed:
            stray.unlink()
    with open(tmp / MANIFEST, "w") as fh:
        fh.write(body)
        fh.flush()
        os.fsync(fh.fileno())
    fsync_dir(tmp)
    old = None
    if final.exists():
        if not overwrite:
            raise DatasetError(f"{final} exists; pass overwrite=True (or --overwrite) or choose another path")
        old = final.with_name(f"{final.name}.old-{uuid.uuid4().hex[:8]}")
        final.rename(old)
    tmp.rename(final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


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
    unlisted = [FileSystems.join(final, rel) for rel in _shard_files(final) if rel not in listed]
    if unlisted:  # after the commit: an overwritten dataset's shards, strays of retried bundles
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
        one; elsewhere by the new manifest, after which the old shards are deleted).
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

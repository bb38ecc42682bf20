"""Dataset directories: Parquet shards plus ``_manifest.json``, written last.

Layout of ``path``::

    _manifest.json            schema, splits with per-shard row counts, user metadata
    <split>/part-<id>.parquet one or more shards per split

``WriteDataset`` writes every shard into ``<path>.tmp-<id>/``, then (after all shards are
done) writes the manifest there, fsyncs it and renames the directory to ``path``. A write
that fails or is killed leaves no ``_manifest.json`` at ``path``: no manifest, no dataset.
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
from apache_beam.transforms.window import GlobalWindow
from apache_beam.utils.windowed_value import WindowedValue

from connectors.files import ReadFromFiles

__all__ = ["MANIFEST", "DatasetError", "WriteDataset", "ReadDataset", "read_manifest", "shard_paths",
           "finalize_dataset", "fsync_dir"]

MANIFEST = "_manifest.json"
FORMAT = "flowtrain.dataset/1"


class DatasetError(ValueError):
    """A path is not a complete dataset, or a split is missing; the message says which."""


def read_manifest(path: str | os.PathLike) -> dict:
    manifest = Path(path) / MANIFEST
    if not manifest.exists():
        raise DatasetError(f"{path} is not a finished dataset: it has no {MANIFEST} (the write did "
                           f"not finish, or the path is wrong). Re-run the ETL that writes it.")
    with open(manifest) as fh:
        data = json.load(fh)
    if data.get("format") != FORMAT:
        raise DatasetError(f"{manifest} has format {data.get('format')!r}, expected {FORMAT!r}")
    return data


def shard_paths(path: str | os.PathLike, split: str) -> list[str]:
    manifest = read_manifest(path)
    if split not in manifest["splits"]:
        raise DatasetError(f"dataset {path} has no split {split!r}; it has "
                           f"{', '.join(sorted(manifest['splits'])) or 'none'}")
    return [str(Path(path) / shard["file"]) for shard in manifest["splits"][split]]


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable (fsync of the directory itself)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def finalize_dataset(tmp_dir: str, final_dir: str, shards: list[dict], metadata: Mapping[str, Any],
                     *, overwrite: bool) -> dict:
    """Write the manifest into ``tmp_dir`` and rename it to ``final_dir``; returns the manifest."""
    tmp, final = Path(tmp_dir), Path(final_dir)
    tmp.mkdir(parents=True, exist_ok=True)
    listed = {s["file"] for s in shards}
    for stray in tmp.rglob("*.parquet"):  # shards of bundle attempts the runner retried
        if str(stray.relative_to(tmp)) not in listed:
            stray.unlink()
    splits: dict[str, list[dict]] = {}
    schema = None
    for shard in sorted(shards, key=lambda s: s["file"]):
        splits.setdefault(shard["split"], []).append({"file": shard["file"], "rows": shard["rows"]})
        schema = schema or shard["schema"]
    manifest = {
        **dict(metadata),  # user keys first: the built-in keys below always win
        "format": FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "schema": schema,
        "splits": splits,
        "rows": {name: sum(s["rows"] for s in parts) for name, parts in splits.items()},
    }
    body = json.dumps(manifest, indent=2, default=str)
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
    return manifest


def _schema_json(schema: pa.Schema) -> list[dict]:
    return [{"name": f.name, "type": str(f.type), "nullable": f.nullable} for f in schema]


class _WriteShardsFn(beam.DoFn):
    """One Parquet shard per split per bundle; emits the shard's description at bundle end."""

    def __init__(self, tmp_dir: str, compression: str, row_group_rows: int):
        self._tmp, self._compression, self._row_group_rows = tmp_dir, compression, row_group_rows

    def start_bundle(self):
        self._writers: dict[str, tuple[pq.ParquetWriter, str, list]] = {}

    def process(self, element):
        split, batch = element if isinstance(element, tuple) else ("data", element)
        if batch.num_rows == 0:
            return
        if split not in self._writers:
            rel = f"{split}/part-{uuid.uuid4().hex[:12]}.parquet"
            full = Path(self._tmp) / rel
            full.parent.mkdir(parents=True, exist_ok=True)
            writer = pq.ParquetWriter(str(full), batch.schema, compression=self._compression)
            self._writers[split] = (writer, rel, [0, batch.schema])
        writer, _, count = self._writers[split]
        if not batch.schema.equals(count[1], check_metadata=False):
            raise DatasetError(f"WriteDataset: split {split!r} got batches with different schemas:\n"
                               f"{count[1]}\nvs\n{batch.schema}")
        writer.write_batch(batch, row_group_size=self._row_group_rows)
        count[0] += batch.num_rows

    def finish_bundle(self) -> Iterator[WindowedValue]:
        for split, (writer, rel, (rows, schema)) in self._writers.items():
            writer.close()
            shard = {"split": split, "file": rel, "rows": rows, "schema": _schema_json(schema)}
            yield WindowedValue(shard, GlobalWindow().max_timestamp(), [GlobalWindow()])
        self._writers = {}


class _FinalizeFn(beam.DoFn):
    def __init__(self, tmp_dir: str, final_dir: str, overwrite: bool):
        self._tmp, self._final, self._overwrite = tmp_dir, final_dir, overwrite

    def process(self, shards: list[dict], metadata) -> Iterator[dict]:
        yield finalize_dataset(self._tmp, self._final, shards, metadata or {}, overwrite=self._overwrite)


class WriteDataset(beam.PTransform):
    """Writes ``RecordBatch``es (or ``(split, RecordBatch)`` pairs) as a dataset directory.

    Args:
      path: the dataset directory (a local or mounted filesystem path: the commit is a rename).
      metadata: JSON-able dict stored in the manifest, or a PCollection of one such dict (for
        statistics computed by the same pipeline, e.g. ``beam.pvalue.AsSingleton``-style).
      overwrite: replace an existing dataset at ``path`` (atomically, by rename).
    Returns a PCollection with the one manifest written.
    """

    def __init__(self, path: str | os.PathLike, *, metadata: Mapping[str, Any] | beam.PCollection | None = None,
                 overwrite: bool = False, compression: str = "zstd", row_group_rows: int = 131_072):
        super().__init__()
        self._path = str(Path(path).resolve())
        self._tmp = f"{self._path}.tmp-{uuid.uuid4().hex[:12]}"
        self._metadata = metadata
        self._overwrite = overwrite
        self._compression, self._row_group_rows = compression, row_group_rows

    def expand(self, batches):
        shards = (batches
                  | "WriteShards" >> beam.ParDo(_WriteShardsFn(self._tmp, self._compression,
                                                               self._row_group_rows))
                  | "AllShards" >> beam.combiners.ToList())
        if isinstance(self._metadata, beam.PCollection):
            meta = beam.pvalue.AsSingleton(self._metadata)
        else:
            meta = beam.pvalue.AsSingleton(
                batches.pipeline | "Metadata" >> beam.Create([dict(self._metadata or {})]))
        return shards | "CommitManifest" >> beam.ParDo(
            _FinalizeFn(self._tmp, self._path, self._overwrite), meta)


class ReadDataset(beam.PTransform):
    """Reads one split of a finished dataset directory as ``RecordBatch``es."""

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

"""Datasets on a non-local Beam filesystem (#11 defect 6): written, committed and read through
``FileSystems``, with "manifest written last" as the commit where there is no rename.

``memfs://`` is a small object-store-like Beam ``FileSystem`` registered by this module: objects
appear when their writer closes, there are no directories, and ``rename`` is refused, so a
commit that relied on a rename (or a path resolved with ``pathlib``) fails here.
"""
from __future__ import annotations

import io
import threading
from collections import Counter
from pathlib import Path

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pytest
from apache_beam.io.filesystem import BeamIOError, FileMetadata, FileSystem
from apache_beam.testing.util import assert_that, equal_to

from connectors.dataset import MANIFEST, DatasetError, ReadDataset, WriteDataset, read_manifest, shard_paths
from flowtrain.local.runners import pipeline_options

pytestmark = pytest.mark.timeout(180)


class _Store:
    objects: dict[str, bytes] = {}
    commits: list[str] = []  # paths in the order their writers closed
    fail_on: str | None = None  # a path whose write the store refuses
    lock = threading.Lock()


class _Writer(io.BytesIO):
    def __init__(self, path: str):
        super().__init__()
        self._path = path

    def close(self):
        if not self.closed and self._path == _Store.fail_on:
            super().close()
            raise BeamIOError(f"store refused {self._path}")
        if not self.closed:
            with _Store.lock:
                _Store.objects[self._path] = self.getvalue()
                _Store.commits.append(self._path)
        super().close()


class MemFileSystem(FileSystem):
    """An in-memory object store under ``memfs://`` (in this process: the FnApiRunner's workers)."""

    @classmethod
    def scheme(cls):
        return "memfs"

    def join(self, basepath, *paths):
        return "/".join([basepath.rstrip("/"), *[p.strip("/") for p in paths]])

    def split(self, path):
        head, _, tail = path.rpartition("/")
        return head, tail

    def mkdirs(self, path):
        pass

    def has_dirs(self):
        return False

    def _list(self, dir_or_prefix):
        with _Store.lock:
            items = list(_Store.objects.items())
        for path, data in items:
            if path.startswith(dir_or_prefix):
                yield FileMetadata(path, len(data), 0.0)

    def create(self, path, mime_type="application/octet-stream", compression_type=None):
        return _Writer(path)

    def open(self, path, mime_type="application/octet-stream", compression_type=None):
        with _Store.lock:
            if path not in _Store.objects:
                raise BeamIOError(f"no object {path}")
            return io.BytesIO(_Store.objects[path])

    def copy(self, source_file_names, destination_file_names):
        with _Store.lock:
            for s, d in zip(source_file_names, destination_file_names):
                _Store.objects[d] = _Store.objects[s]

    def rename(self, source_file_names, destination_file_names):
        raise NotImplementedError("memfs is an object store: no rename (a commit must not need one)")

    def exists(self, path):
        with _Store.lock:
            return path in _Store.objects

    def size(self, path):
        return len(_Store.objects[path])

    def last_updated(self, path):
        return 0.0

    def checksum(self, path):
        return str(len(_Store.objects[path]))

    def metadata(self, path):
        return FileMetadata(path, self.size(path), 0.0)

    def delete(self, paths):
        with _Store.lock:
            for p in paths:
                for key in [k for k in _Store.objects if k == p or k.startswith(p.rstrip("/") + "/")]:
                    del _Store.objects[key]


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a path mistaken for a local one would land here, not in the repo
    _Store.objects.clear()
    _Store.commits.clear()
    yield


def _batch(lo: int, hi: int) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict({"x": [float(i) for i in range(lo, hi)],
                                       "c": [f"c{i % 3}" for i in range(lo, hi)]})


def _rows(batch) -> list[tuple]:
    return list(zip(batch.column("x").to_pylist(), batch.column("c").to_pylist()))


def _write(path: str, pairs, **kwargs) -> None:
    with beam.Pipeline(options=pipeline_options("batch")) as p:
        _ = p | beam.Create(pairs) | WriteDataset(path, **kwargs)


def test_dataset_on_an_object_store_commits_by_writing_the_manifest_last(tmp_path):
    url = "memfs://bucket/runs/ds"
    _write(url, [("train", _batch(0, 50)), ("train", _batch(50, 80)), ("test", _batch(80, 100))],
           metadata={"label": "x"})
    manifest = read_manifest(url)
    assert manifest["rows"] == {"train": 80, "test": 20} and manifest["label"] == "x"
    shards = shard_paths(url, "train") + shard_paths(url, "test")
    assert all(s.startswith(url + "/") for s in shards) and all(s in _Store.objects for s in shards)
    # the commit: every listed shard was closed before the manifest, which came last
    assert _Store.commits[-1] == f"{url}/{MANIFEST}"
    assert set(shards) <= set(_Store.commits[:-1])
    assert not list(Path(tmp_path).rglob("*")), "a memfs:// path was written to the local disk"
    with beam.Pipeline(options=pipeline_options("batch")) as p:
        rows = p | ReadDataset(url, split="train") | beam.FlatMap(_rows)
        assert_that(rows, equal_to(_rows(_batch(0, 80))))


def test_overwrite_on_an_object_store_swaps_datasets_and_an_existing_one_is_refused_before_writing():
    url = "memfs://bucket/ds"
    _write(url, [("train", _batch(0, 10))])
    old_shards = shard_paths(url, "train")
    with pytest.raises(DatasetError, match="exists"):
        _write(url, [("train", _batch(100, 110))])
    assert shard_paths(url, "train") == old_shards  # refused before any shard was written
    assert sorted(k for k in _Store.objects if k.endswith(".parquet")) == sorted(old_shards)
    _write(url, [("train", _batch(100, 130))], overwrite=True)
    assert read_manifest(url)["rows"] == {"train": 30}
    assert not set(old_shards) & set(_Store.objects)  # the old shards are gone after the commit
    assert sorted(k for k in _Store.objects if k.endswith(".parquet")) == sorted(shard_paths(url, "train"))


def test_a_write_that_fails_at_its_commit_on_an_object_store_leaves_no_dataset():
    url = "memfs://bucket/broken"
    _Store.fail_on = f"{url}/{MANIFEST}"  # the store refuses the manifest object: the commit fails
    try:
        with pytest.raises(Exception, match="store refused"):
            _write(url, [("train", _batch(0, 10)), ("test", _batch(10, 20))])
    finally:
        _Store.fail_on = None
    written = [k for k in _Store.objects if k.startswith(url + "/") and k.endswith(".parquet")]
    assert written, "the shards were not written to the object store"
    assert f"{url}/{MANIFEST}" not in _Store.objects
    with pytest.raises(DatasetError, match="not a finished dataset"):
        read_manifest(url)


def test_tabular_etl_to_an_object_store_trains_from_the_same_rows_as_a_local_dataset(tmp_path):
    from connectors.dataset_spec import FeatureSpec
    from flowtrain.train.loader import TabularDataset
    from pipelines.tabular.pipeline import run_tabular_etl

    rng = np.random.default_rng(3)
    n = 600
    x = rng.normal(size=n)
    x[::37] = np.nan  # missing required values: dead letters
    table = pa.table({"x": x, "z": rng.uniform(0, 5, n), "c": rng.choice(["a", "b", "c"], n),
                      "y": rng.normal(size=n)})
    pacsv.write_csv(table, tmp_path / "data.csv")
    spec = FeatureSpec(label="y", task="regression", numeric=["x", "z"], categorical=["c"])
    inputs = [str(tmp_path / "data.csv")]
    local = run_tabular_etl(inputs, spec, dataset_path=str(tmp_path / "ds"), dead_letters_path=None,
                            options=pipeline_options("batch"))
    remote = run_tabular_etl(inputs, spec, dataset_path="memfs://bucket/tab", dead_letters_path=None,
                             options=pipeline_options("batch"))
    assert remote["counts"] == local["counts"] and remote["counts"]["dead_letters"] > 0
    assert remote["stats"] == local["stats"]
    a, b = TabularDataset(tmp_path / "ds"), TabularDataset("memfs://bucket/tab")
    for split in ("train", "valid", "test"):
        sa, sb = a.split(split), b.split(split)

        def rows(s):
            return Counter(zip(map(tuple, s.x_num.numpy().round(9).tolist()),
                               map(tuple, s.x_cat.numpy().tolist()), s.y.numpy().round(9).tolist()))

        assert len(sa) == len(sb) > 0 and rows(sa) == rows(sb)

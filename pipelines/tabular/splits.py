"""Splitting rows into train, valid and test: by the time column and its cutoffs, or at random by a
hash of each row's source and the seed (a row always lands in the same split, whatever the bundling).

A row's source is its file's name *relative to the inputs' root* (the deepest folder holding every input file;
``source_names``) and its row number: the same files split the same way wherever the folder is (moved, copied,
read from an object store), so a run's test metrics do not move with the data."""
from __future__ import annotations

import os
import posixpath
import zlib
from collections.abc import Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from connectors.dataset_spec import FeatureSpec
from connectors.paths import is_url, origin_of
from connectors.rows import SOURCE_FILE, SOURCE_ROW
from pipelines.tabular.columns import source_strings
from pipelines.tabular.times import time_seconds


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer: a fast, well-spread hash of 64-bit integers."""
    x = x.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x


def assign_splits(batch: pa.RecordBatch, spec: FeatureSpec, cutoffs: tuple[float, float] | None = None,
                  row_ids: np.ndarray | None = None, names: Mapping[str, str] | None = None) -> np.ndarray:
    """Split code per row: 0 train, 1 valid, 2 test.

    By time: ``t < valid_from`` train, ``valid_from <= t < test_from`` valid, the rest test,
    so no row of the test period reaches training. At random: a hash of the row's source and
    the seed, so a row always lands in the same split whatever the bundling; ``names`` (``source_names``)
    names each file as the hash sees it (by default, as read).
    """
    if spec.time_column:
        assert cutoffs is not None, "time splits need cutoffs"
        t = time_seconds(batch.column(spec.time_column), spec.time_format)
        return np.where(t < cutoffs[0], 0, np.where(t < cutoffs[1], 1, 2)).astype(np.int8)
    if row_ids is None:
        row_ids = _row_ids(batch, names or {})
    u = _mix64(row_ids ^ np.uint64(spec.seed * 0x9E3779B97F4A7C15 % (1 << 64))).astype(np.float64) / 2.0**64
    f_train, f_valid, _ = spec.fractions
    return np.where(u < f_train, 0, np.where(u < f_train + f_valid, 1, 2)).astype(np.int8)


def hash_str(s: str) -> int:
    return zlib.crc32(s.encode()) * 0x100000001B3 % (1 << 64)


def _path_part(path: str) -> str:
    """A file's path without its URL scheme (``az://c/d/x.csv`` -> ``c/d/x.csv``), local ones absolute."""
    if is_url(path):
        return path.split("://", 1)[1]
    return os.path.abspath(path.removeprefix("file://")).replace(os.sep, "/")


def source_names(files: Sequence[str]) -> dict[str, str]:
    """``{file: its name relative to the inputs' root}`` for the files of one input (local copies of downloaded
    files keyed by their URL too, as their rows' sources name them). The root is the deepest folder that holds
    every file: one file is named by its base name, ``data/a.csv`` and ``data/more/b.csv`` as ``a.csv`` and
    ``more/b.csv``, wherever ``data`` is."""
    files = list(dict.fromkeys(str(f) for f in files))
    if not files:
        return {}
    parts = [_path_part(origin_of(f)) for f in files]
    root = posixpath.commonpath(parts) if len(set(parts)) > 1 else posixpath.dirname(parts[0])
    if root in parts:  # a file given twice under two spellings
        root = posixpath.dirname(root)
    names: dict[str, str] = {}
    for f, part in zip(files, parts):
        rel = posixpath.relpath(part, root) if root else part
        for key in (f, origin_of(f), os.path.realpath(f) if not is_url(f) else f):
            names[key] = rel
    return names


def _row_ids(batch: pa.RecordBatch, names: Mapping[str, str]) -> np.ndarray:
    """A stable 64-bit id per row from its source (the file's name in ``names``, else as read, and the row
    number; or the source string)."""
    if SOURCE_ROW in batch.schema.names and batch.num_rows:
        files = batch.column(SOURCE_FILE)
        file_ids = np.array([hash_str(names.get(f, f)) for f in pc.unique(files).to_pylist()], dtype=np.uint64)
        which = pc.index_in(files, value_set=pc.unique(files)).to_numpy(zero_copy_only=False)
        return batch.column(SOURCE_ROW).to_numpy().astype(np.uint64) ^ file_ids[which]
    return np.array([hash_str(s or "") for s in source_strings(batch).to_pylist()], dtype=np.uint64)

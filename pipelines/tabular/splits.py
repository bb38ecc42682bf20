"""Splitting rows into train, valid and test: by the time column and its cutoffs, or at random by a
hash of each row's source and the seed (a row always lands in the same split, whatever the bundling)."""
from __future__ import annotations

import zlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from connectors.dataset_spec import FeatureSpec
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
                  row_ids: np.ndarray | None = None) -> np.ndarray:
    """Split code per row: 0 train, 1 valid, 2 test.

    By time: ``t < valid_from`` train, ``valid_from <= t < test_from`` valid, the rest test,
    so no row of the test period reaches training. At random: a hash of the row's source and
    the seed, so a row always lands in the same split whatever the bundling.
    """
    if spec.time_column:
        assert cutoffs is not None, "time splits need cutoffs"
        t = time_seconds(batch.column(spec.time_column), spec.time_format)
        return np.where(t < cutoffs[0], 0, np.where(t < cutoffs[1], 1, 2)).astype(np.int8)
    if row_ids is None:
        row_ids = _row_ids(batch)
    u = _mix64(row_ids ^ np.uint64(spec.seed * 0x9E3779B97F4A7C15 % (1 << 64))).astype(np.float64) / 2.0**64
    f_train, f_valid, _ = spec.fractions
    return np.where(u < f_train, 0, np.where(u < f_train + f_valid, 1, 2)).astype(np.int8)


def hash_str(s: str) -> int:
    return zlib.crc32(s.encode()) * 0x100000001B3 % (1 << 64)


def _row_ids(batch: pa.RecordBatch) -> np.ndarray:
    """A stable 64-bit id per row from its source (file and row number, or source string)."""
    if SOURCE_ROW in batch.schema.names and batch.num_rows:
        files = batch.column(SOURCE_FILE)
        file_ids = np.array([hash_str(f) for f in pc.unique(files).to_pylist()], dtype=np.uint64)
        which = pc.index_in(files, value_set=pc.unique(files)).to_numpy(zero_copy_only=False)
        return batch.column(SOURCE_ROW).to_numpy().astype(np.uint64) ^ file_ids[which]
    return np.array([hash_str(s or "") for s in source_strings(batch).to_pylist()], dtype=np.uint64)

"""Events as the aggregation core reads them, from Arrow columns, the same way for the backfill and the stream:
keys as text (several columns joined), times as int64 microseconds, values as float64 (numbers) or text, and a
stable shard of each key."""
from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines.tabular.times import time_seconds

#: Between the columns of a key of several (``card+merchant``) in its text.
KEY_SEPARATOR = "\x1f"


def _plain(col: pa.Array) -> pa.Array:
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if pa.types.is_dictionary(col.type):
        col = col.cast(col.type.value_type)
    return col


def is_number(col: pa.Array) -> bool:
    t = _plain(col).type
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t) or pa.types.is_boolean(t)


def key_text(batch: pa.RecordBatch | pa.Table, key: Sequence[str]) -> pa.Array:
    """Each row's key as text (null where a key column is missing): one column's values, or several joined."""
    cols = [pc.cast(_plain(batch.column(k)), pa.string()) for k in key]
    if len(cols) == 1:
        return cols[0]
    return pc.binary_join_element_wise(*cols, KEY_SEPARATOR, null_handling="emit_null")


def encode_keys(keys: pa.Array) -> tuple[list, np.ndarray, np.ndarray]:
    """(the distinct keys, each row's code into them, whether the row has a key)."""
    enc = pc.dictionary_encode(_plain(keys))
    codes = enc.indices.to_numpy(zero_copy_only=False)
    has = np.asarray(pc.is_valid(enc.indices))
    return enc.dictionary.to_pylist(), np.where(has, codes, 0).astype(np.int64), has


def shard_of(key: str, shards: int) -> int:
    """A key's shard: stable across processes and runs (crc32 of its text)."""
    return zlib.crc32(key.encode("utf-8")) % shards


def shards(keys: list, codes: np.ndarray, n: int) -> np.ndarray:
    per_key = np.array([shard_of(k, n) for k in keys], dtype=np.int64)
    return per_key[codes] if len(keys) else np.zeros(len(codes), np.int64)


def time_micros(col: pa.Array, time_format: str | None = None) -> np.ndarray:
    """Event times as int64 microseconds since the epoch, and -1 << 62 where missing or not a time (see
    ``pipelines.tabular.times.time_seconds`` for what is read). Timestamps keep their microseconds exactly."""
    col = _plain(col)
    if pa.types.is_date(col.type):
        col = pc.cast(col, pa.timestamp("s"))
    if pa.types.is_timestamp(col.type):
        micros = pc.cast(pc.cast(col, pa.timestamp("us", tz=col.type.tz)), pa.int64())
        return micros.fill_null(MISSING_TIME).to_numpy(zero_copy_only=False).astype(np.int64)
    seconds = time_seconds(col, time_format)
    out = np.full(len(seconds), MISSING_TIME, dtype=np.int64)
    ok = np.isfinite(seconds) & (np.abs(seconds) < 9.2e12)
    out[ok] = np.round(seconds[ok] * 1e6).astype(np.int64)
    return out


#: A time that is missing or not a time.
MISSING_TIME = -(1 << 62)


def values_of(col: pa.Array) -> np.ndarray:
    """A column's values for the core: float64 with NaN for numbers (non-finite values are missing), an object
    array of ``str`` with None for anything else."""
    col = _plain(col)
    if is_number(col):
        if pa.types.is_boolean(col.type):
            col = pc.cast(col, pa.int8())
        out = pc.cast(col, pa.float64(), safe=False).to_numpy(zero_copy_only=False).astype(np.float64)
        out[~np.isfinite(out)] = np.nan
        return out
    if pa.types.is_null(col.type):
        return np.full(len(col), None, dtype=object)
    return np.asarray(pc.cast(col, pa.string()).to_pylist(), dtype=object)

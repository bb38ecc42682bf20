"""``--join TABLE:KEY[:VALID_FROM]``: a table's other columns joined to each event as of the event's time.

With ``VALID_FROM``, an event at ``t`` gets the row of its key with the greatest ``VALID_FROM <= t`` (a version
that starts at ``t`` applies to ``t``; no row at or before ``t``: nulls). Without it the table is a static lookup
and a key may appear once. The same ``AsOfTable`` joins the backfill's rows and the stream's events.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines.features.columns import MISSING_TIME, encode_keys, key_text, time_micros
from pipelines.features.declare import DeclarationError, Join


class AsOfTable:
    """One join's table, sorted by key and ``VALID_FROM``, and ``lookup(keys, times)``."""

    def __init__(self, join: Join, table: pa.Table, *, time_format: str | None = None):
        where = f"--join {join.text}: table {join.table}"
        missing = [c for c in (*join.key, *([join.valid_from] if join.valid_from else [])) if c not in table.column_names]
        if missing:
            raise DeclarationError(f"{where} has no column {', '.join(missing)} (it has {', '.join(table.column_names)})")
        self.join = join
        keys = key_text(table, join.key)
        has = np.asarray(pc.is_valid(keys))
        times = time_micros(table.column(join.valid_from), time_format) if join.valid_from else \
            np.zeros(table.num_rows, np.int64)
        if join.valid_from and (times[has] == MISSING_TIME).any():
            row = int(np.flatnonzero(has & (times == MISSING_TIME))[0])
            raise DeclarationError(f"{where}: row {row} has no {join.valid_from} (missing or not a time)")
        table, keys, times = table.filter(pa.array(has)), keys.filter(pa.array(has)), times[has]
        names, codes, _ = encode_keys(keys)
        order = np.lexsort((times, codes))
        self.codes, self.times = codes[order], times[order]
        self.index = {k: i for i, k in enumerate(names)}
        same = (np.diff(self.codes) == 0) & (np.diff(self.times) == 0)
        if same.any():
            key = names[int(self.codes[np.flatnonzero(same)[0]])]
            what = f"twice at the same {join.valid_from}" if join.valid_from else "twice (give VALID_FROM for versions)"
            raise DeclarationError(f"{where}: key {key!r} appears {what}")
        others = [c for c in table.column_names if c not in join.key and c != join.valid_from]
        self.columns = {join.column_name(c): table.column(c).take(pa.array(order)).combine_chunks() for c in others}

    def lookup(self, keys: pa.Array, times: np.ndarray) -> np.ndarray:
        """Each event's row (-1: none): its key's latest version at or before its time."""
        names, codes, has = encode_keys(keys)
        table_code = np.array([self.index.get(k, -1) for k in names], dtype=np.int64)
        q = np.where(has, table_code[codes] if len(names) else -1, -1)
        ok = (q >= 0) & (times != MISSING_TIME)
        out = np.full(len(times), -1, dtype=np.int64)
        if not ok.any() or not len(self.codes):
            return out
        uniq, inv = np.unique(np.concatenate([self.times, times[ok]]), return_inverse=True)
        stride = np.int64(len(uniq) + 1)
        comp = self.codes * stride + inv[:len(self.times)]
        found = np.searchsorted(comp, q[ok] * stride + inv[len(self.times):], "right") - 1
        same_key = found >= 0
        same_key[same_key] = self.codes[found[same_key]] == q[ok][same_key]
        out[np.flatnonzero(ok)[same_key]] = found[same_key]
        return out

    def take(self, rows: np.ndarray) -> dict[str, pa.Array]:
        """The joined columns for these rows (-1: null)."""
        idx = pa.array(rows, mask=rows < 0)
        return {name: col.take(idx) for name, col in self.columns.items()}


def join_columns(tables: Sequence[AsOfTable], batch: pa.RecordBatch | pa.Table, times: np.ndarray
                 ) -> dict[str, pa.Array]:
    """Every join's columns for the rows of ``batch`` (their event times ``times``)."""
    out: dict[str, pa.Array] = {}
    for t in tables:
        out.update(t.take(t.lookup(key_text(batch, t.join.key), times)))
    return out

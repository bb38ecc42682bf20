"""A scorer's ID tables, kept current by published versions (``connectors.id_deltas``).

``ServedIds.offer(record, payload)`` verifies the record (signature and digest) and applies the
version in order: a snapshot newer than what is served replaces everything; a delta is applied
only on top of exactly its ``base`` — the same version number *and* the same payload (the record's
signed ``base_sha256``: a trainer that resumed from an older checkpoint publishes those numbers again,
and its deltas never land on the other lineage's rows). A delta that does not follow the served
payload (a gap: a lost or late record; another lineage) is held, never applied out of order; the
held deltas are applied once their base is served, and a newer snapshot makes those it covers moot. So the scorer starts from the
newest snapshot plus the deltas after it. An ID the trainer evicted keeps being served from its
last row until the delta that removes it is applied. ``lookup`` gives each key its row, or the
fallback vector (the dense ``<table>.fallback``) for an unknown ID, counted per table.
``snapshot()`` is the served version whole (what the scorer stores and its model handler loads);
``status()`` its counts for the scorer's status (``held``: deltas that did not follow the served
version, never applied out of order).

A version is checked whole before any of it is applied (``check_version``: each table's rows 2-D, of a float
type, finite, as wide as the table it changes and as its fallback vector; keys and evicted IDs integers; dense
parameters finite and, in a delta, of the shapes they replace), then applied to copies of the tables it changes,
which replace the served ones only once it all applied: a version that cannot be applied is rejected with its
reason and leaves the served version as it was (an 8-wide delta on a 4-wide table evicted and added keys before
it raised, and left keys without rows).
"""
from __future__ import annotations

from collections import Counter

import numpy as np

from connectors.id_deltas import DeltaError, IdVersion, TableChange, decode, verify_record

MAX_HELD = 64  # deltas held while a gap waits for the next snapshot


class ServedTable:
    """key -> row with a free list (numpy), the scorer's copy of one ID table."""

    def __init__(self, dim: int):
        self.dim = dim
        self.rows = np.zeros((0, dim), dtype=np.float32)
        self.index: dict[int, int] = {}
        self.free: list[int] = []

    def __len__(self) -> int:
        return len(self.index)

    def copy(self) -> ServedTable:
        out = ServedTable(self.dim)
        out.rows, out.index, out.free = self.rows.copy(), dict(self.index), list(self.free)
        return out

    def upsert(self, keys: np.ndarray, rows: np.ndarray) -> None:
        need = sum(1 for k in keys.tolist() if k not in self.index) - len(self.free)
        if need > 0:
            old = len(self.rows)
            self.rows = np.concatenate([self.rows, np.zeros((max(need, old // 2), self.dim), np.float32)])
            self.free.extend(range(len(self.rows) - 1, old - 1, -1))
        for k, row in zip(keys.tolist(), rows):
            r = self.index.get(k)
            if r is None:
                r = self.index[k] = self.free.pop()
            self.rows[r] = row

    def evict(self, keys: np.ndarray) -> None:
        for k in keys.tolist():
            r = self.index.pop(k, None)
            if r is not None:
                self.free.append(r)


class ServedIds:
    def __init__(self, key: bytes | None = None, max_bytes: int = 1 << 31):
        self.key, self.max_bytes = key, max_bytes
        self.version: int | None = None
        self.sha256: str | None = None  # the payload digest of the served version (a delta's base must be it)
        self.dense: dict[str, np.ndarray] = {}
        self.tables: dict[str, ServedTable] = {}
        self.info: dict[str, str] = {}  # the served version's payload info (the model's architecture)
        self.held: dict[str, tuple[IdVersion, str]] = {}  # base's payload digest -> (delta waiting for it, its digest)
        self.counts: Counter = Counter()  # applied, held, stale, rejected
        self.unknown: Counter = Counter()  # lookups of IDs a table does not hold, per table

    def offer(self, record: dict, payload: bytes) -> str:
        """Verify and apply (or hold) one version; returns what happened: applied, held, stale or rejected: ..."""
        try:
            verify_record(record, payload, self.key)
            v = decode(payload, self.max_bytes)
            if v.version != record.get("version") or v.kind != record.get("kind") or v.base != record.get("base"):
                raise DeltaError(f"version {record.get('version')}: the payload is version {v.version} ({v.kind})")
            base_sha256 = record.get("base_sha256")
            if v.kind == "delta" and not isinstance(base_sha256, str):
                raise DeltaError(f"version {v.version}: a delta whose record does not name its base's payload digest "
                                 f"(base_sha256)")
        except DeltaError as err:
            self.counts["rejected"] += 1
            return f"rejected: {err}"
        if self.version is not None and v.version <= self.version:
            self.counts["stale"] += 1
            return "stale"
        problem = self.check_version(v)
        if problem is not None:
            self.counts["rejected"] += 1
            return f"rejected: version {v.version} ({v.kind}): {problem}"
        if v.kind == "snapshot":
            self._apply(v, record["sha256"])
            self.held = {b: (d, sha) for b, (d, sha) in self.held.items() if d.version > v.version}
        elif v.base == self.version and base_sha256 == self.sha256:
            self._apply(v, record["sha256"])
        else:
            if len(self.held) >= MAX_HELD:
                self.held.pop(min(self.held, key=lambda b: self.held[b][0].version))
            self.held[base_sha256] = (v, record["sha256"])
            self.counts["held"] += 1
            return "held"
        while self.sha256 in self.held:  # deltas that were waiting for this one
            d, sha = self.held.pop(self.sha256)
            if d.base == self.version:
                if self.check_version(d) is None:
                    self._apply(d, sha)
                else:
                    self.counts["rejected"] += 1
        return "applied"

    def check_version(self, v: IdVersion) -> str | None:
        """Why ``v`` cannot be applied on what is served (a snapshot: on nothing), or None."""
        delta = v.kind == "delta"
        dense = {**self.dense, **v.dense} if delta else dict(v.dense)
        for name, arr in v.dense.items():
            if not np.issubdtype(arr.dtype, np.floating) or not np.isfinite(arr).all():
                return f"dense parameter {name!r}: {arr.dtype} values that are not all finite numbers"
            if delta and name in self.dense and self.dense[name].shape != arr.shape:
                return f"dense parameter {name!r} is {list(arr.shape)}, the served one {list(self.dense[name].shape)}"
        for name, change in v.tables.items():
            keys, rows, evicted = change.keys, change.rows, change.evicted
            if keys.ndim != 1 or evicted.ndim != 1 or not np.issubdtype(keys.dtype, np.integer) \
                    or not np.issubdtype(evicted.dtype, np.integer):
                return f"ID table {name!r}: keys and evicted IDs must be lists of whole numbers"
            if rows.ndim != 2 or len(rows) != len(keys) or not np.issubdtype(rows.dtype, np.floating):
                return f"ID table {name!r}: rows of {rows.dtype} {list(rows.shape)} for {len(keys)} keys"
            if not np.isfinite(rows).all():
                return f"ID table {name!r}: rows that are not all finite numbers"
            served = self.tables.get(name) if delta else None
            width = served.dim if served is not None else None
            if len(rows) and width is not None and rows.shape[1] != width:
                return f"ID table {name!r}: rows {rows.shape[1]} wide, the served table's are {width}"
            fallback = dense.get(f"{name}.fallback")
            if fallback is None:
                return f"ID table {name!r}: no fallback vector ({name}.fallback) for the IDs it does not hold"
            if len(rows) and fallback.shape != (rows.shape[1],):
                return f"ID table {name!r}: rows {rows.shape[1]} wide, its fallback vector {list(fallback.shape)}"
        return None

    def _apply(self, v: IdVersion, sha256: str) -> None:
        """``v`` (checked) applied to copies of what it changes; the served version replaced only at the end."""
        tables = dict(self.tables) if v.kind == "delta" else {}
        for name, change in v.tables.items():
            table = tables[name].copy() if name in tables else ServedTable(change.rows.shape[1])
            table.evict(change.evicted)
            table.upsert(change.keys, change.rows.astype(np.float32, copy=False))
            tables[name] = table
        dense = {**self.dense, **v.dense} if v.kind == "delta" else dict(v.dense)
        info = {**self.info, **v.info} if v.kind == "delta" else dict(v.info)
        self.tables, self.dense, self.info = tables, dense, info
        self.version, self.sha256 = v.version, sha256
        self.counts["applied"] += 1

    def snapshot(self) -> IdVersion:
        """The served version whole: its dense parameters and every row of every table, in key order."""
        if self.version is None:
            raise ValueError("no ID version served yet")
        tables = {}
        for name, t in self.tables.items():
            keys = np.fromiter(t.index.keys(), dtype=np.int64, count=len(t.index))
            at = np.fromiter(t.index.values(), dtype=np.int64, count=len(t.index))
            order = np.argsort(keys, kind="stable")
            tables[name] = TableChange(keys[order], t.rows[at[order]].reshape(-1, t.dim), np.zeros(0, np.int64))
        return IdVersion(self.version, None, "snapshot", dict(self.dense), tables, dict(self.info))

    def status(self) -> dict:
        """Counts for the scorer's status: the served version, versions applied, deltas held (waiting for
        their base or the next snapshot: never applied out of order) now and in all, stale, rejected, rows
        per table and unknown-ID look-ups."""
        return {"version": self.version, "applied": self.counts["applied"], "held_now": len(self.held),
                "held": self.counts["held"], "stale": self.counts["stale"], "rejected": self.counts["rejected"],
                "rows": {name: len(t) for name, t in self.tables.items()}, "unknown": dict(self.unknown)}

    def lookup(self, name: str, keys: np.ndarray) -> np.ndarray:
        """``[len(keys), dim]``: each key's row, or the table's fallback vector (counted in ``unknown``)."""
        fallback = self.dense[f"{name}.fallback"]
        table = self.tables.get(name)
        out = np.repeat(fallback[None, :].astype(np.float32), len(keys), axis=0)
        if table is None:
            self.unknown[name] += len(keys)
            return out
        rows = np.fromiter((table.index.get(int(k), -1) for k in keys), dtype=np.int64, count=len(keys))
        known = rows >= 0
        out[known] = table.rows[rows[known]]
        self.unknown[name] += int((~known).sum())
        return out

"""A raw partition's feature states on disk: one SQLite file (stdlib ``sqlite3``), one transaction per flush.

``StateStore(path)`` holds every key's ``KeyState`` (``pipelines.features.state``: bytes) and the partition's
progress (the next offset to read, the watermark, the events read but not yet emitted) in one database;
``save(states, meta)`` writes the states that changed and the progress in one transaction (WAL, synchronous
FULL): after a kill -9 at any moment the file holds either the flush before or the flush after, never a mix. The
stream commits its Kafka offsets only after that transaction, so the committed offset never runs ahead of the
states (``pipelines.features.stream``).
"""
from __future__ import annotations

import sqlite3
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from pathlib import Path

from pipelines.features.core import KeyState
from pipelines.features.state import decode_state, encode_state

#: Key states a store keeps in memory (the most recently used; the others are read from the file again).
CACHED_KEYS = 100_000


class StateStore:
    """States by key (text) and progress values (bytes) of one raw partition; the ``cached`` most recently used
    states kept in memory (a state is ~1 KB there, ~150 bytes or more in the file)."""

    def __init__(self, path: str | Path, *, cached: int = CACHED_KEYS):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.path = str(path)
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute("CREATE TABLE IF NOT EXISTS states (key TEXT PRIMARY KEY, state BLOB NOT NULL)")
        self.db.execute("CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value BLOB)")
        # the values of events that went on, by offset, until the offsets past them are committed (the scorer's:
        # its commit comes after the predictions, so a restart may read such events again)
        self.db.execute("CREATE TABLE IF NOT EXISTS sent (offset INTEGER PRIMARY KEY, row TEXT NOT NULL)")
        self.cache: OrderedDict[str, KeyState] = OrderedDict()
        self.cached = cached

    def meta(self) -> dict[str, bytes]:
        return dict(self.db.execute("SELECT name, value FROM meta").fetchall())

    def read_offset(self) -> int:
        """The next offset to read as the file holds it now (another process may have moved it on)."""
        row = self.db.execute("SELECT value FROM meta WHERE name = 'read_offset'").fetchone()
        return int(row[0]) if row else 0

    def load(self, keys: Iterable[str]) -> dict[str, KeyState]:
        """The states of these keys that exist (from the cache, else the file)."""
        out, missing = {}, []
        for k in keys:
            if k in self.cache:
                out[k] = self.cache[k]
                self.cache.move_to_end(k)
            else:
                missing.append(k)
        for i in range(0, len(missing), 500):
            part = missing[i:i + 500]
            rows = self.db.execute(f"SELECT key, state FROM states WHERE key IN ({','.join('?' * len(part))})",
                                   part).fetchall()
            for k, blob in rows:
                out[k] = self.cache[k] = decode_state(blob)
        self._trim()
        return out

    def _trim(self) -> None:
        while len(self.cache) > self.cached:
            self.cache.popitem(last=False)

    def sent(self, offsets: Iterable[int]) -> dict[int, str]:
        """The kept values of these offsets (those that went on and are kept)."""
        wanted = list(offsets)
        out: dict[int, str] = {}
        for i in range(0, len(wanted), 500):
            part = wanted[i:i + 500]
            out.update(self.db.execute(f"SELECT offset, row FROM sent WHERE offset IN ({','.join('?' * len(part))})",
                                       part).fetchall())
        return out

    def save(self, states: Mapping[str, KeyState], meta: Mapping[str, bytes], *,
             sent: Mapping[int, str] | None = None, committed: int | None = None) -> None:
        """The changed states and the progress, in one transaction; ``sent``: values of events that went on, kept
        until ``committed`` (the partition's committed offset) passes them."""
        self.cache.update(states)
        self._trim()
        self.db.execute("BEGIN IMMEDIATE")
        try:
            self.db.executemany("INSERT OR REPLACE INTO states (key, state) VALUES (?, ?)",
                                [(k, encode_state(s)) for k, s in states.items()])
            self.db.executemany("INSERT OR REPLACE INTO meta (name, value) VALUES (?, ?)", list(meta.items()))
            if sent:
                self.db.executemany("INSERT OR REPLACE INTO sent (offset, row) VALUES (?, ?)", list(sent.items()))
            if committed is not None:
                self.db.execute("DELETE FROM sent WHERE offset < ?", (committed,))
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise

    def close(self) -> None:
        self.db.close()

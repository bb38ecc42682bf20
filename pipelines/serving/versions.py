"""Model versions for serving: the model-updates topic -> the newest valid, authenticated version.

A record on the updates topic is the online trainer's (``connectors.model_updates``): version, run
id, the published file's path, SHA-256 and size, and an HMAC signature when the trainer has an
update key. ``VersionTracker`` decides which version serves:

- a record is believed only if it is well formed, at most ``MAX_RECORD_BYTES``, and, when this
  scorer has an update key, signed with it (unsigned and mis-signed records are rejected; without
  a key the tracker warns once, loudly, that updates are not authenticated). Any record at all is
  either believed or a rejection with its reason: nothing in a record raises out of the tracker;
- versions are numbered per trainer run (``run_id``): a record older than or equal to a version
  already seen *of its own run* is rejected (a replay); a record of another run never compares
  with this run's numbers, so no number, however large, pins the scorer. Among believable
  records the one published last that loads serves: publication order is the record's signed
  ``sequence`` (then partition and offset; the Kafka timestamp for an unsigned record without
  one), so a byte-identical re-send of an old record, however late, is older than what followed
  it, and a restarted scorer starts with the newest version on the topic, not the newest re-sent;
- the file it names is read only if it is a regular file (a FIFO is refused without blocking)
  of at most ``max_model_bytes``, with the record's digest; the scorer keeps its **own copy**
  (``ModelCache``: ``<cache>/<sha256>.pt`` plus its record), so the trainer's retention can never
  take away a version a scorer serves. The copies have their own retention (``keep``). A record
  whose file is gone but whose digest names a copy the scorer holds loads that copy; a scorer
  that finds no loadable version on the topic at start serves its newest valid copy
  (``VersionTracker.fall_back_to_stored``).

A model with ID tables is published as ID versions (``connectors.id_deltas``: a record with ``kind``
snapshot or delta and its ``base``; the payload holds the dense parameters and only the ID rows
changed). The tracker applies them per run with ``pipelines.ids.serving.ServedIds``, strictly in
order: a delta only on top of exactly its base; a delta after a gap (lost, late or reordered) is
held, never applied out of order, until its base is served or the next snapshot makes it moot;
a scorer starting late (or fallen behind) reads nothing before the newest snapshot on the topic
and applies the deltas after it. An evicted ID is served from its last row until the delta that
removes it. The version that serves is the scorer's own copy of what it applied, whole (a snapshot
payload in the model cache), so the handler, the fall-back to a stored copy and a restart load it
like any version. ``ids_status()`` has the counts (held, applied, stale, rejected).

Every rejected record is remembered with its reason (``rejected``, ``rejected_count``, counts by
kind in ``rejected_kinds``) and logged with the version that serves instead, once per kind (a
flood of bad records is counted, not logged line by line). Reading the topic (at the scorer's start, and
``NewestVersion``, what the scoring pipeline's model handler asks) is ``pipelines.serving.updates``.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple

from connectors.id_deltas import FORMAT as ID_FORMAT
from connectors.id_deltas import encode as encode_id_version
from connectors.model_updates import (
    DEFAULT_MAX_MODEL_BYTES,
    RejectedUpdate,
    UpdateRecord,
    check_record,
    read_model_file,
    sha256_hex,
)
from pipelines.ids.serving import ServedIds

__all__ = ["ModelVersion", "UpdateMessage", "VersionTracker", "ModelCache", "new_tracker"]

_log = logging.getLogger(__name__)

#: Trainer runs whose ID tables a tracker keeps (the serving one and the newest others).
MAX_ID_RUNS = 2

LoadVersion = Callable[..., tuple[Any, int]]  # (path, sha256=None) -> (eval module, version)


class UpdateMessage(NamedTuple):
    """One record read from the updates topic."""

    where: str  # "topic/partition/offset"
    value: bytes | None
    order: tuple[int, int, int] = (0, 0, 0)  # (Kafka timestamp ms, partition, offset): publication order


class ModelVersion(NamedTuple):
    """A version that loaded: what the side input names and what the handler loads."""

    version: int
    run_id: str
    path: str  # the file to load: the scorer's own copy (or the trainer's file for an old record without digest)
    sha256: str | None
    published_at: str
    order: tuple[int, int, int]

    def model_id(self) -> str:
        """The side input's ``ModelMetadata.model_id`` (the handler parses it back: ``from_model_id``)."""
        return json.dumps(self._asdict(), separators=(",", ":"))

    @classmethod
    def from_model_id(cls, model_id: str) -> ModelVersion:
        d = json.loads(model_id)
        return cls(int(d["version"]), str(d["run_id"]), str(d["path"]), d.get("sha256"), str(d["published_at"]),
                   tuple(int(x) for x in d["order"]))


class ModelCache:
    """The scorer's own copies of the versions it serves: ``<dir>/<sha256>.pt`` + ``<sha256>.json``.

    A copy is written atomically (temp file, rename) before its description, so a listed copy is
    complete; its name is its digest, so it is verified on every load. ``prune`` keeps the ``keep``
    most recently published copies (and any path it is told to keep)."""

    def __init__(self, directory: str | os.PathLike, keep: int = 3):
        self.dir = Path(directory)
        self.keep = max(1, int(keep))

    def put(self, data: bytes, version: ModelVersion) -> ModelVersion:
        digest = sha256_hex(data)
        self.dir.mkdir(parents=True, exist_ok=True)
        final = self.dir / f"{digest}.pt"
        if not final.exists():
            fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=f".{digest[:12]}-", suffix=".tmp")
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, final)
        mine = version._replace(path=str(final), sha256=digest)
        meta = self.dir / f"{digest}.json"
        tmp_meta = meta.with_suffix(f".json.{os.getpid()}.tmp")
        tmp_meta.write_text(mine.model_id())
        os.replace(tmp_meta, meta)
        return mine

    def adopt(self, version: ModelVersion, max_bytes: int) -> ModelVersion | None:
        """The copy of ``version`` (named by its digest, at most ``max_bytes``) when this cache holds
        it, else None; the copy's description is written again with ``version``'s publication."""
        final = self.dir / f"{version.sha256}.pt"
        if not version.sha256 or not final.is_file() or final.stat().st_size > max_bytes:
            return None
        mine = version._replace(path=str(final))
        meta = self.dir / f"{version.sha256}.json"
        tmp_meta = meta.with_suffix(f".json.{os.getpid()}.tmp")
        tmp_meta.write_text(mine.model_id())
        os.replace(tmp_meta, meta)
        return mine

    def listed(self) -> list[ModelVersion]:
        """The complete copies, most recently published first."""
        out = []
        for meta in self.dir.glob("*.json") if self.dir.is_dir() else []:
            try:
                v = ModelVersion.from_model_id(meta.read_text())
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if Path(v.path).is_file():
                out.append(v)
        return sorted(out, key=lambda v: v.order, reverse=True)

    def prune(self, keep_paths: Iterable[str] = ()) -> None:
        keep = set(keep_paths)
        for v in self.listed()[self.keep:]:
            if v.path in keep:
                continue
            Path(v.path).with_suffix(".json").unlink(missing_ok=True)
            Path(v.path).unlink(missing_ok=True)


class VersionTracker:
    """The newest valid published version (see the module doc); rejected records are remembered."""

    def __init__(self, load_version: LoadVersion, *, key: bytes | None = None, cache: ModelCache | None = None,
                 max_model_bytes: int = DEFAULT_MAX_MODEL_BYTES, warn_unsigned: bool = True):
        self._load = load_version
        self.key = key
        self.cache = cache or ModelCache(tempfile.mkdtemp(prefix="flowtrain-models-"))
        self.max_model_bytes = int(max_model_bytes)
        self.current: ModelVersion | None = None
        self.rejected: list[dict] = []  # the newest 100, each with its reason
        self.rejected_count = 0
        self.rejected_kinds: dict[str, int] = {}  # kind -> count (each kind is logged once)
        self.newest_by_run: dict[str, int] = {}
        self._seen: set[str] = set()  # records already decided (a record is never tried twice)
        self.ids: dict[str, ServedIds] = {}  # run id -> its ID tables as applied (models with ID tables)
        self._id_orders: dict[str, dict[int, tuple[str, tuple]]] = {}  # run -> version -> (where, order)
        self.ids_superseded = 0  # ID records before the newest snapshot read with them: never read
        self._held_logged = False
        if key is None and warn_unsigned:
            _log.warning("MODEL UPDATES ARE NOT AUTHENTICATED: no update key (--update-key-file or "
                         "$FLOWTRAIN_UPDATE_KEY), so any producer on the updates topic can make this scorer load "
                         "its file; set the trainer's key here too")

    def offer(self, records: Iterable[UpdateMessage | tuple]) -> bool:
        """Records in any order; True if the current version changed. Each rejection is counted and
        remembered; the first of each kind is logged. Nothing a record holds raises out of here."""
        believed: list[tuple[UpdateMessage, UpdateRecord]] = []
        rejects: list[tuple[str, Any, str, str]] = []  # (where, version, reason, kind)
        for msg in records:
            msg = UpdateMessage(*msg)
            if msg.where in self._seen:
                continue
            self._seen.add(msg.where)
            try:
                rec = check_record(msg.value, self.key)
            except RejectedUpdate as err:
                rejects.append((msg.where, None, str(err), err.kind))
                continue
            except Exception as err:  # noqa: BLE001 - check_record raises only RejectedUpdate; a guard
                rejects.append((msg.where, None, f"not a model-update record ({type(err).__name__})", "malformed"))
                continue
            if rec.sequence is not None:  # the signed publication order (a re-send keeps it)
                msg = msg._replace(order=(rec.sequence, *tuple(msg.order)[1:]))
            believed.append((msg, rec))
        id_versions = [(m, r) for m, r in believed if r.raw.get("format") == ID_FORMAT]
        believed = [(m, r) for m, r in believed if r.raw.get("format") != ID_FORMAT]
        candidates = []
        run_high: dict[str, tuple] = {}  # run -> (version, sha256) of its newest record read so far
        for msg, rec in sorted(believed, key=lambda mr: tuple(mr[0].order)):  # in publication order
            newest = self.newest_by_run.get(rec.run_id)
            high = run_high.get(rec.run_id)
            if (newest is not None and rec.version <= newest) or (high is not None and rec.version <= high[0]):
                cur = self.current
                again = (high is not None and (rec.version, rec.sha256) == high) or (
                    cur is not None and (rec.run_id, rec.version, rec.sha256) == (cur.run_id, cur.version, cur.sha256))
                if not again:  # (the same version published again: a producer's retry)
                    than = max(newest or 0, high[0] if high else 0)
                    rejects.append((msg.where, rec.version, f"not newer than version {than} of its run "
                                                            f"{rec.run_id or '(unnamed)'}: versions of a run only "
                                                            f"move forward (a replayed or stale record)", "stale"))
                continue
            run_high[rec.run_id] = (rec.version, rec.sha256)
            candidates.append((msg, rec))
        changed = False
        for msg, rec in reversed(candidates):  # the last published first; older ones are superseded
            cur = self.current
            if cur is not None and tuple(msg.order) <= tuple(cur.order):  # published before what serves
                rejects.append((msg.where, rec.version, f"published before the serving version {cur.version} of "
                                                        f"run {cur.run_id or '(unnamed)'} (a replayed or stale "
                                                        f"record)", "stale"))
                continue
            try:
                self.current, changed = self._try(msg, rec), True
            except Exception as err:  # noqa: BLE001 - any failure to read or load rejects the version
                kind = err.kind if isinstance(err, RejectedUpdate) else "load"
                reason = str(err) if isinstance(err, RejectedUpdate) else f"{type(err).__name__}: {err}"
                rejects.append((msg.where, rec.version, reason, kind))
                continue
            # numbers move forward per run from what served (a record that failed to load, however
            # large its number, never blocks the run's next versions)
            self.newest_by_run[rec.run_id] = max(self.newest_by_run.get(rec.run_id, 0), rec.version)
            break
        changed = self._offer_ids(id_versions, rejects) or changed
        for where, version, reason, kind in rejects:
            self._reject(where, version, reason, kind)
        if changed:
            self.cache.prune(keep_paths=[self.current.path])
        return changed

    def _offer_ids(self, believed: list[tuple[UpdateMessage, UpdateRecord]], rejects: list) -> bool:
        """ID versions (see the module doc), per run in publication order; True if the serving version changed."""
        runs: dict[str, list[tuple[UpdateMessage, UpdateRecord]]] = {}
        for msg, rec in sorted(believed, key=lambda mr: tuple(mr[0].order)):
            runs.setdefault(rec.run_id, []).append((msg, rec))
        changed = False
        for run, items in sorted(runs.items(), key=lambda kv: tuple(kv[1][-1][0].order)):
            served = self.ids.get(run)
            snaps = [i for i, (_, r) in enumerate(items) if r.raw.get("kind") == "snapshot"]
            if snaps and (served is None or served.version is None or items[snaps[-1]][1].version > served.version):
                self.ids_superseded += snaps[-1]  # a late start or a scorer behind: the newest snapshot on
                items = items[snaps[-1]:]
            if served is None:
                served = self.ids[run] = ServedIds(self.key, self.max_model_bytes)
                for other in [r for r in self.ids if r != run and (self.current is None or r != self.current.run_id)]:
                    if len(self.ids) <= MAX_ID_RUNS:
                        break
                    del self.ids[other]
                    self._id_orders.pop(other, None)
            before = served.version
            orders = self._id_orders.setdefault(run, {})
            for msg, rec in items:
                orders[rec.version] = (msg.where, tuple(msg.order))
                try:
                    payload = read_model_file(rec, self.max_model_bytes)
                except RejectedUpdate as err:
                    rejects.append((msg.where, rec.version, str(err), err.kind))
                    continue
                try:
                    result = served.offer(rec.raw, payload)
                except Exception as err:  # noqa: BLE001 - nothing a record holds raises out of offer
                    result = f"rejected: {type(err).__name__}: {str(err)[:300]}"
                if result.startswith("rejected"):
                    rejects.append((msg.where, rec.version, result.partition(": ")[2], "ID version"))
                elif result == "stale":
                    rejects.append((msg.where, rec.version, f"not newer than ID version {served.version} of its run "
                                                            f"{run or '(unnamed)'} (a replayed or stale record)",
                                    "stale"))
                elif result == "held" and not self._held_logged:
                    self._held_logged = True
                    _log.warning("ID delta version %d (on version %s) published at %s does not follow the served "
                                 "version %s: held until its base is served or the next snapshot, never applied out "
                                 "of order (further ones are counted in the status)", rec.version,
                                 rec.raw.get("base"), msg.where, served.version)
            if served.version is None or served.version == before:
                continue
            for v in [v for v in orders if v < served.version]:
                del orders[v]
            where, order = orders.get(served.version, (f"ID version {served.version}", (0, 0, 0)))
            cur = self.current
            if cur is not None and tuple(order) <= tuple(cur.order):
                continue  # published before what serves
            try:
                self.current, changed = self._store_ids(run, served, where, order), True
            except Exception as err:  # noqa: BLE001 - a version that does not load is rejected, the previous serves
                reason = str(err) if isinstance(err, RejectedUpdate) else f"{type(err).__name__}: {err}"
                rejects.append((where, served.version, reason, "load"))
                continue
            self.newest_by_run[run] = max(self.newest_by_run.get(run, 0), served.version)
        return changed

    def _store_ids(self, run: str, served: ServedIds, where: str, order: tuple) -> ModelVersion:
        """The applied ID version whole into the model cache (the copy the handler loads), checked to load."""
        version = self.cache.put(encode_id_version(served.snapshot()),
                                 ModelVersion(int(served.version), run, "", None, where, tuple(order)))
        _, loaded = self._load(version.path, version.sha256)
        if int(loaded) != version.version:
            raise RejectedUpdate(f"the ID version {version.version} stored loads as version {loaded}", "load")
        return version

    def ids_status(self) -> dict | None:
        """The serving run's ID tables (``ServedIds.status``) and the records superseded by a newer snapshot;
        None without ID versions."""
        if not self.ids:
            return None
        run = self.current.run_id if self.current is not None and self.current.run_id in self.ids else \
            next(reversed(self.ids))
        return {"run_id": run, **self.ids[run].status(), "superseded": self.ids_superseded}

    def _reject(self, where: str, version: int | None, reason: str, kind: str) -> None:
        self.rejected = (self.rejected + [{"version": version, "published_at": where, "reason": reason,
                                           "kind": kind}])[-100:]
        self.rejected_count += 1
        self.rejected_kinds[kind] = self.rejected_kinds.get(kind, 0) + 1
        if self.rejected_kinds[kind] > 1:
            _log.debug("model version %s published at %s rejected: %s", version, where, reason)
            return
        serving = (f"; serving version {self.current.version} of run {self.current.run_id or '(unnamed)'}"
                   if self.current else "; no version to serve yet")
        _log.warning("model version %s published at %s rejected: %s%s (further rejections of kind %r are "
                     "counted in the status, not logged)", version if version is not None else "?", where,
                     reason, serving, kind)

    def _try(self, msg: UpdateMessage, rec: UpdateRecord) -> ModelVersion:
        """Read, copy and load the record's file; the served ``ModelVersion`` (or an exception).
        A copy this scorer already holds (named by the record's digest) is loaded instead of the
        trainer's file: the record authenticates it as well, and the trainer may have pruned its own."""
        version = ModelVersion(rec.version, rec.run_id, rec.path, rec.sha256, msg.where, tuple(msg.order))
        if rec.sha256 is None:  # an old unsigned record: the trainer's file, checked against its sidecar
            _, loaded = self._load(rec.path)
        else:
            mine = self.cache.adopt(version, self.max_model_bytes)
            if mine is None:
                mine = self.cache.put(read_model_file(rec, self.max_model_bytes), version)
            version = mine
            _, loaded = self._load(version.path, version.sha256)
        if int(loaded) != rec.version:
            raise RejectedUpdate(f"the record says version {rec.version}, its checkpoint holds version {loaded}",
                                 "load")
        return version

    def fall_back_to_stored(self) -> ModelVersion | None:
        """No loadable version on the topic: serve the newest copy in this scorer's cache that loads
        (each was authenticated when it was stored); None when there is none."""
        for cand in self.cache.listed():
            try:
                _, loaded = self._load(cand.path, cand.sha256)
                if int(loaded) != cand.version:
                    raise ValueError(f"holds version {loaded}, not {cand.version}")
            except Exception as err:  # noqa: BLE001 - the next older copy, then
                _log.warning("stored model version %d at %s cannot be loaded (%s: %s)", cand.version, cand.path,
                             type(err).__name__, err)
                continue
            self.current = cand
            self.newest_by_run[cand.run_id] = max(self.newest_by_run.get(cand.run_id, 0), cand.version)
            _log.warning("no model version on the updates topic can be loaded; serving version %d of run %s, the "
                         "newest valid copy this scorer stored (%s)", cand.version, cand.run_id or "(unnamed)",
                         cand.path)
            return cand
        return None


def new_tracker(cfg, *, warn_unsigned: bool = True) -> VersionTracker:
    """A tracker with ``cfg``'s (a ``ScoreConfig``) key, cache and bounds; the key is read here, in the
    process that uses it."""
    key = cfg.update_key.load() if cfg.update_key is not None else None
    return VersionTracker(cfg.load_version, key=key, cache=ModelCache(cfg.model_cache_dir, cfg.keep_models),
                          max_model_bytes=cfg.max_model_bytes, warn_unsigned=warn_unsigned)

"""Model versions for serving: the model-updates topic -> the newest valid, authenticated version.

A record on the updates topic is the online trainer's (``connectors.model_updates``): version, run
id, the published file's path, SHA-256 and size, and an HMAC signature when the trainer has an
update key. ``VersionTracker`` decides which version serves:

- a record is believed only if it is well formed, at most ``MAX_RECORD_BYTES``, and, when this
  scorer has an update key, signed with it (unsigned and mis-signed records are rejected; without
  a key the tracker warns once, loudly, that updates are not authenticated);
- versions are numbered per trainer run (``run_id``): a record older than or equal to a version
  already seen *of its own run* is rejected (a replay); a record of another run never compares
  with this run's numbers, so no number, however large, pins the scorer. Among believable
  records the one published last (Kafka timestamp, then partition and offset) that loads serves;
- the file it names is read only if it is a regular file (a FIFO is refused without blocking)
  of at most ``max_model_bytes``, with the record's digest; the scorer keeps its **own copy**
  (``ModelCache``: ``<cache>/<sha256>.pt`` plus its record), so the trainer's retention can never
  take away a version a scorer serves. The copies have their own retention (``keep``).

Every rejected record is remembered with its reason (``rejected``, ``rejected_count``) and
logged with the version that serves instead. ``LatestModelVersion`` is the side input of the
scoring pipeline (one look-up per serving window, Beam's "slowly updating side input").
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple

import apache_beam as beam
from apache_beam.ml.inference.base import ModelMetadata
from apache_beam.transforms import window
from apache_beam.transforms.periodicsequence import PeriodicImpulse
from apache_beam.utils.timestamp import Timestamp

from connectors.kafka import close_client, new_consumer, retry_kafka
from connectors.model_updates import (
    DEFAULT_MAX_MODEL_BYTES,
    RejectedUpdate,
    UpdateRecord,
    check_record,
    read_model_file,
    sha256_hex,
)
from pipelines.flights.status import write_status

__all__ = ["ModelVersion", "UpdateMessage", "VersionTracker", "ModelCache", "read_updates", "updates_consumer",
           "new_tracker", "wait_for_version", "LatestModelVersion", "first_tick", "WINDOW_OFFSET_S"]

_log = logging.getLogger(__name__)

#: Serving windows start this far after each whole multiple of the interval: Kafka timestamps are
#: whole milliseconds, so no event lands exactly on a tick (a tick at T is not in the side input
#: before the side input's watermark has passed T).
WINDOW_OFFSET_S = 0.0005

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
        self.newest_by_run: dict[str, int] = {}
        self._seen: set[str] = set()  # records already decided (a record is never tried twice)
        if key is None and warn_unsigned:
            _log.warning("MODEL UPDATES ARE NOT AUTHENTICATED: no update key (--update-key-file or "
                         "$FLOWTRAIN_UPDATE_KEY), so any producer on the updates topic can make this scorer load "
                         "its file; set the trainer's key here too")

    def offer(self, records: Iterable[UpdateMessage | tuple]) -> bool:
        """Records in any order; True if the current version changed. Each rejection is logged."""
        believed: list[tuple[UpdateMessage, UpdateRecord]] = []
        rejects: list[tuple[str, Any, str]] = []
        for msg in records:
            msg = UpdateMessage(*msg)
            if msg.where in self._seen:
                continue
            self._seen.add(msg.where)
            try:
                believed.append((msg, check_record(msg.value, self.key)))
            except RejectedUpdate as err:
                rejects.append((msg.where, None, str(err)))
        candidates = []
        for msg, rec in sorted(believed, key=lambda mr: mr[0].order):  # in publication order
            newest = self.newest_by_run.get(rec.run_id)
            if newest is not None and rec.version <= newest:
                cur = self.current
                if cur is None or (rec.run_id, rec.version, rec.sha256) != (cur.run_id, cur.version, cur.sha256):
                    rejects.append((msg.where, rec.version, f"not newer than version {newest} of its run "
                                                            f"{rec.run_id or '(unnamed)'}: versions of a run only "
                                                            f"move forward (a replayed or stale record)"))
                continue  # (the serving version itself published again: a producer's retry)
            candidates.append((msg, rec))
        changed = False
        for msg, rec in reversed(candidates):  # the last published first; older ones are superseded
            if self.current is not None and msg.order <= self.current.order:
                break
            try:
                self.current, changed = self._try(msg, rec), True
            except Exception as err:  # noqa: BLE001 - any failure to read or load rejects the version
                reason = str(err) if isinstance(err, RejectedUpdate) else f"{type(err).__name__}: {err}"
                rejects.append((msg.where, rec.version, reason))
                continue
            # numbers move forward per run from what served (a record that failed to load, however
            # large its number, never blocks the run's next versions)
            self.newest_by_run[rec.run_id] = max(self.newest_by_run.get(rec.run_id, 0), rec.version)
            break
        for where, version, reason in rejects:
            serving = (f"; serving version {self.current.version} of run {self.current.run_id or '(unnamed)'}"
                       if self.current else "; no version to serve yet")
            _log.warning("model version %s published at %s rejected: %s%s",
                         version if version is not None else "?", where, reason, serving)
            self.rejected = (self.rejected + [{"version": version, "published_at": where, "reason": reason}])[-100:]
            self.rejected_count += 1
        if changed:
            self.cache.prune(keep_paths=[self.current.path])
        return changed

    def _try(self, msg: UpdateMessage, rec: UpdateRecord) -> ModelVersion:
        """Read, copy and load the record's file; the served ``ModelVersion`` (or an exception)."""
        version = ModelVersion(rec.version, rec.run_id, rec.path, rec.sha256, msg.where, tuple(msg.order))
        if rec.sha256 is None:  # an old unsigned record: the trainer's file, checked against its sidecar
            _, loaded = self._load(rec.path)
        else:
            data = read_model_file(rec, self.max_model_bytes)
            version = self.cache.put(data, version)
            _, loaded = self._load(version.path, version.sha256)
        if int(loaded) != rec.version:
            raise RejectedUpdate(f"the record says version {rec.version}, its checkpoint holds version {loaded}")
        return version


def read_updates(consumer, *, rounds: int = 20, poll_ms: int = 50) -> list[UpdateMessage]:
    """Records the consumer has not returned yet, in partition-offset order.

    Each poll is retried on its own (``retry_kafka``): retrying the whole read would drop the
    records already polled, since the consumer's position has moved past them."""
    out = []
    for _ in range(rounds):
        polled = retry_kafka(lambda: consumer.poll(timeout_ms=poll_ms), "reading model updates")
        if not polled:
            break
        for tp, records in sorted(polled.items(), key=lambda kv: kv[0].partition):
            out += [UpdateMessage(f"{tp.topic}/{tp.partition}/{r.offset}", r.value,
                                  (int(r.timestamp), tp.partition, r.offset)) for r in records]
    return out


def updates_consumer(bootstrap: str, topic: str, kafka_config: dict, *, wait_s: float = 30.0):
    """A consumer assigned to every partition of the updates topic, from the beginning."""
    from kafka import TopicPartition

    consumer = new_consumer(bootstrap, {"fetch_max_wait_ms": 50, **kafka_config}, group_id=None)
    deadline = time.monotonic() + wait_s
    parts = consumer.partitions_for_topic(topic)
    while not parts and time.monotonic() < deadline:
        time.sleep(0.5)
        parts = consumer.partitions_for_topic(topic)
    if not parts:
        close_client(consumer)
        raise ValueError(f"model-updates topic {topic!r} does not exist on {bootstrap}; the online trainer creates "
                         f"it (flowtrain stream train)")
    tps = [TopicPartition(topic, p) for p in sorted(parts)]
    consumer.assign(tps)
    consumer.seek_to_beginning(*tps)
    return consumer


def new_tracker(cfg, *, warn_unsigned: bool = True) -> VersionTracker:
    """A tracker with ``cfg``'s (a ``ScoreConfig``) key, cache and bounds; the key is read here, in the
    process that uses it."""
    key = cfg.update_key.load() if cfg.update_key is not None else None
    return VersionTracker(cfg.load_version, key=key, cache=ModelCache(cfg.model_cache_dir, cfg.keep_models),
                          max_model_bytes=cfg.max_model_bytes, warn_unsigned=warn_unsigned)


def wait_for_version(cfg, *, timeout_s: float) -> tuple[ModelVersion, VersionTracker]:
    """The newest valid version on ``cfg.updates_topic``, waiting up to ``timeout_s`` for one."""
    consumer = updates_consumer(cfg.bootstrap, cfg.updates_topic, dict(cfg.kafka_config), wait_s=timeout_s)
    tracker = new_tracker(cfg)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            tracker.offer(read_updates(consumer, poll_ms=200))
            if tracker.current is not None:
                return tracker.current, tracker
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no valid model version on {cfg.updates_topic!r} after {timeout_s:.0f} s "
                                   f"({tracker.rejected_count} rejected); start the online trainer "
                                   f"(flowtrain stream train) or wait longer (--wait-model)")
            time.sleep(0.5)
    finally:
        close_client(consumer)


class _LatestVersionFn(beam.DoFn):
    """Tick -> ``ModelMetadata`` of the newest valid version, exactly one per serving window: until
    this worker's tracker has read a version, the version the scorer started with (``initial_model``,
    found and authenticated by ``wait_for_version``). Flink's portable runner holds an element
    until its window's side input has a value, so a window without one would never be scored."""

    def __init__(self, cfg):
        self.cfg = cfg

    def setup(self):
        self.consumer = updates_consumer(self.cfg.bootstrap, self.cfg.updates_topic, self.cfg.kafka_config)
        self.tracker = new_tracker(self.cfg, warn_unsigned=False)  # the command warned already

    def teardown(self):
        if getattr(self, "consumer", None) is not None:
            close_client(self.consumer)
            self.consumer = None

    def process(self, _tick):
        before = self.tracker.rejected_count
        changed = self.tracker.offer(read_updates(self.consumer))
        current = self.tracker.current
        if changed or self.tracker.rejected_count != before:
            write_status(self.cfg.status_path, self, kind="versions", status={
                "version": current.version if current else None, "run_id": current.run_id if current else None,
                "path": current.path if current else None, "rejected_count": self.tracker.rejected_count,
                "rejected": self.tracker.rejected[-20:]})
        if changed:
            _log.info("model version %d of run %s (%s) is the newest valid one", current.version,
                      current.run_id or "(unnamed)", current.path)
        if current is not None:
            yield ModelMetadata(model_id=current.model_id(), model_name=f"v{current.version}")
        elif self.cfg.initial_model:  # the first look-ups can come before the consumer's first fetch
            initial = ModelVersion.from_model_id(self.cfg.initial_model)
            yield ModelMetadata(model_id=self.cfg.initial_model, model_name=f"v{initial.version}")


def first_tick(start: float, interval_s: float) -> float:
    """The time of ``LatestModelVersion``'s first tick: the start of the serving window holding ``start``."""
    return (start // interval_s) * interval_s + WINDOW_OFFSET_S


class LatestModelVersion(beam.PTransform):
    """Beam's slowly-updating side input: the newest valid version on the updates topic per window,
    one tick in each serving window from the one holding ``start`` (default: now) on."""

    def __init__(self, cfg, *, start: float | None = None):
        super().__init__()
        self.cfg = cfg
        self.start = start

    def expand(self, pbegin):
        n = self.cfg.swap_interval_s
        first = first_tick(time.time() if self.start is None else self.start, n)
        return (pbegin
                | "Tick" >> PeriodicImpulse(start_timestamp=Timestamp.of(first), fire_interval=n)
                | "TickWindows" >> beam.WindowInto(window.FixedWindows(n, offset=WINDOW_OFFSET_S))
                | "NewestValid" >> beam.ParDo(_LatestVersionFn(self.cfg)))


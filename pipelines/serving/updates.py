"""Reading the model-updates topic for serving: ``updates_consumer`` (every partition, from the beginning),
``read_updates`` (the records not read yet), ``wait_for_version`` (the newest valid version at the scorer's
start: the topic read to its end, else the newest stored copy), and ``NewestVersion``, what the scoring
pipeline's model handler asks before each forward: the newest valid version as a reader thread per worker
process has read it (every ``--swap-interval`` seconds). Which version serves is
``pipelines.serving.versions.VersionTracker``'s decision.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable

from connectors.kafka import close_client, new_consumer, retry_kafka, wait_for_partitions
from pipelines.serving.versions import ModelVersion, UpdateMessage, VersionTracker, new_tracker
from pipelines.stream.status import write_status

__all__ = ["PARTITIONS_ASK_S", "NewestVersion", "read_updates", "updates_consumer", "wait_for_version"]

_log = logging.getLogger(__name__)

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


#: The bound on each question about the updates topic's partitions (kafka-python's own wait has none).
PARTITIONS_ASK_S = 5.0


def updates_consumer(bootstrap: str, topic: str, kafka_config: dict, *, wait_s: float = 30.0):
    """A consumer assigned to every partition of the updates topic, from the beginning.

    It waits up to ``wait_s`` for the topic (the trainer creates it) and for brokers that do not answer, each
    question bounded (``connectors.kafka.topic_partitions``); then a ``ValueError`` says the topic does not
    exist, or names the brokers that never answered and the topic."""
    from kafka import TopicPartition

    config = {"fetch_max_wait_ms": 50, **kafka_config}
    consumer, parts, unavailable = wait_for_partitions(
        new_consumer(bootstrap, config, group_id=None), topic, wait_s=wait_s, ask_s=PARTITIONS_ASK_S,
        reconnect=lambda: new_consumer(bootstrap, config, group_id=None))
    if unavailable is not None:  # a one-line error, as a missing topic is (the callers say it so)
        raise ValueError(f"the partitions of model-updates topic {topic!r} (asked for {wait_s:g} s): "
                         f"{unavailable}") from None
    if not parts:
        close_client(consumer)
        raise ValueError(f"model-updates topic {topic!r} does not exist on {bootstrap}; the online trainer creates "
                         f"it (flowtrain stream train)")
    tps = [TopicPartition(topic, p) for p in sorted(parts)]
    consumer.assign(tps)
    consumer.seek_to_beginning(*tps)
    return consumer


def _read_to_end(consumer) -> Callable[[], bool]:
    """A check: has ``consumer`` read every partition up to its end offset of now?"""
    tps = list(consumer.assignment())
    ends = retry_kafka(lambda: consumer.end_offsets(tps), "end offsets of the updates topic")
    return lambda: all(consumer.position(tp) >= ends[tp] for tp in tps)


def wait_for_version(cfg, *, timeout_s: float) -> tuple[ModelVersion, VersionTracker]:
    """The newest valid version on ``cfg.topics.updates``, waiting up to ``timeout_s`` for one.

    The topic is read to its end before a version is chosen (the newest there wins, not the first
    read; ID versions start at the newest snapshot there); when nothing there loads, the newest
    valid copy the scorer stored serves (``VersionTracker.fall_back_to_stored``: the trainer's
    ``published/`` may be gone)."""
    consumer = updates_consumer(cfg.kafka.bootstrap, cfg.topics.updates, dict(cfg.kafka.config), wait_s=timeout_s)
    tracker = new_tracker(cfg)
    deadline = time.monotonic() + timeout_s
    try:
        at_end, fell_back, empty, pending = _read_to_end(consumer), False, 0, []
        while True:
            records = read_updates(consumer, poll_ms=200)
            pending += records
            empty = 0 if records else empty + 1
            done = at_end()
            out_of_time = time.monotonic() >= deadline
            if done or empty >= 3 or out_of_time:  # what the topic holds, in one offer: the newest snapshot of
                tracker.offer(pending)  # ID versions is found before any file older than it is read
                pending = []
            if tracker.current is None and not fell_back and (done or out_of_time):
                fell_back = True
                tracker.fall_back_to_stored()
            # (three empty reads: caught up, where offsets without records, e.g. transaction markers,
            # keep the position below the end offset)
            if tracker.current is not None and (done or empty >= 3 or out_of_time):
                return tracker.current, tracker
            if out_of_time:
                raise TimeoutError(f"no valid model version on {cfg.topics.updates!r} after {timeout_s:.0f} s "
                                   f"({tracker.rejected_count} rejected{_kinds(tracker)}) and none stored in "
                                   f"{cfg.model_cache_dir or 'the model cache'}; start the online trainer "
                                   f"(flowtrain stream train) or wait longer (--wait-model)")
            if done:
                time.sleep(0.5)
    finally:
        close_client(consumer)


def _kinds(tracker: VersionTracker) -> str:
    return (": " + ", ".join(f"{n} {kind}" for kind, n in sorted(tracker.rejected_kinds.items()))
            if tracker.rejected_kinds else "")


#: A worker process reads the updates topic to its end before it scores its first micro-batch, waiting at most this
#: long (a scorer whose job took a while to start serves the version published meanwhile from its first event on).
FIRST_READ_S = 30.0


def _read_all(consumer, timeout_s: float) -> list[UpdateMessage]:
    """Every record up to the end offsets of now (or what ``timeout_s`` allowed), as ``wait_for_version`` reads."""
    at_end, out, empty = _read_to_end(consumer), [], 0
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        records = read_updates(consumer, poll_ms=200)
        out += records
        empty = 0 if records else empty + 1
        if at_end() or empty >= 3:  # (three empty reads: offsets without records, e.g. transaction markers)
            break
    return out


class _Watcher:
    """One per process and scorer: a daemon thread reading the updates topic (first to its end, then every
    ``swap_interval`` seconds) into a ``VersionTracker``; ``current`` is the newest valid version read so far,
    ``announced_at`` when it was found; ``first_read()`` waits (once) for the first read to end."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.current: ModelVersion | None = None
        self.announced_at = 0.0
        self._read_once = threading.Event()
        self._waited = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flowtrain-model-versions", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def first_read(self) -> None:
        """Wait for the first read of the topic (to its end), once per process and at most ``FIRST_READ_S``."""
        if not self._waited:
            self._read_once.wait(FIRST_READ_S)
            self._waited = True

    def _run(self) -> None:
        consumer, tracker, failing = None, None, None
        while not self._stop.is_set():
            try:
                if consumer is None:
                    consumer = updates_consumer(self.cfg.kafka.bootstrap, self.cfg.topics.updates, self.cfg.kafka.config)
                    tracker = tracker or new_tracker(self.cfg, warn_unsigned=False)  # the command warned already
                    self._look(tracker, _read_all(consumer, FIRST_READ_S))  # the topic's end: one offer
                else:
                    self._look(tracker, read_updates(consumer))
                self._read_once.set()
                if failing is not None:
                    _log.info("reading model updates from %s again", self.cfg.topics.updates)
                failing = None
            except Exception as err:  # noqa: BLE001 - the thread must live: the newest valid version keeps serving
                reason = f"{type(err).__name__}: {err}"
                if reason != failing:
                    _log.warning("cannot read model updates from %s (%s); the newest valid version read so far keeps "
                                 "serving, retrying every %g s", self.cfg.topics.updates, reason,
                                 self.cfg.swap_interval)
                failing = reason
                self._read_once.set()  # nothing to wait for: the version the process has serves meanwhile
                if consumer is not None:
                    close_client(consumer)
                    consumer = None
            self._stop.wait(self.cfg.swap_interval)
        if consumer is not None:
            close_client(consumer)

    def _look(self, tracker: VersionTracker, records: list[UpdateMessage]) -> None:
        before, ids_before = tracker.rejected_count, tracker.ids_status()
        changed = tracker.offer(records)
        current, ids = tracker.current, tracker.ids_status()
        if changed:
            self.current, self.announced_at = current, time.time()
            _log.info("model version %d of run %s (%s) is the newest valid one", current.version,
                      current.run_id or "(unnamed)", current.path)
        if changed or tracker.rejected_count != before or ids != ids_before:
            write_status(self.cfg.status_path, self, kind="versions", status={
                "version": current.version if current else None, "run_id": current.run_id if current else None,
                "path": current.path if current else None, "announced_at": self.announced_at or None,
                "rejected_count": tracker.rejected_count, "rejected_kinds": dict(tracker.rejected_kinds),
                "rejected": tracker.rejected[-20:], **({"ids": ids} if ids is not None else {})})


_WATCHERS: dict[str, _Watcher] = {}
_WATCHERS_LOCK = threading.Lock()


class NewestVersion:
    """The newest valid, authenticated version on the updates topic, as this process has read it: what the
    scorer's model handler serves (``pipelines.serving.handler``).

    Picklable (the config and a token): in each worker process the first call starts one reader thread for the
    token (``_Watcher``: the topic read from the beginning to its end, then every ``swap_interval`` seconds, each
    record decided by a ``VersionTracker``); the first call waits for that first read (at most ``FIRST_READ_S``),
    later calls are a dict look-up. None while the thread has found no valid version (the handler serves the version
    the scorer started with, ``ScoreConfig.initial_model``)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.token = uuid.uuid4().hex

    def _watcher(self) -> _Watcher:
        watcher = _WATCHERS.get(self.token)
        if watcher is None:
            with _WATCHERS_LOCK:
                watcher = _WATCHERS.get(self.token)
                if watcher is None:
                    watcher = _WATCHERS[self.token] = _Watcher(self.cfg)
        return watcher

    def __call__(self) -> ModelVersion | None:
        watcher = self._watcher()
        watcher.first_read()
        return watcher.current

    def announced_at(self) -> float:
        """When this process found the version ``__call__`` returns (epoch seconds; 0 before)."""
        return self._watcher().announced_at

    def stop(self) -> None:
        """Stop this process's reader thread (tests; a worker process's thread is a daemon)."""
        with _WATCHERS_LOCK:
            watcher = _WATCHERS.pop(self.token, None)
        if watcher is not None:
            watcher.stop()

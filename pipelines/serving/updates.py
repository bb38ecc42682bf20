"""Reading the model-updates topic for serving: ``updates_consumer`` (every partition, from the beginning),
``read_updates`` (the records not read yet), ``wait_for_version`` (the newest valid version at the scorer's
start: the topic read to its end, else the newest stored copy), and ``LatestModelVersion``, the side input of
the scoring pipeline (one look-up per serving window, Beam's "slowly updating side input"). Which version
serves is ``pipelines.serving.versions.VersionTracker``'s decision.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import apache_beam as beam
from apache_beam.ml.inference.base import ModelMetadata
from apache_beam.transforms import window
from apache_beam.transforms.periodicsequence import PeriodicImpulse
from apache_beam.utils.timestamp import Timestamp

from connectors.kafka import close_client, new_consumer, retry_kafka, wait_for_partitions
from pipelines.serving.versions import ModelVersion, UpdateMessage, VersionTracker, new_tracker
from pipelines.stream.status import write_status

__all__ = ["PARTITIONS_ASK_S", "WINDOW_OFFSET_S", "LatestModelVersion", "first_tick", "read_updates",
           "updates_consumer", "wait_for_version"]

_log = logging.getLogger(__name__)

#: Serving windows start this far after each whole multiple of the interval: Kafka timestamps are
#: whole milliseconds, so no event lands exactly on a tick (a tick at T is not in the side input
#: before the side input's watermark has passed T).
WINDOW_OFFSET_S = 0.0005


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
    """The newest valid version on ``cfg.updates_topic``, waiting up to ``timeout_s`` for one.

    The topic is read to its end before a version is chosen (the newest there wins, not the first
    read; ID versions start at the newest snapshot there); when nothing there loads, the newest
    valid copy the scorer stored serves (``VersionTracker.fall_back_to_stored``: the trainer's
    ``published/`` may be gone)."""
    consumer = updates_consumer(cfg.bootstrap, cfg.updates_topic, dict(cfg.kafka_config), wait_s=timeout_s)
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
                raise TimeoutError(f"no valid model version on {cfg.updates_topic!r} after {timeout_s:.0f} s "
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
        ids_before = self.tracker.ids_status()
        changed = self.tracker.offer(read_updates(self.consumer))
        current = self.tracker.current
        ids = self.tracker.ids_status()
        if changed or self.tracker.rejected_count != before or ids != ids_before:
            write_status(self.cfg.status_path, self, kind="versions", status={
                "version": current.version if current else None, "run_id": current.run_id if current else None,
                "path": current.path if current else None, "rejected_count": self.tracker.rejected_count,
                "rejected_kinds": dict(self.tracker.rejected_kinds), "rejected": self.tracker.rejected[-20:],
                **({"ids": ids} if ids is not None else {})})
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
        n = self.cfg.swap_interval
        first = first_tick(time.time() if self.start is None else self.start, n)
        return (pbegin
                | "Tick" >> PeriodicImpulse(start_timestamp=Timestamp.of(first), fire_interval=n)
                | "TickWindows" >> beam.WindowInto(window.FixedWindows(n, offset=WINDOW_OFFSET_S))
                | "NewestValid" >> beam.ParDo(_LatestVersionFn(self.cfg)))

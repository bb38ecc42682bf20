"""Drift monitoring in the scorer: each scored micro-batch counted into the reference's buckets, a sliding
window per scorer instance, measures, alarms and ADWIN on the prequential error.

``WritePredictions`` gives each written micro-batch to a ``DriftReporter`` (its features, labels and scores are
already Arrow / numpy). On the scoring thread that is all the work there is: ``DriftMonitor.add`` counts the
micro-batch in one vectorised pass (``pipelines.drift.profile.Counter.count_flat``: one int64 vector of every
feature's buckets), adds it to the window's running total and subtracts the micro-batches that left the window
(it holds the newest micro-batches with at least ``window`` events and, with ``window_s``, none older than that
many seconds). The reporter's own thread publishes the window at most once every ``flush_s`` seconds, and at
the latest ``flush_s`` after the newest micro-batch (so an idle stream's last window is published too; ``close``
publishes it at once): the window's counts go into the instance's status file (kind ``drift``), so that
``/metrics`` and the status page add the instances' windows and compare the sum (``window_report``); with a
``topic``, the instance compares its own window with the reference and sends the measures and alarms as a
JSON record every ``every_s`` seconds and whenever the alarms changed (so the newest record holds the
window's alarms, never more than ``flush_s`` late).

Without a score distribution in the reference (a profile built from the dataset alone), the scores of the
first full window become the prediction reference (``prediction_reference`` in the status file).
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from connectors.kafka import KafkaDelivery
from pipelines.drift.compare import compare
from pipelines.drift.measures import DEFAULT_THRESHOLDS, Adwin
from pipelines.drift.profile import Counter, counts_to_json, merge, reference_scores
from pipelines.stream.status import write_status

log = logging.getLogger(__name__)


@dataclass
class DriftConfig:
    profile: dict  # pipelines.drift.profile's reference profile
    window: int = 2000  # events per window (at least; whole micro-batches)
    window_s: float = 0.0  # > 0: the window holds only the micro-batches of the last window_s seconds too
    thresholds: dict = field(default_factory=lambda: dict(DEFAULT_THRESHOLDS))
    every_s: float = 2.0  # a drift record every every_s seconds while events come (and whenever the alarms change)
    flush_s: float = 1.0  # the status file written and the alarms checked at most this often, at most this late


#: Beside the scorer's status files: the reference its drift windows are compared with (for /metrics).
DRIFT_REFERENCE = "score-drift-reference.json"


def drift_record(report: dict, *, window: int, instance: str) -> dict:
    """The JSON record of one comparison (``--drift-topic``): every feature's measures and alarms."""
    return {"time": time.time(), "instance": instance, "window": window, "rows": report["rows"],
            "alarms": report["alarms"], "prediction_drift": report["prediction_drift"], "quality": report["quality"],
            "features": [{k: e[k] for k in ("feature", "kind", "measures", "alarms")} for e in report["features"]]}


class DriftMonitor:
    """The sliding window of one scorer instance (``add`` per micro-batch; ``status`` / ``report`` for reports).

    ``batches`` holds each micro-batch of the window as (rows, counts, lo, hi, when added), ``counts`` being
    ``Counter.count_flat``'s int64 vector; ``total`` is their running sum (a micro-batch is added when it comes
    and subtracted when it leaves the window), so the window's counts never need a merge of its micro-batches."""

    def __init__(self, cfg: DriftConfig, *, classification: bool):
        self.cfg = cfg
        self.profile = cfg.profile
        self.classification = classification
        self.adwin = Adwin(delta=cfg.thresholds.get("adwin", DEFAULT_THRESHOLDS["adwin"]))
        self.adwin_alarm_until = 0  # the alarm stays up for a window after a change
        self.seen = 0
        self.pending_scores: list[np.ndarray] | None = None if "prediction" in cfg.profile else []
        self.prediction_reference: dict | None = None
        self.last = 0.0
        self.last_alarms: list[str] | None = None  # the alarms of the newest drift record sent
        self._start(Counter(cfg.profile))

    def _start(self, counter: Counter) -> None:
        """An empty window counted with ``counter``."""
        self.counter = counter
        self.batches: deque = deque()
        self.rows = 0
        self.total = counter.empty_flat()[0]

    def add(self, features: pa.RecordBatch, label: np.ndarray | None, scores: np.ndarray | None,
            wrong: np.ndarray | None = None) -> None:
        """One micro-batch: its featurized rows, label targets (NaN: none), model scores and, for labelled
        rows, the prequential error (1: wrong; values in [0, 1])."""
        if self.pending_scores is not None and scores is not None:  # the first window's scores: the reference
            self.pending_scores.append(np.asarray(scores))
            if sum(len(s) for s in self.pending_scores) >= self.cfg.window:
                self.prediction_reference = reference_scores(np.concatenate(self.pending_scores))
                self.profile = {**self.profile, "prediction": self.prediction_reference}
                self.pending_scores = None
                self._start(Counter(self.profile))
                return
        ints, lo, hi = self.counter.count_flat(features, label, scores if self.pending_scores is None else None)
        rows = int(ints[0])
        now = time.monotonic()
        self.batches.append((rows, ints, lo, hi, now))
        self.total += ints
        self.rows += rows
        while self.batches and (self.rows - self.batches[0][0] >= self.cfg.window or
                                (self.cfg.window_s > 0 and now - self.batches[0][4] > self.cfg.window_s)):
            old = self.batches.popleft()
            self.rows -= old[0]
            self.total -= old[1]
        self.seen += rows
        if wrong is not None and len(wrong):
            if self.adwin.update(wrong):
                self.adwin_alarm_until = self.seen + self.cfg.window

    def due(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        if now - self.last >= self.cfg.every_s:
            self.last = now
            return True
        return False

    def counts(self) -> dict:
        """The window's ``Counts``: the running total, with each numeric feature's smallest and largest value."""
        k = len(self.counter.numeric)
        lo = np.fmin.reduce([b[2] for b in self.batches], axis=0, initial=np.inf) if self.batches else \
            np.full(k, np.inf)
        hi = np.fmax.reduce([b[3] for b in self.batches], axis=0, initial=-np.inf) if self.batches else \
            np.full(k, -np.inf)
        return self.counter.counts(self.total, lo, hi)

    def adwin_state(self) -> dict:
        return {"changes": self.adwin.changes, "detected": self.seen < self.adwin_alarm_until,
                "width": self.adwin.width, "mean": self.adwin.mean}

    def status(self) -> dict:
        """What the instance's status file holds: the window's counts, ADWIN's state, a prediction reference
        made here."""
        adwin = self.adwin_state() if self.adwin.width or self.adwin.changes else None
        return {"window": self.cfg.window, "counts": counts_to_json(self.counts()), "adwin": adwin,
                "prediction_reference": self.prediction_reference}

    def report(self) -> dict:
        """This instance's window compared with the reference (``pipelines.drift.profile.compare``)."""
        adwin = self.adwin_state() if self.adwin.width or self.adwin.changes else None
        return compare(self.profile, self.counts(), self.cfg.thresholds, adwin=adwin)

    @staticmethod
    def encode(record: dict) -> bytes:
        return json.dumps(record, default=float).encode()


def kafka_sender(producer, topic: str) -> Callable[[bytes], None]:
    """Sends a drift record to ``topic`` and waits for its acknowledgement (its own ``KafkaDelivery`` on the
    scorer's producer: the reporter's thread sends while the scoring thread confirms its predictions)."""
    delivery = KafkaDelivery(producer, what="scorer drift records")

    def send(value: bytes) -> None:
        delivery.send(topic, value)
        delivery.confirm()
    return send


class DriftReporter:
    """A scorer instance's ``DriftMonitor`` and what it publishes (see the module): ``add`` on the scoring thread
    counts a micro-batch; a thread of the reporter's own writes the status file (``status_path``, kind
    ``drift``) and, with ``send`` (``kafka_sender``), the drift records, at most once every ``cfg.flush_s`` and
    at the latest that long after a micro-batch; ``close`` publishes the last window at once. A failure to
    publish (a full disk, a record Kafka did not take) is raised by the next ``add`` or ``close``."""

    def __init__(self, cfg: DriftConfig, *, classification: bool, status_path: str | None,
                 send: Callable[[bytes], None] | None = None):
        self.monitor = DriftMonitor(cfg, classification=classification)
        self.cfg, self.status_path, self.send = cfg, status_path, send
        self.instance = f"{os.getpid()}-{id(self)}"
        self.writes = 0  # windows published (status file written, alarms checked)
        self._cond = threading.Condition()
        self._changed = self._closing = False
        self._last = -float("inf")  # when the newest window was published (time.monotonic)
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._publishing = threading.Lock()  # one writer of the status file and the records at a time

    def add(self, features: pa.RecordBatch, label: np.ndarray | None, scores: np.ndarray | None,
            wrong: np.ndarray | None = None) -> None:
        self._raise()
        with self._cond:
            self.monitor.add(features, label, scores, wrong)
            if not self._changed:  # the thread waits for a change (when it waits for the clock, no need)
                self._changed = True
                self._cond.notify()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="flowtrain-drift-reporter", daemon=True)
            self._thread.start()

    def close(self, timeout_s: float = 60.0) -> None:
        """Publish the newest window now (when it changed since the last) and stop the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        with self._cond:
            window = self._take() if self._changed else None
        if window is not None:
            self._publish(*window)
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._changed and not self._closing:
                    self._cond.wait()
                if self._closing:
                    return
                wait = self._last + self.cfg.flush_s - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                window = self._take()
            try:
                self._publish(*window)
            except Exception as err:  # noqa: BLE001 - raised on the scoring thread by the next add
                log.warning("drift: publishing the window failed: %s", err)
                with self._cond:
                    self.monitor.last_alarms = None  # the next window's record goes out whatever its alarms
                self._error = err

    def _take(self) -> tuple[dict, dict | None]:
        """The window to publish (under the lock): the status, and the report when a drift record is due."""
        self._changed = False
        self._last = time.monotonic()
        m = self.monitor
        report = None
        if self.send is not None:  # a drift topic (ScoreConfig.topics.drift)
            report = m.report()
            if m.due() or report["alarms"] != m.last_alarms:
                m.last_alarms = report["alarms"]
            else:
                report = None
        return m.status(), report

    def _publish(self, status: dict, report: dict | None) -> None:
        with self._publishing:
            write_status(self.status_path, self, status, kind="drift")
            if report is not None:
                self.send(self.monitor.encode(drift_record(report, window=self.cfg.window, instance=self.instance)))
            self.writes += 1


#: The entries of a window report the status page draws (the rest of ``compare``'s output is in the JSON too).
_SHOWN = ("feature", "kind", "rows", "measures", "alarms", "alarm", "score", "buckets", "reference", "current")


def window_report(status_prefix: str, reference_path: str) -> dict | None:
    """The scorer's drift as ``/metrics`` and the status page show it: the windows of every scorer instance
    (their status files of kind ``drift``) added and compared with the reference ``run_score`` wrote beside
    them. None before the first window (or with drift monitoring off)."""
    from pipelines.drift.profile import counts_from_json
    from pipelines.stream.status import read_status

    windows = read_status(status_prefix, "drift")
    if not windows:
        return None
    try:
        with open(reference_path) as fh:
            ref = json.load(fh)
    except (OSError, ValueError):
        return None
    profile = ref["profile"]
    if "prediction" not in profile:  # made by the scorer from its first window: one instance's reference
        made = [w["prediction_reference"] for w in windows if w.get("prediction_reference")]
        if made:
            profile = {**profile, "prediction": made[0]}
    total = None
    for w in windows:
        counts = counts_from_json(w["counts"])
        if "prediction" in profile and "prediction" in counts and \
                len(counts["prediction"]["bins"]) != len(profile["prediction"]["counts"]):
            counts.pop("prediction")  # another instance's own score buckets: not comparable
        if total is not None and ("prediction" in total) != ("prediction" in counts):
            total.pop("prediction", None)
            counts.pop("prediction", None)
        total = counts if total is None else merge(total, counts)
    adwins = [w["adwin"] for w in windows if w.get("adwin")]
    adwin = None
    if adwins:
        width = sum(a["width"] for a in adwins)
        adwin = {"changes": sum(a["changes"] for a in adwins), "detected": any(a["detected"] for a in adwins),
                 "width": width, "mean": sum(a["mean"] * a["width"] for a in adwins) / width if width else 0.0}
    report = compare(profile, total, ref.get("thresholds"), adwin=adwin)
    return {"rows": report["rows"], "window": ref.get("window"), "instances": len(windows),
            "alarms": report["alarms"], "prediction_drift": report["prediction_drift"],
            "quality": report["quality"], "thresholds": report["thresholds"],
            "features": [{k: e.get(k) for k in _SHOWN} for e in report["features"]]}

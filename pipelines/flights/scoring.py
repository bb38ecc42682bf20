"""Score the live flights stream with Beam ``RunInference``, hot-swapping published model versions.

    ReadFromKafka(raw events, from the scorer group's committed offsets)
      -> FeaturizeForScoring (fused with the read, per partition): micro-batches closed by size,
         by time or at the end of the reader's bundle (``MicroBatcher``); parsed, validated and
         featurized by the feature pipeline's own steps (``parse_batch``, ``FlightFeaturizer``:
         the batch dataset's statistics and vocabularies); bad events to the dead-letter topic
         (``dead_letter_record``, the one wire format), confirmed before the micro-batch moves on
      -> Reshuffle                                            (a stage of its own, see below)
      -> WindowInto(FixedWindows(swap_interval))              (the serving windows)
      -> RunInference(FlowtrainModelHandler, model_metadata_pcoll=versions)
           versions = PeriodicImpulse(swap_interval) -> WindowInto(the same FixedWindows)
                      -> LatestModelVersion (the newest *valid* version on the model-updates topic)
      -> WritePredictions: one Arrow record batch per micro-batch on the predictions topic
         (``PREDICTION_SCHEMA``), acknowledged (acks=all)
      -> CommitScored (keyed by raw partition, Beam state): commits the raw offsets up to which
         every event has its prediction or dead letter acknowledged.

Hot swap is Beam's own model-update mechanism: a ``ModelMetadata`` side input of
``RunInference``; ``_RunInferenceDoFn`` calls ``update_model_path`` + ``load_model`` when the
side input names a new model. Beam's documented sources for it (``WatchFilePattern``, or a topic
in the global window with a repeated trigger) are unbounded *global-window triggered* side
inputs, which Prism refuses at submission (``jobservices/management.go``: "Unbounded GlobalWindow
Triggered SideInput, are not currently supported by Prism", apache/beam#31438: Prism makes a side
input ready only at the end of its window, and a global window never ends). So the versions come
as Beam's "slowly updating side input" instead: a ``PeriodicImpulse`` tick per window looks up the
newest valid version on the updates topic, and the main input is windowed in the same fixed
windows. Prism runs a stage that reads a side input only once the side input's output watermark
has reached the stage's input watermark (``engine/elementmanager.go``, ``bundleReady``), so an
event waits at most about one window for its model. That rule is also why the ``Reshuffle`` is
there: Prism fuses the Kafka read with its consumers, and the read's input (after its partition
impulse) is at the end of time, so a side-input consumer fused with the read never runs (measured:
no output at all); after the reshuffle the scoring stage's input watermark is the read's output.

Two of ``_RunInferenceDoFn``'s behaviours shape ``FlowtrainModelHandler``: a window whose side
input is empty (events older than the first tick) reloads the model "without a path", i.e. the
handler's current one; and a loading error would fail the bundle (on Prism, the job). So the
handler keeps, per process, the newest version it has loaded and never serves an older one, and
a version it cannot load is rejected with a logged reason while the previous one keeps serving.
``LatestModelVersion`` validates every candidate (checksum, load, shapes) before it reaches the
side input, so a corrupt version normally never gets that far. Every prediction carries the
version of the model that actually computed it.

Delivery: raw offsets are committed only after the predictions and dead letters of every event
below them were acknowledged (``CommitScored`` commits the contiguous prefix of scored offset
ranges per partition), so a crash re-reads, never skips: **at least once**. After a restart from
committed offsets an event may be scored twice, only if its offset is at or after the offset
committed when the scorer stopped; each prediction carries its source, which identifies such a
duplicate.

This module needs no flowtrain import (imports flow flowtrain -> pipelines): the caller passes
``load_version``, a picklable callable ``path -> (torch module in eval mode, version)``.
"""
from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import apache_beam as beam
import numpy as np
import pyarrow as pa
from apache_beam.ml.inference.base import ModelHandler, ModelMetadata, PredictionResult, RunInference
from apache_beam.transforms import window
from apache_beam.transforms.periodicsequence import PeriodicImpulse
from apache_beam.transforms.userstate import ReadModifyWriteStateSpec
from apache_beam.utils.timestamp import Timestamp
from apache_beam.utils.windowed_value import WindowedValue

from connectors.arrow import encode_batches
from connectors.dataset_spec import CAT_PREFIX, LABEL, NUM_PREFIX, FeatureSpec
from connectors.deadletter import DeadLetter, dead_letter_record
from connectors.kafka import (PRODUCER_DEFAULTS, KafkaDelivery, KafkaRecord, ReadFromKafka, close_client,
                              new_consumer, new_producer, retry_kafka, topic_max_message_bytes, value_budget)
from pipelines.flights.events import DEFAULT_BOUNDS, ParseBounds, parse_batch
from pipelines.flights.status import write_status
from pipelines.flights.streaming import KAFKA_DEFAULT_MAX_MESSAGE_BYTES, FlightFeaturizer, MicroBatcher

__all__ = ["ScoreConfig", "ScoringBatch", "ServedModel", "ModelVersion", "VersionTracker", "FlowtrainModelHandler",
           "FeaturizeForScoring", "LatestModelVersion", "WritePredictions", "CommitScored", "ScoredRanges",
           "build_scoring_pipeline", "PREDICTION_SCHEMA", "featurize_records", "predictions_batch", "read_updates",
           "wait_for_version"]

_log = logging.getLogger(__name__)

#: One Arrow record batch per message on the predictions topic (keyed by raw partition).
PREDICTION_SCHEMA = pa.schema([
    ("source", pa.string()),  # "raw topic/partition/offset"
    ("src_partition", pa.int64()),
    ("src_offset", pa.int64()),
    ("prediction", pa.float32()),  # P(arr_delay > 15) for classification, the value for regression
    ("model_version", pa.int64()),
    ("event_time", pa.timestamp("ms", tz="UTC")),  # the raw record's Kafka timestamp
    ("scoring_time", pa.timestamp("ms", tz="UTC")),  # when the model computed it
    ("label", pa.float32()),  # the event's outcome (0/1 or value), for online accuracy
])

#: Serving windows start this far after each whole multiple of the interval: Kafka timestamps are
#: whole milliseconds, so no event lands exactly on a tick (a tick at T is not in the side input
#: before the side input's watermark has passed T).
_WINDOW_OFFSET_S = 0.0005


@dataclass
class ScoreConfig:
    bootstrap: str
    load_version: Callable[[str], tuple[Any, int]]  # checkpoint path -> (eval module, version)
    spec: FeatureSpec
    stats: dict = field(default_factory=dict)  # the batch dataset manifest's "stats"
    weather_path: str = ""
    planes_path: str = ""
    initial_model: str = ""  # checkpoint of the version to serve before the first tick
    raw_topic: str = "flights-raw"
    predictions_topic: str = "flights-predictions"
    dead_letter_topic: str = "flights-scoring-dead-letters"
    updates_topic: str = "flights-model-updates"
    group_id: str = "flowtrain-scorer"
    batch_size: int = 500
    max_delay_s: float = 0.25  # a micro-batch closes this long after its first event (or at batch_size)
    max_read_s: float = 0.5  # the reader hands its output on at least this often
    swap_interval_s: float = 1.0  # serving window: how often the newest version is looked up
    max_inference_batches: int = 16  # micro-batches RunInference stacks into one forward
    device: str = "cpu"
    # torch threads of the scorer's process: it shares the cores with the read, the featurizing and
    # the Kafka clients; with 2 threads on 2 busy cores a forward ran 27x slower than with 1 (measured)
    torch_threads: int = 1
    target_scale: tuple[float, float] = (0.0, 1.0)  # regression: (shift, scale) of the standardized target
    kafka_config: dict[str, Any] = field(default_factory=dict)
    status_path: str | None = None  # prefix of per-instance JSON counters (`flowtrain stream --score`)
    bounds: ParseBounds = DEFAULT_BOUNDS  # limits on one raw event, as in the feature pipeline


class ScoringBatch(NamedTuple):
    """One micro-batch of one raw partition: its features and the offsets it covers."""

    topic: str
    partition: int
    first_offset: int
    last_offset: int  # every offset in [first, last] read from the partition is in this batch
    features: pa.RecordBatch | None  # featurized valid events (+ src_partition, src_offset); None if none
    event_ms: np.ndarray  # Kafka timestamp of each feature row
    dead_letters: int  # events of the range rejected (already on the dead-letter topic)
    featurized_ms: int = 0  # when the micro-batch closed (for the latency breakdown in the status)


@dataclass(frozen=True, eq=False)
class ServedModel:
    """A loaded version (a plain class: Beam's ``shared.Shared`` holds it by weak reference)."""

    module: Any  # torch.nn.Module in eval mode
    version: int
    path: str


class ModelVersion(NamedTuple):
    version: int
    path: str
    published_at: str  # "topic/partition/offset" of its record on the updates topic


# ---------------------------------------------------------------------------------------------
# Model versions: the updates topic -> the newest valid version
# ---------------------------------------------------------------------------------------------
class VersionTracker:
    """The newest valid published version; a version it cannot load is rejected, logged, remembered.

    A record on the updates topic is the trainer's JSON: ``{"version": N, "checkpoint": PATH, ...}``.
    Candidates newer than the current version are tried newest first; the first one that loads
    becomes current, newer ones that fail are rejected with their reason, older ones are skipped
    (superseded). A rejected version is never tried again.
    """

    def __init__(self, load_version: Callable[[str], tuple[Any, int]]):
        self._load = load_version
        self.current: ModelVersion | None = None
        self.rejected: list[dict] = []
        self._rejected_keys: set[str] = set()

    def offer(self, records: Iterable[tuple[str, bytes | None]]) -> bool:
        """``(where, value)`` records in publication order; True if the current version changed.
        Each rejection is logged (a warning with its reason and the version that serves instead)."""
        candidates, rejects = [], []
        for where, value in records:
            try:
                record = json.loads(value)
                version, path = int(record["version"]), str(record["checkpoint"])
            except (TypeError, ValueError, KeyError) as err:
                rejects.append((where, None, f"not a model-update record ({type(err).__name__}: {err}); "
                                             f"expected JSON with 'version' and 'checkpoint'"))
                continue
            if self.current is None or version > self.current.version:
                candidates.append(ModelVersion(version, path, where))
            elif path != self.current.path:
                rejects.append((where, version, f"not newer than the serving version {self.current.version}; "
                                                f"versions only move forward (a new trainer run should publish "
                                                f"to its own updates topic)"))
        changed = False
        for cand in sorted(candidates, key=lambda c: c.version, reverse=True):
            if self.current is not None and cand.version <= self.current.version:
                break
            if cand.published_at in self._rejected_keys:
                continue
            try:
                _, loaded = self._load(cand.path)
            except Exception as err:  # noqa: BLE001 - any failure to load rejects the version
                rejects.append((cand.published_at, cand.version, f"{type(err).__name__}: {err}"))
                self._rejected_keys.add(cand.published_at)
                continue
            if int(loaded) != cand.version:
                rejects.append((cand.published_at, cand.version,
                                f"the record says version {cand.version}, its checkpoint holds version {loaded}"))
                self._rejected_keys.add(cand.published_at)
                continue
            self.current, changed = cand, True
            break
        for where, version, reason in rejects:
            serving = f"; serving version {self.current.version}" if self.current else "; no version to serve yet"
            _log.warning("model version %s published at %s rejected: %s%s",
                         version if version is not None else "?", where, reason, serving)
            self.rejected.append({"version": version, "published_at": where, "reason": reason})
        return changed


def read_updates(consumer, *, rounds: int = 20, poll_ms: int = 50) -> list[tuple[str, bytes | None]]:
    """Records the consumer has not returned yet, in partition-offset order.

    Each poll is retried on its own (``retry_kafka``): retrying the whole read would drop the
    records already polled, since the consumer's position has moved past them."""
    out = []
    for _ in range(rounds):
        polled = retry_kafka(lambda: consumer.poll(timeout_ms=poll_ms), "reading model updates")
        if not polled:
            break
        for tp, records in sorted(polled.items(), key=lambda kv: kv[0].partition):
            out += [(f"{tp.topic}/{tp.partition}/{r.offset}", r.value) for r in records]
    return out


def _updates_consumer(bootstrap: str, topic: str, kafka_config: dict, *, wait_s: float = 30.0):
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


def wait_for_version(bootstrap: str, topic: str, load_version, *, timeout_s: float,
                     kafka_config: dict | None = None) -> tuple[ModelVersion, VersionTracker]:
    """The newest valid version on the updates topic, waiting up to ``timeout_s`` for one."""
    consumer = _updates_consumer(bootstrap, topic, dict(kafka_config or {}), wait_s=timeout_s)
    tracker = VersionTracker(load_version)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            tracker.offer(read_updates(consumer, poll_ms=200))
            if tracker.current is not None:
                return tracker.current, tracker
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no valid model version on {topic!r} after {timeout_s:.0f} s "
                                   f"({len(tracker.rejected)} rejected); start the online trainer "
                                   f"(flowtrain stream train) or wait longer (--wait-model)")
            time.sleep(0.5)
    finally:
        close_client(consumer)


class _LatestVersionFn(beam.DoFn):
    """Tick -> ``ModelMetadata`` of the newest valid version (one per serving window)."""

    def __init__(self, cfg: ScoreConfig):
        self.cfg = cfg

    def setup(self):
        self.consumer = _updates_consumer(self.cfg.bootstrap, self.cfg.updates_topic, self.cfg.kafka_config)
        self.tracker = VersionTracker(self.cfg.load_version)

    def teardown(self):
        if getattr(self, "consumer", None) is not None:
            close_client(self.consumer)
            self.consumer = None

    def process(self, _tick):
        before = len(self.tracker.rejected)
        changed = self.tracker.offer(read_updates(self.consumer))
        current = self.tracker.current
        if changed or len(self.tracker.rejected) != before:
            write_status(self.cfg.status_path, self, kind="versions", status={
                "version": current.version if current else None, "path": current.path if current else None,
                "rejected_count": len(self.tracker.rejected), "rejected": self.tracker.rejected[-20:]})
        if changed:
            _log.info("model version %d (%s) is the newest valid one", current.version, current.path)
        if current is not None:
            yield ModelMetadata(model_id=current.path, model_name=f"v{current.version}")


class LatestModelVersion(beam.PTransform):
    """Beam's slowly-updating side input: the newest valid version on the updates topic per window."""

    def __init__(self, cfg: ScoreConfig, *, start: float | None = None):
        super().__init__()
        self.cfg = cfg
        self.start = start

    def expand(self, pbegin):
        n = self.cfg.swap_interval_s
        now = time.time() if self.start is None else self.start
        first = (now // n) * n + _WINDOW_OFFSET_S  # one tick in each serving window
        return (pbegin
                | "Tick" >> PeriodicImpulse(start_timestamp=Timestamp.of(first), fire_interval=n)
                | "TickWindows" >> beam.WindowInto(window.FixedWindows(n, offset=_WINDOW_OFFSET_S))
                | "NewestValid" >> beam.ParDo(_LatestVersionFn(self.cfg)))


# ---------------------------------------------------------------------------------------------
# The model handler
# ---------------------------------------------------------------------------------------------
# Per process and handler: the versions loaded (path -> ServedModel) and the newest of them.
# _RunInferenceDoFn instances are per bundle processor; they share a process, so they share this.
_SERVED: dict[str, dict[str, ServedModel]] = {}
_NEWEST: dict[str, ServedModel] = {}
_SERVED_LOCK = threading.Lock()


class FlowtrainModelHandler(ModelHandler[ScoringBatch, PredictionResult, ServedModel]):
    """A PyTorch model handler for flowtrain's tabular model over Arrow micro-batches.

    An example is a ``ScoringBatch``; RunInference stacks up to ``max_batch_size`` of them and
    ``run_inference`` runs one forward over all their rows (numerics and category codes taken a
    column at a time from Arrow, no per-row Python). The result per example is the array of
    predictions (probabilities for classification) and ``model_id`` is the serving version.

    Model updates: ``update_model_path`` takes the checkpoint named by the side input,
    ``load_model`` loads it with ``load_version``. Per process it never serves an older version
    than the newest it has loaded, and a version it cannot load is rejected (logged) while the
    newest loaded one keeps serving.
    """

    def __init__(self, load_version: Callable[[str], tuple[Any, int]], initial_model: str, spec: FeatureSpec, *,
                 device: str = "cpu", max_batch_size: int = 16, target_scale: tuple[float, float] = (0.0, 1.0),
                 torch_threads: int | None = 1):
        super().__init__(min_batch_size=1, max_batch_size=max_batch_size)
        self._load_version = load_version
        self._path = initial_model
        self._spec = spec
        self._device = device
        self._shift, self._scale = target_scale  # regression: the model predicts the standardized target
        self._threads = torch_threads
        self._num = [NUM_PREFIX + c for c in spec.all_numeric]
        self._cat = [CAT_PREFIX + c for c in spec.categorical]
        self._token = uuid.uuid4().hex  # shared by the handler's copies in every DoFn instance

    def update_model_path(self, model_path: str | None = None):
        if model_path:
            self._path = model_path

    def load_model(self) -> ServedModel:
        if self._threads:
            import torch

            torch.set_num_threads(self._threads)
        with _SERVED_LOCK:
            loaded = _SERVED.setdefault(self._token, {})
            newest = _NEWEST.get(self._token)
            served = loaded.get(self._path)
            if served is None:
                try:
                    module, version = self._load_version(self._path)
                    module.to(self._device)
                except Exception as err:  # noqa: BLE001 - a bad version must not stop serving
                    if newest is None:
                        raise RuntimeError(f"cannot load the initial model {self._path}: {err}") from err
                    _log.warning("model at %s rejected (%s: %s); still serving version %d", self._path,
                                 type(err).__name__, err, newest.version)
                    return newest
                served = loaded[self._path] = ServedModel(module, int(version), self._path)
                _log.info("loaded model version %d from %s", served.version, self._path)
            if newest is not None and newest.version > served.version:
                return newest  # never roll back to an older version
            _NEWEST[self._token] = served
            for path in [p for p, s in loaded.items() if s.version < served.version]:
                del loaded[path]  # older versions are never served again
            loaded[self._path] = served
            return served

    def run_inference(self, batch: Sequence[ScoringBatch], model: ServedModel,
                      inference_args: dict | None = None) -> Iterable[PredictionResult]:
        import torch

        parts = [b.features for b in batch if b.features is not None and b.features.num_rows]
        sizes = [0 if b.features is None else b.features.num_rows for b in batch]
        scores = np.zeros(0, dtype=np.float32)
        if parts:
            table = pa.Table.from_batches(parts)
            x_num = _stack(table, self._num, np.float32)
            x_cat = _stack(table, self._cat, np.int64)
            with torch.inference_mode():
                out = model.module(torch.from_numpy(x_num).to(self._device), torch.from_numpy(x_cat).to(self._device))
                if out.dim() != 1:
                    raise ValueError(f"model version {model.version} gives {tuple(out.shape)} outputs per batch; the "
                                     f"scorer serves one output per row (binary classification or regression)")
                out = torch.sigmoid(out) if self._spec.task == "classification" else out * self._scale + self._shift
                scores = out.float().cpu().numpy()
        scored_ms = int(time.time() * 1000)
        version = str(model.version)
        bounds = np.cumsum([0] + sizes)
        for b, lo, hi in zip(batch, bounds[:-1], bounds[1:]):
            yield PredictionResult(b, (scores[lo:hi], scored_ms), version)

    def get_num_bytes(self, batch: Sequence[ScoringBatch]) -> int:
        return sum(b.features.nbytes for b in batch if b.features is not None)

    def get_metrics_namespace(self) -> str:
        return "flowtrain_scoring"


def _stack(table: pa.Table, names: list[str], dtype) -> np.ndarray:
    if not names:
        return np.zeros((table.num_rows, 0), dtype=dtype)
    return np.ascontiguousarray(np.stack([table.column(c).to_numpy() for c in names], axis=1).astype(dtype))


# ---------------------------------------------------------------------------------------------
# Raw events -> micro-batches of features (+ dead letters on Kafka)
# ---------------------------------------------------------------------------------------------
def _limits(cfg: ScoreConfig, topics: Sequence[str]) -> dict[str, int]:
    """Each topic's max.message.bytes as the broker applies it, capped by the producer's request size."""
    max_request = int(cfg.kafka_config.get("max_request_size", PRODUCER_DEFAULTS["max_request_size"]))
    return {t: min(topic_max_message_bytes(cfg.bootstrap, t, client_config=cfg.kafka_config)
                   or KAFKA_DEFAULT_MAX_MESSAGE_BYTES, max_request) for t in topics}


class _FeaturizeForScoringFn(beam.DoFn):
    """Fused with the reader: a partition's events in a bundle become micro-batches
    (``MicroBatcher``: closed at ``batch_size`` events, ``max_delay_s`` after the first one, or at
    the end of the bundle), parsed and featurized by the feature pipeline's own steps
    (``parse_batch``, ``FlightFeaturizer``); dead letters are produced and confirmed before the
    micro-batch goes on to the model."""

    def __init__(self, cfg: ScoreConfig):
        self.cfg = cfg

    def setup(self):
        cfg = self.cfg
        self.featurizer = FlightFeaturizer.load(cfg.stats, cfg.weather_path, cfg.planes_path)
        self.limits = _limits(cfg, [cfg.dead_letter_topic])
        self.producer = new_producer(cfg.bootstrap, cfg.kafka_config, max_message_bytes=min(self.limits.values()))
        self.delivery = KafkaDelivery(self.producer, what="scorer", max_message_bytes=self.limits)
        self.totals = {"events": 0, "dead_letters": 0}

    def teardown(self):
        if getattr(self, "producer", None) is not None:
            close_client(self.producer)
            self.producer = None

    def start_bundle(self):
        self.batcher = MicroBatcher(self.cfg.batch_size, self.cfg.max_delay_s)

    def process(self, record: KafkaRecord):
        closed = self.batcher.add((record.topic, record.partition), record)
        if closed:
            yield self._flush(closed)

    def finish_bundle(self):
        for _, items in self.batcher.drain():
            yield self._flush(items)

    def _flush(self, items: list[KafkaRecord]) -> WindowedValue:
        """One partition's micro-batch as a ScoringBatch, stamped with its newest Kafka time."""
        batch, letters = featurize_records(items, self.featurizer, self.cfg.bounds)
        for letter in letters:
            key, value, headers = dead_letter_record(letter, max_bytes=self.limits[self.cfg.dead_letter_topic])
            self.delivery.send(self.cfg.dead_letter_topic, value, key=key, headers=headers)
        self.delivery.confirm()  # acknowledged before the offsets can be committed downstream
        self.totals["events"] += len(items)
        self.totals["dead_letters"] += len(letters)
        write_status(self.cfg.status_path, self, self.totals, kind="featurize")
        newest = Timestamp(micros=max(r.timestamp for r in items) * 1000)
        return WindowedValue(batch._replace(featurized_ms=int(time.time() * 1000)), newest, [window.GlobalWindow()])


def featurize_records(items: list[KafkaRecord], featurizer: FlightFeaturizer,
                      bounds: ParseBounds = DEFAULT_BOUNDS) -> tuple[ScoringBatch, list[DeadLetter]]:
    """Raw records of one partition (in offset order) -> a ``ScoringBatch`` and its dead letters,
    with the feature pipeline's own steps: ``parse_batch`` then ``FlightFeaturizer.featurize_table``."""
    table, letters = parse_batch([r.value for r in items], [(r.topic, r.partition, r.offset) for r in items], bounds)
    features, bad = featurizer.featurize_table(table)
    letters = letters + bad
    event_ms = np.zeros(0, dtype=np.int64)
    if features is not None and features.num_rows:
        offsets = np.array([r.offset for r in items], dtype=np.int64)
        stamps = np.array([r.timestamp for r in items], dtype=np.int64)
        event_ms = stamps[np.searchsorted(offsets, features.column("src_offset").to_numpy())]
    else:
        features = None
    first, last = items[0], items[-1]
    return ScoringBatch(first.topic, first.partition, first.offset, last.offset, features, event_ms,
                        len(letters)), letters


class FeaturizeForScoring(beam.PTransform):
    """Raw ``KafkaRecord``s -> ``ScoringBatch``es (dead letters go to the dead-letter topic)."""

    def __init__(self, cfg: ScoreConfig):
        super().__init__()
        self.cfg = cfg

    def expand(self, records):
        return records | "MicroBatchFeaturize" >> beam.ParDo(_FeaturizeForScoringFn(self.cfg))


# ---------------------------------------------------------------------------------------------
# Predictions -> Kafka, then the raw offsets they cover -> committed
# ---------------------------------------------------------------------------------------------
def predictions_batch(result: PredictionResult) -> pa.RecordBatch:
    """One ``PREDICTION_SCHEMA`` record batch for a scored micro-batch."""
    batch: ScoringBatch = result.example
    scores, scored_ms = result.inference
    n = len(scores)
    f = batch.features
    if n == 0:
        return pa.RecordBatch.from_pylist([], schema=PREDICTION_SCHEMA)
    return pa.RecordBatch.from_arrays([
        f.column("source").cast(pa.string()),
        f.column("src_partition").cast(pa.int64()),
        f.column("src_offset").cast(pa.int64()),
        pa.array(np.asarray(scores, dtype=np.float32)),
        pa.array(np.full(n, int(result.model_id), dtype=np.int64)),
        pa.array(batch.event_ms.astype(np.int64), type=pa.int64()).cast(pa.timestamp("ms", tz="UTC")),
        pa.array(np.full(n, scored_ms, dtype=np.int64)).cast(pa.timestamp("ms", tz="UTC")),
        f.column(LABEL).cast(pa.float32()),
    ], schema=PREDICTION_SCHEMA)


class _WritePredictionsFn(beam.DoFn):
    """Each scored micro-batch -> one Arrow message, acknowledged; then its offset range goes on."""

    def __init__(self, cfg: ScoreConfig):
        self.cfg = cfg

    def setup(self):
        cfg = self.cfg
        self.limits = _limits(cfg, [cfg.predictions_topic])
        self.producer = new_producer(cfg.bootstrap, cfg.kafka_config, max_message_bytes=min(self.limits.values()))
        self.delivery = KafkaDelivery(self.producer, what="scorer", max_message_bytes=self.limits)
        self.totals = {"predictions": 0, "labelled": 0, "correct": 0, "version": None, "versions": {},
                       "latency_ms_sum": 0, "to_featurized_ms_sum": 0}

    def teardown(self):
        if getattr(self, "producer", None) is not None:
            close_client(self.producer)
            self.producer = None

    def process(self, result: PredictionResult):
        batch: ScoringBatch = result.example
        preds = predictions_batch(result)
        if preds.num_rows:
            key = str(batch.partition).encode()
            budget = value_budget(self.limits[self.cfg.predictions_topic], key)
            for message in encode_batches(preds, budget):
                self.delivery.send(self.cfg.predictions_topic, message, key=key)
            self.delivery.confirm()
            self._count(preds, int(result.model_id), batch.featurized_ms)
        yield (f"{batch.topic}/{batch.partition}", (batch.first_offset, batch.last_offset))

    def _count(self, preds: pa.RecordBatch, version: int, featurized_ms: int) -> None:
        t = self.totals
        t["predictions"] += preds.num_rows
        t["version"] = version
        t["versions"][str(version)] = t["versions"].get(str(version), 0) + preds.num_rows
        label = preds.column("label").to_numpy(zero_copy_only=False)
        known = ~np.isnan(label)
        if self.cfg.spec.task == "classification" and known.any():
            p = preds.column("prediction").to_numpy()[known]
            t["labelled"] += int(known.sum())
            t["correct"] += int(((p > 0.5) == (label[known] > 0.5)).sum())
        lat = (preds.column("scoring_time").cast(pa.int64()).to_numpy() -
               preds.column("event_time").cast(pa.int64()).to_numpy())
        t["latency_ms_sum"] += int(lat.sum())  # produce -> scored, and its part before the micro-batch closed
        t["to_featurized_ms_sum"] += int((featurized_ms - preds.column("event_time").cast(pa.int64()).to_numpy()).sum())
        write_status(self.cfg.status_path, self, t, kind="predictions")


class WritePredictions(beam.PTransform):
    """``PredictionResult``s -> the predictions topic; outputs ``(partition key, (first, last))``."""

    def __init__(self, cfg: ScoreConfig):
        super().__init__()
        self.cfg = cfg

    def expand(self, results):
        return results | "Produce" >> beam.ParDo(_WritePredictionsFn(self.cfg))


class ScoredRanges:
    """Per raw partition: the offset below which every event is scored, from ranges in any order.

    ``add(first, last, first_record_at)`` records the scored range ``[first, last]`` and moves
    ``next`` over every contiguous range. A gap before the lowest pending range is either a range
    still being scored or offsets that hold no record (compaction, transaction markers);
    ``first_record_at(offset)`` (the offset of the first record at or after ``offset``, None if
    unknown yet) tells them apart, asked once per position, so the commit never stalls on a hole.
    """

    def __init__(self, next_offset: int):
        self.next = next_offset
        self.pending: dict[int, int] = {}
        self._probed: tuple[int, int | None] | None = None

    def add(self, first: int, last: int, first_record_at: Callable[[int], int | None]) -> bool:
        """True if ``next`` moved."""
        if last >= self.next:
            self.pending[first] = max(last, self.pending.get(first, last))
        before = self.next
        while self.pending:
            lowest = min(self.pending)
            if lowest > self.next:
                if self._probed is None or self._probed[0] != self.next or self._probed[1] is None:
                    self._probed = (self.next, first_record_at(self.next))
                found = self._probed[1]
                if found is None or found < lowest:
                    break  # events before the lowest range are still being scored
            self.next = max(self.next, self.pending.pop(lowest) + 1)
        return self.next > before


class _CommitScoredFn(beam.DoFn):
    """Per raw partition (the key), Beam state: commit the group's offset once everything below it
    has its prediction or dead letter acknowledged (``ScoredRanges``)."""

    PROGRESS = ReadModifyWriteStateSpec("progress", beam.coders.PickleCoder())

    def __init__(self, cfg: ScoreConfig):
        self.cfg = cfg

    def setup(self):
        self.consumer = new_consumer(self.cfg.bootstrap, self.cfg.kafka_config, group_id=self.cfg.group_id)
        self.probe = new_consumer(self.cfg.bootstrap, {"fetch_max_wait_ms": 100, **self.cfg.kafka_config},
                                  group_id=None)

    def teardown(self):
        for name in ("consumer", "probe"):
            if getattr(self, name, None) is not None:
                close_client(getattr(self, name))
                setattr(self, name, None)

    def process(self, element, progress=beam.DoFn.StateParam(PROGRESS)):
        from kafka import OffsetAndMetadata, TopicPartition

        key, (first, last) = element
        topic, partition = key.rsplit("/", 1)
        tp = TopicPartition(topic, int(partition))
        ranges = progress.read()
        if ranges is None:  # where this run's read started: the committed offset, else the log start
            committed = retry_kafka(lambda: self.consumer.committed(tp), "committed offset")
            ranges = ScoredRanges(committed if committed is not None else retry_kafka(
                lambda: self.consumer.beginning_offsets([tp]), "beginning offset")[tp])
        if ranges.add(first, last, lambda offset: self._first_record_at(tp, offset)):
            offsets = {tp: OffsetAndMetadata(ranges.next, "", -1)}
            retry_kafka(lambda: self.consumer.commit(offsets), "offset commit")
            yield key, ranges.next
        progress.write(ranges)

    def _first_record_at(self, tp, offset: int) -> int | None:
        self.probe.assign([tp])
        self.probe.seek(tp, offset)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            records = self.probe.poll(timeout_ms=200).get(tp, [])
            if records:
                return records[0].offset
        return None


class CommitScored(beam.PTransform):
    """``(partition key, (first, last))`` scored ranges -> the group's committed raw offsets."""

    def __init__(self, cfg: ScoreConfig):
        super().__init__()
        self.cfg = cfg

    def expand(self, ranges):
        return (ranges
                | "GlobalWindow" >> beam.WindowInto(window.GlobalWindows())
                | "CommitContiguous" >> beam.ParDo(_CommitScoredFn(self.cfg)))


def build_scoring_pipeline(pipeline: beam.Pipeline, cfg: ScoreConfig):
    """The scoring pipeline (see the module doc); returns the committed-offsets PCollection."""
    if not cfg.initial_model:
        raise ValueError("ScoreConfig.initial_model: the checkpoint of the version to serve first is required "
                         "(wait_for_version finds the newest valid one on the updates topic)")
    raw = pipeline | "ReadRaw" >> ReadFromKafka(cfg.bootstrap, cfg.raw_topic, start="committed",
                                                group_id=cfg.group_id, commit_offsets=False,
                                                consumer_config=cfg.kafka_config, max_read_s=cfg.max_read_s)
    versions = pipeline | "ModelVersions" >> LatestModelVersion(cfg)
    handler = FlowtrainModelHandler(cfg.load_version, cfg.initial_model, cfg.spec, device=cfg.device,
                                    max_batch_size=cfg.max_inference_batches, target_scale=cfg.target_scale,
                                    torch_threads=cfg.torch_threads)
    return (raw
            | "Featurize" >> FeaturizeForScoring(cfg)
            | "ToScorers" >> beam.Reshuffle()
            | "ServingWindows" >> beam.WindowInto(window.FixedWindows(cfg.swap_interval_s, offset=_WINDOW_OFFSET_S))
            | "Score" >> RunInference(handler, model_metadata_pcoll=versions)
            | "WritePredictions" >> WritePredictions(cfg)
            | "Commit" >> CommitScored(cfg))

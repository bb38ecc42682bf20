"""Predictions: one Arrow record batch per scored micro-batch, on the predictions topic (``--predictions-format``:
or one JSON object, Avro or Protobuf record per prediction; Avro/Protobuf events give Avro/Protobuf predictions,
``pipelines.serving.codec``).

The columns follow ``flowtrain predict``'s scheme (``pipelines.predict.rows.output_names``): the event's own columns
keep their names, every column flowtrain adds starts with ``pred_`` (``prediction_layout``), one row per event:

- ``pred_source`` (``"raw topic/partition/offset"``), ``pred_source_partition``, ``pred_source_offset``: where the
  event was;
- the ``--id-column`` (under its own name, as text; null where the event has none), and the label (under its own
  name: the class name, or the value; null for an unlabelled event or a class the training split never saw);
- binary classification: ``pred_probability_<positive class>`` and ``pred_class``; K classes:
  ``pred_probability_<class>`` for each class and ``pred_class``; regression: ``pred_value``, in the label's units;
- ``pred_model_version``, ``pred_model_run``: the version (a number) that computed it and its trainer run;
- ``pred_event_time`` (the raw record's Kafka timestamp), ``pred_scoring_time`` (when the model computed it).

An event column whose name is one of these takes its place, and flowtrain's the first free ``_1``... suffix.
"""
from __future__ import annotations

from dataclasses import dataclass

import apache_beam as beam
import numpy as np
import pyarrow as pa
from apache_beam.metrics import Metrics
from apache_beam.ml.inference.base import PredictionResult

from connectors.dataset_spec import CAT_PREFIX, LABEL, FeatureSpec
from connectors.deadletter import DeadLetter
from connectors.kafka import KafkaDelivery, close_client, dead_letter_record, new_producer, value_budget
from pipelines.predict.rows import OutputNames, output_names
from pipelines.serving.codec import PredictionsCodec, predictions_format
from pipelines.serving.handler import parse_model_tag
from pipelines.stream.formats.registry import SchemaRegistry
from pipelines.stream.status import write_status

__all__ = ["LATENCY_BUCKETS_S", "METRICS_NAMESPACE", "PredictionLayout", "prediction_layout", "predictions_batch",
           "WritePredictions"]


#: Upper bounds (seconds) of the prediction-latency histogram (event time to scoring time) the scorer
#: keeps in its status (``latency_buckets``: counts per bucket, the last one above the last bound);
#: ``/metrics`` serves it as the histogram ``flowtrain_prediction_latency_seconds``.
LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0)
_BUCKET_MS = np.asarray([b * 1000 for b in LATENCY_BUCKETS_S])
#: Beam metrics of the scorer (``PipelineResult.metrics()``, the runner's UI), counted after Kafka
#: acknowledged a micro-batch's predictions: counters ``predictions``, ``scored_batches``, ``labelled``,
#: ``correct``; distribution ``batch_latency_ms`` (each scored micro-batch's mean event-time-to-scoring
#: latency: one update per batch, so counting costs nothing per event).
METRICS_NAMESPACE = "flowtrain.serving"
#: The stream's own ``pred_*`` columns besides ``flowtrain predict``'s.
_STREAM_MORE = ("source_partition", "source_offset", "model_run", "event_time", "scoring_time")
_MS = pa.timestamp("ms", tz="UTC")


@dataclass(frozen=True)
class PredictionLayout:
    """The columns of a stream's predictions: their names (``names``: ``flowtrain predict``'s, with the stream's
    own in ``names.more``), the carried ``id_column`` and ``label`` (each None when absent), the task's ``kind``
    (binary, multiclass, regression), the ``classes`` and the Arrow ``schema``."""

    names: OutputNames
    id_column: str | None
    label: str | None
    kind: str
    classes: tuple[str, ...]
    schema: pa.Schema

    def more(self, what: str) -> str:
        return self.names.more[what]


def prediction_layout(spec: FeatureSpec, classes, id_column: str | None = None) -> PredictionLayout:
    """The prediction columns of a stream of ``spec``'s events (``classes``: the dataset's, in label-code order)."""
    classes = tuple(str(c) for c in (classes or ([] if spec.task == "regression" else ["0", "1"])))
    kind = "regression" if spec.task == "regression" else ("binary" if len(classes) <= 2 else "multiclass")
    label = spec.label if spec.label != id_column else None
    carried = [c for c in (id_column, label) if c]
    names = output_names(carried, kind, list(classes), more=_STREAM_MORE)
    fields = [pa.field(names.source, pa.string(), nullable=False),
              pa.field(names.more["source_partition"], pa.int64(), nullable=False),
              pa.field(names.more["source_offset"], pa.int64(), nullable=False)]
    if id_column:
        fields.append(pa.field(id_column, pa.string()))
    if label:
        fields.append(pa.field(label, pa.float64() if kind == "regression" else pa.string()))
    fields += [pa.field(c, pa.float64()) for c in names.probabilities]
    fields += [pa.field(names.klass, pa.string())] if names.klass else [pa.field(names.value, pa.float64())]
    fields += [pa.field(names.version, pa.int64(), nullable=False), pa.field(names.more["model_run"], pa.string()),
               pa.field(names.more["event_time"], _MS, nullable=False),
               pa.field(names.more["scoring_time"], _MS, nullable=False)]
    return PredictionLayout(names, id_column, label, kind, classes, pa.schema(fields))


def _own_column(features: pa.RecordBatch, name: str) -> pa.Array:
    """The featurizer's column ``name`` (the first of that name: a carried event field of the same name follows)."""
    return features.column(features.schema.get_all_field_indices(name)[0])


def unseen_counts(features: pa.RecordBatch | None, categorical) -> dict[str, int]:
    """Per categorical feature, the rows whose value the model does not know: never seen in training (or too
    rare to be kept), or missing (the out-of-vocabulary code 0)."""
    if features is None:
        return {c: 0 for c in categorical}
    return {c: int((features.column(CAT_PREFIX + c).to_numpy(zero_copy_only=False) == 0).sum()) for c in categorical}


def label_codes(features: pa.RecordBatch, n: int) -> np.ndarray:
    """The events' labels as the trainer sees them (class index, or value), NaN where an event has none (unlabelled,
    or a class the training split never saw)."""
    if LABEL not in features.schema.names:
        return np.full(n, np.nan)
    return _own_column(features, LABEL).cast(pa.float64()).to_numpy(zero_copy_only=False).astype(np.float64)


def predictions_batch(result: PredictionResult, layout: PredictionLayout) -> pa.RecordBatch:
    """One record batch of ``layout.schema`` for a scored micro-batch."""
    batch = result.example
    outputs, scored_ms = result.inference
    n = len(outputs)
    if n == 0:
        return pa.RecordBatch.from_pylist([], schema=layout.schema)
    f = batch.features
    run, version = parse_model_tag(result.model_id)
    outputs = np.asarray(outputs, dtype=np.float64)
    arrays = [_own_column(f, "source").cast(pa.string()), _own_column(f, "src_partition").cast(pa.int64()),
              _own_column(f, "src_offset").cast(pa.int64())]
    if layout.id_column:  # an event field carried as the id follows the featurizer's own columns, whatever its name
        arrays.append(f.column(f.schema.get_all_field_indices(layout.id_column)[-1]).cast(pa.string())
                      if layout.id_column in f.schema.names else pa.nulls(n, pa.string()))
    if layout.label:
        codes = label_codes(f, n)
        known = np.isfinite(codes)
        if layout.kind == "regression":
            arrays.append(pa.array(codes, pa.float64(), mask=~known))
        else:
            names = np.asarray(layout.classes, dtype=object)
            picked = np.where(known, codes, 0).astype(np.int64).clip(0, max(len(names) - 1, 0))
            arrays.append(pa.array(names[picked] if len(names) else np.full(n, None), pa.string(), mask=~known))
    if layout.kind == "multiclass":  # (rows, K) probabilities
        arrays += [pa.array(outputs[:, i]) for i in range(outputs.shape[1])]
        arrays.append(pa.array(np.asarray(layout.classes, dtype=object)[outputs.argmax(axis=1)], pa.string()))
    elif layout.kind == "binary":  # P(positive class)
        arrays.append(pa.array(outputs))
        arrays.append(pa.array(np.asarray(layout.classes, dtype=object)[(outputs > 0.5).astype(np.int64)],
                               pa.string()))
    else:
        arrays.append(pa.array(outputs))
    arrays += [pa.array(np.full(n, version, dtype=np.int64)), pa.array([run] * n, type=pa.string()),
               pa.array(batch.event_ms.astype(np.int64), type=pa.int64()).cast(_MS),
               pa.array(np.full(n, scored_ms, dtype=np.int64)).cast(_MS)]
    return pa.RecordBatch.from_arrays(arrays, schema=layout.schema)


def scores_of(preds: pa.RecordBatch, layout: PredictionLayout) -> np.ndarray:
    """The model's scores in predictions: binary P(positive); K classes (rows, K) probabilities; the value."""
    names = layout.names
    if layout.kind == "multiclass":
        return np.stack([preds.column(c).to_numpy(zero_copy_only=False) for c in names.probabilities], axis=1)
    column = names.probabilities[0] if layout.kind == "binary" else names.value
    return preds.column(column).to_numpy(zero_copy_only=False).astype(np.float64)


class _WritePredictionsFn(beam.DoFn):
    """Each scored micro-batch -> messages (``PredictionsCodec``), acknowledged; then its offset range goes on. A
    prediction that cannot be written (too large for a message, an encoding error) is a dead letter
    on the scorer's dead-letter topic with the reason, acknowledged the same way."""

    def __init__(self, cfg):
        self.cfg = cfg

    def setup(self):
        from pipelines.serving.config import topic_limits

        cfg = self.cfg
        self.limits = topic_limits(cfg, [cfg.topics.predictions, cfg.topics.dead_letters])
        self.producer = new_producer(cfg.kafka.bootstrap, cfg.kafka.config, max_message_bytes=min(self.limits.values()))
        fmt = predictions_format(getattr(cfg, "predictions_format", None), cfg.event_format)
        registry = SchemaRegistry(cfg.schema_registry) if cfg.schema_registry and fmt in ("avro", "protobuf") else None
        self.layout = prediction_layout(cfg.spec, cfg.classes, cfg.id_column)
        self.codec = PredictionsCodec(fmt, registry, f"{cfg.topics.predictions}-value", self.layout.schema)
        self.codec.register()  # the predictions' schema, once (a registry that does not answer is waited for)
        self.delivery = KafkaDelivery(self.producer, what="scorer", max_message_bytes=self.limits)
        self.totals = {"predictions": 0, "labelled": 0, "correct": 0, "version": None, "run_id": None,
                       "versions": {}, "latency_ms_sum": 0, "to_featurized_ms_sum": 0,
                       "latency_buckets_s": list(LATENCY_BUCKETS_S),
                       "latency_buckets": [0] * (len(LATENCY_BUCKETS_S) + 1), "dead_letters": 0}
        self.metrics = {name: Metrics.counter(METRICS_NAMESPACE, name)
                        for name in ("predictions", "scored_batches", "labelled", "correct")}
        self.latency = Metrics.distribution(METRICS_NAMESPACE, "batch_latency_ms")
        self.drift = None
        if getattr(cfg, "drift", None) is not None:  # drift monitoring (pipelines.serving.drift)
            from pipelines.serving.drift import DriftReporter, kafka_sender

            self.drift = DriftReporter(cfg.drift, classification=cfg.spec.task == "classification",
                                       status_path=cfg.status_path,
                                       send=kafka_sender(self.producer, cfg.topics.drift) if cfg.topics.drift else None)

    def teardown(self):
        if getattr(self, "drift", None) is not None:
            self.drift.close()  # the last window published, its records sent before the producer closes
        if getattr(self, "producer", None) is not None:
            close_client(self.producer)
            self.producer = None

    def process(self, result: PredictionResult):
        batch = result.example
        try:
            preds = predictions_batch(result, self.layout)
            messages, preds, unwritable = self.codec.encode(
                preds, value_budget(self.limits[self.cfg.topics.predictions], str(batch.partition).encode()))
        except Exception as err:  # noqa: BLE001 - a micro-batch that cannot be written: its events are dead letters
            f = batch.features
            messages, preds = [], None
            unwritable = [(i, f"its prediction cannot be written: {type(err).__name__}: {str(err)[:500]}")
                          for i in range(0 if f is None else f.num_rows)]
        if unwritable:
            self._dead_letters(batch, unwritable)
        if messages:
            key = str(batch.partition).encode()
            for message in messages:
                self.delivery.send(self.cfg.topics.predictions, message, key=key)
        if messages or unwritable:
            self.delivery.confirm()  # acknowledged before the offsets can be committed, and before counting
        self.totals["dead_letters"] += len(unwritable)
        if preds is not None and preds.num_rows:
            self._count_unseen(batch.features)
            labels = self._labels(batch.features, preds)
            self._count(preds, labels, batch.featurized_ms)
            if self.drift is not None:
                self._drift(batch.features, preds, labels)
        elif unwritable:
            write_status(self.cfg.status_path, self, self.totals, kind="predictions")
        yield (f"{batch.topic}/{batch.partition}", (batch.first_offset, batch.last_offset))

    def _dead_letters(self, batch, rows: list[tuple[int, str]]) -> None:
        """The events of ``rows`` (indices of the micro-batch's features) as dead letters with the reason."""
        f = batch.features
        sources = f.column("source").to_pylist()
        ids = f.column(self.cfg.id_column) if self.cfg.id_column and self.cfg.id_column in f.schema.names else None
        topic = self.cfg.topics.dead_letters
        for i, reason in rows:
            payload = {"source": sources[i]}
            if ids is not None:
                value = ids[i].as_py()
                payload["id"] = value if value is None or len(str(value)) <= 256 else str(value)[:256] + "..."
            key, value, headers = dead_letter_record(DeadLetter(payload, sources[i], reason),
                                                     max_bytes=self.limits[topic])
            self.delivery.send(topic, value, key=key, headers=headers)

    def _count_unseen(self, features: pa.RecordBatch) -> None:
        """Scored events with an unseen categorical value, per column: the status's ``unseen`` and the Beam
        counters ``unseen_<column>``."""
        totals = self.totals.setdefault("unseen", {c: 0 for c in self.cfg.spec.categorical})
        for col, n in unseen_counts(features, self.cfg.spec.categorical).items():
            totals[col] = totals.get(col, 0) + n
            if n:
                Metrics.counter(METRICS_NAMESPACE, f"unseen_{col}").inc(n)

    def _labels(self, features: pa.RecordBatch, preds: pa.RecordBatch) -> np.ndarray:
        """The label codes (class index or value; NaN: none) of the events whose predictions were written."""
        codes = label_codes(features, features.num_rows)
        if preds.num_rows == features.num_rows:
            return codes
        where = {int(o): i for i, o in enumerate(_own_column(features, "src_offset").to_numpy(zero_copy_only=False))}
        kept = preds.column(self.layout.more("source_offset")).to_numpy(zero_copy_only=False)
        return codes[[where[int(o)] for o in kept]]

    def _drift(self, features: pa.RecordBatch, preds: pa.RecordBatch, label: np.ndarray) -> None:
        """The micro-batch into the drift window (``pipelines.serving.drift.DriftReporter``: the window's counts go
        to the status file, kind ``drift``, and its measures to the drift topic, from the reporter's thread)."""
        k = self.cfg.n_classes
        scores = scores_of(preds, self.layout)
        known = np.isfinite(label)
        wrong = None
        if known.any():
            if self.cfg.spec.task == "classification":
                guess = scores.argmax(axis=1) if k > 2 else (scores > 0.5).astype(np.int64)
                wrong = (guess[known] != label[known].astype(np.int64)).astype(np.float64)
            else:  # an error in [0, 1]: the absolute error in units of 4 training standard deviations
                std = float(self.cfg.stats.get("label_std") or 1.0)
                wrong = np.minimum(1.0, np.abs(scores[known] - label[known]) / (4.0 * std))
        self.drift.add(features, label, scores, wrong)

    def _count(self, preds: pa.RecordBatch, label: np.ndarray, featurized_ms: int) -> None:
        t, layout = self.totals, self.layout
        t["predictions"] += preds.num_rows
        labelled = correct = 0
        version = int(preds.column(layout.names.version)[0].as_py())
        t["version"], t["run_id"] = version, preds.column(layout.more("model_run"))[0].as_py()
        t["versions"][str(version)] = t["versions"].get(str(version), 0) + preds.num_rows
        known = ~np.isnan(label)
        if self.cfg.spec.task == "classification" and known.any():
            classes = list(self.cfg.classes or ["0", "1"])
            names = np.asarray(preds.column(layout.names.klass).to_pylist(), dtype=object)[known]
            want = np.asarray(classes, dtype=object)[label[known].astype(np.int64)]
            labelled, correct = int(known.sum()), int((names == want).sum())
            t["labelled"] += labelled
            t["correct"] += correct
        event = preds.column(layout.more("event_time")).cast(pa.int64()).to_numpy()
        latency_ms = preds.column(layout.more("scoring_time")).cast(pa.int64()).to_numpy() - event
        t["latency_ms_sum"] += int(latency_ms.sum())
        t["to_featurized_ms_sum"] += int((featurized_ms - event).sum())
        # bucket i counts latencies in (bound[i-1], bound[i]]; the last, those above the last bound
        counts = np.bincount(np.searchsorted(_BUCKET_MS, latency_ms, side="left"), minlength=len(_BUCKET_MS) + 1)
        t["latency_buckets"] = [int(a + b) for a, b in zip(t["latency_buckets"], counts)]
        self.metrics["predictions"].inc(preds.num_rows)
        self.metrics["scored_batches"].inc()
        self.metrics["labelled"].inc(labelled)
        self.metrics["correct"].inc(correct)
        self.latency.update(int(latency_ms.mean()))
        write_status(self.cfg.status_path, self, t, kind="predictions")


class WritePredictions(beam.PTransform):
    """``PredictionResult``s -> the predictions topic; outputs ``(partition key, (first, last))``."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg

    def expand(self, results):
        return results | "Produce" >> beam.ParDo(_WritePredictionsFn(self.cfg))




"""Predictions: one Arrow record batch per scored micro-batch, on the predictions topic (``--predictions-format``:
or one JSON object, Avro or Protobuf record per prediction; Avro/Protobuf events give Avro/Protobuf predictions,
``pipelines.serving.codec``).

``PREDICTION_SCHEMA``, one row per event:

- ``source`` (``"raw topic/partition/offset"``), ``src_partition``, ``src_offset``: where the event was;
- ``id``: the event's own id (the value of ``--id-column``, as text; null without that option or value);
- ``prediction``: binary classification: the probability of the positive class (the second of the
  manifest's classes); K classes: the probability of the predicted class; regression: the value in
  the label's units;
- ``predicted_class``: classification: the predicted class's *name* (the manifest's classes); null
  for regression;
- ``probabilities``: K > 2 classes: each class's probability, in the manifest's class order; null otherwise;
- ``model_version``, ``model_run``: the version that computed it and its trainer run;
- ``event_time`` (the raw record's Kafka timestamp), ``scoring_time`` (when the model computed it);
- ``label``: the event's label when the model could be trained on it (the class index, or the value);
  null for an unlabelled event or a class the training split never saw.
"""
from __future__ import annotations

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from apache_beam.metrics import Metrics
from apache_beam.ml.inference.base import PredictionResult

from connectors.dataset_spec import CAT_PREFIX, LABEL
from connectors.deadletter import DeadLetter
from connectors.kafka import KafkaDelivery, close_client, dead_letter_record, new_producer, value_budget
from pipelines.serving.codec import PREDICTION_SCHEMA, PredictionsCodec, predictions_format
from pipelines.serving.handler import parse_model_tag
from pipelines.stream.formats.registry import SchemaRegistry
from pipelines.stream.status import write_status

__all__ = ["LATENCY_BUCKETS_S", "METRICS_NAMESPACE", "predictions_batch", "WritePredictions"]


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


def _own_column(features: pa.RecordBatch, name: str) -> pa.Array:
    """The featurizer's column ``name`` (the first of that name: a carried event field of the same name follows)."""
    return features.column(features.schema.get_all_field_indices(name)[0])


def unseen_counts(features: pa.RecordBatch | None, categorical) -> dict[str, int]:
    """Per categorical feature, the rows whose value the model does not know: never seen in training (or too
    rare to be kept), or missing (the out-of-vocabulary code 0)."""
    if features is None:
        return {c: 0 for c in categorical}
    return {c: int((features.column(CAT_PREFIX + c).to_numpy(zero_copy_only=False) == 0).sum()) for c in categorical}


def predictions_batch(result: PredictionResult, task: str, classes: list[str] | None,
                      id_column: str | None = None) -> pa.RecordBatch:
    """One ``PREDICTION_SCHEMA`` record batch for a scored micro-batch."""
    batch = result.example
    outputs, scored_ms = result.inference
    n = len(outputs)
    if n == 0:
        return pa.RecordBatch.from_pylist([], schema=PREDICTION_SCHEMA)
    f = batch.features
    run, version = parse_model_tag(result.model_id)
    outputs = np.asarray(outputs, dtype=np.float32)
    probabilities = pa.nulls(n, pa.list_(pa.float32()))
    names = pa.nulls(n, pa.string())
    if task == "classification":
        classes = list(classes or ["0", "1"])
        if outputs.ndim == 2:  # K classes: (rows, K) probabilities
            best = outputs.argmax(axis=1)
            prediction = outputs[np.arange(n), best]
            probabilities = pa.FixedSizeListArray.from_arrays(pa.array(outputs.reshape(-1)),
                                                              outputs.shape[1]).cast(pa.list_(pa.float32()))
        else:
            best = (outputs > 0.5).astype(np.int64)
            prediction = outputs
        names = pa.array(np.asarray(classes, dtype=object)[best], type=pa.string())
    else:
        prediction = outputs
    # an event field carried as the id comes after the featurizer's own columns, whatever its name (`label`...)
    ids = f.column(f.schema.get_all_field_indices(id_column)[-1]).cast(pa.string()) \
        if id_column and id_column in f.schema.names else pa.nulls(n, pa.string())
    label = pa.nulls(n, pa.float32())
    if LABEL in f.schema.names:  # NaN (the featurizer's "no label": unlabelled, unseen class) -> null
        values = _own_column(f, LABEL).cast(pa.float32())
        label = pc.if_else(pc.is_nan(values), pa.scalar(None, pa.float32()), values)
    return pa.RecordBatch.from_arrays([
        _own_column(f, "source").cast(pa.string()),
        _own_column(f, "src_partition").cast(pa.int64()),
        _own_column(f, "src_offset").cast(pa.int64()),
        ids,
        pa.array(prediction, type=pa.float32()),
        names,
        probabilities,
        pa.array(np.full(n, version, dtype=np.int64)),
        pa.array([run] * n, type=pa.string()),
        pa.array(batch.event_ms.astype(np.int64), type=pa.int64()).cast(pa.timestamp("ms", tz="UTC")),
        pa.array(np.full(n, scored_ms, dtype=np.int64)).cast(pa.timestamp("ms", tz="UTC")),
        label,
    ], schema=PREDICTION_SCHEMA)


class _WritePredictionsFn(beam.DoFn):
    """Each scored micro-batch -> messages (``PredictionsCodec``), acknowledged; then its offset range goes on. A
    prediction that cannot be written (too large for a message, an encoding error) is a dead letter
    on the scorer's dead-letter topic with the reason, acknowledged the same way."""

    def __init__(self, cfg):
        self.cfg = cfg

    def setup(self):
        from pipelines.serving.config import topic_limits

        cfg = self.cfg
        self.limits = topic_limits(cfg, [cfg.predictions_topic, cfg.dead_letter_topic])
        self.producer = new_producer(cfg.bootstrap, cfg.kafka_config, max_message_bytes=min(self.limits.values()))
        fmt = predictions_format(getattr(cfg, "predictions_format", None), cfg.event_format)
        registry = SchemaRegistry(cfg.schema_registry) if cfg.schema_registry and fmt in ("avro", "protobuf") else None
        self.codec = PredictionsCodec(fmt, registry, f"{cfg.predictions_topic}-value")
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
                                       send=kafka_sender(self.producer, cfg.drift.topic) if cfg.drift.topic else None)

    def teardown(self):
        if getattr(self, "drift", None) is not None:
            self.drift.close()  # the last window published, its records sent before the producer closes
        if getattr(self, "producer", None) is not None:
            close_client(self.producer)
            self.producer = None

    def process(self, result: PredictionResult):
        batch = result.example
        try:
            preds = predictions_batch(result, self.cfg.spec.task, self.cfg.classes, self.cfg.id_column)
            messages, preds, unwritable = self.codec.encode(
                preds, value_budget(self.limits[self.cfg.predictions_topic], str(batch.partition).encode()))
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
                self.delivery.send(self.cfg.predictions_topic, message, key=key)
        if messages or unwritable:
            self.delivery.confirm()  # acknowledged before the offsets can be committed, and before counting
        self.totals["dead_letters"] += len(unwritable)
        if preds is not None and preds.num_rows:
            self._count_unseen(batch.features)
            self._count(preds, batch.featurized_ms)
            if self.drift is not None:
                self._drift(batch.features, preds)
        elif unwritable:
            write_status(self.cfg.status_path, self, self.totals, kind="predictions")
        yield (f"{batch.topic}/{batch.partition}", (batch.first_offset, batch.last_offset))

    def _dead_letters(self, batch, rows: list[tuple[int, str]]) -> None:
        """The events of ``rows`` (indices of the micro-batch's features) as dead letters with the reason."""
        f = batch.features
        sources = f.column("source").to_pylist()
        ids = f.column(self.cfg.id_column) if self.cfg.id_column and self.cfg.id_column in f.schema.names else None
        topic = self.cfg.dead_letter_topic
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

    def _drift(self, features: pa.RecordBatch, preds: pa.RecordBatch) -> None:
        """The micro-batch into the drift window (``pipelines.serving.drift.DriftReporter``: the window's counts go
        to the status file, kind ``drift``, and its measures to the drift topic, from the reporter's thread)."""
        label = preds.column("label").to_numpy(zero_copy_only=False).astype(np.float64)
        k = self.cfg.n_classes
        if k > 2:
            scores = np.asarray(preds.column("probabilities").flatten().to_numpy(zero_copy_only=False),
                                dtype=np.float64).reshape(preds.num_rows, k)
        else:
            scores = preds.column("prediction").to_numpy(zero_copy_only=False).astype(np.float64)
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

    def _count(self, preds: pa.RecordBatch, featurized_ms: int) -> None:
        t = self.totals
        t["predictions"] += preds.num_rows
        labelled = correct = 0
        version = int(preds.column("model_version")[0].as_py())
        t["version"], t["run_id"] = version, preds.column("model_run")[0].as_py()
        t["versions"][str(version)] = t["versions"].get(str(version), 0) + preds.num_rows
        label = preds.column("label").to_numpy(zero_copy_only=False)
        known = ~np.isnan(label)
        if self.cfg.spec.task == "classification" and known.any():
            classes = list(self.cfg.classes or ["0", "1"])
            names = np.asarray(preds.column("predicted_class").to_pylist(), dtype=object)[known]
            want = np.asarray(classes, dtype=object)[label[known].astype(np.int64)]
            labelled, correct = int(known.sum()), int((names == want).sum())
            t["labelled"] += labelled
            t["correct"] += correct
        event = preds.column("event_time").cast(pa.int64()).to_numpy()
        latency_ms = preds.column("scoring_time").cast(pa.int64()).to_numpy() - event
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




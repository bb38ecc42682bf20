"""Raw events -> model features, for any ``flowtrain batch`` dataset, with the batch ETL's own code.

The public contract (what the stream pipeline, the scorer and tests call)::

    featurizer = StreamFeaturizer(spec, stats)            # or StreamFeaturizer.from_manifest(manifest)
    out = featurizer.featurize_payloads(payloads, sources, bounds)   # -> EventFeatures

``payloads`` are raw Kafka values (bytes or None), ``sources`` their ``(topic, partition,
offset)``. Every payload ends in exactly one of three places:

- ``out.features`` row, trainable (``out.trainable``): a valid event with a label the dataset
  can encode: trained on (and scored);
- ``out.features`` row, not trainable: a valid event without its label (absent or null: an
  *unlabelled* event, scored only, not a dead letter), or with a class the training split never
  saw (scored, and a dead letter for training: ``out.unseen_class``);
- ``out.dead_letters``: an invalid event (broken JSON, a wrong type, a missing required field,
  NaN/inf, too large, too deep, not UTF-8, a value the dataset's checks reject), with a reason
  naming the field. Never in ``features``.

So ``len(payloads) == out.features.num_rows + len(out.dead_letters)`` (the scorer's
reconciliation) and ``len(payloads) == out.training().num_rows + out.unlabelled +
len(out.training_dead_letters)`` (the trainer's). Features hold ``num__*`` / ``cat__*`` columns
exactly as the batch ETL's ``featurize_rows`` computes them from the same rows (standardization
with the manifest's statistics, vocabulary codes with 0 for out-of-vocabulary and missing, the
training mean for a missing optional numeric), ``label`` (``encode_labels``' target; NaN where the
row has none), ``source`` (``topic/partition/offset``), ``src_partition``, ``src_offset``, then the
``keep`` columns (an event's own fields carried as text, e.g. an id), in payload order.

An ``Enrichment`` (a domain's reference-data step, e.g. the demo preset's weather and planes join)
gives its own raw event fields and derives the spec's input columns from them; without one the
event fields are the spec's input columns (``event_schema``).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from connectors.dataset_spec import LABEL, FeatureSpec
from connectors.deadletter import DeadLetter
from pipelines.stream.events import (
    DEFAULT_BOUNDS,
    SOURCE_COLUMNS,
    EventField,
    EventSchema,
    ParseBounds,
    event_schema,
)
from pipelines.tabular.checks import split_valid
from pipelines.tabular.features import featurize_rows
from pipelines.tabular.labels import encode_labels

_ROW = "__stream_row"


class Enrichment(Protocol):
    """A domain's step between parsing and the feature code (a dataset preset's, e.g. the demo's weather/planes join)."""

    #: the domain's raw event fields
    events: EventSchema

    def enrich(self, table: pa.Table) -> pa.Table:
        """Events table -> the same rows, in order, with the spec's input columns added."""

    def checks(self, batch: pa.RecordBatch) -> list[tuple[str, np.ndarray]]:
        """The dataset's own dead-letter rules (the batch ETL's ``extra_checks``)."""


class EventFeatures(NamedTuple):
    """What ``StreamFeaturizer`` makes of a micro-batch (see the module doc for the contract)."""

    features: pa.RecordBatch | None  # every valid event, in payload order
    trainable: np.ndarray  # bool per features row: the event is a training row
    dead_letters: list[DeadLetter]  # invalid events (no features row)
    unseen_class: list[DeadLetter]  # features rows whose label is a class never seen in training

    def training(self) -> pa.RecordBatch | None:
        """The training rows (the features topic's rows); None when there are none."""
        if self.features is None or not self.trainable.any():
            return None
        return self.features if self.trainable.all() else self.features.filter(pa.array(self.trainable))

    @property
    def unlabelled(self) -> int:
        """Valid events without a label: scored, neither trained on nor dead letters."""
        rows = 0 if self.features is None else self.features.num_rows
        return rows - int(self.trainable.sum()) - len(self.unseen_class)

    @property
    def training_dead_letters(self) -> list[DeadLetter]:
        """Dead letters from the trainer's side: invalid events and unseen classes."""
        return self.dead_letters + self.unseen_class


def empty_result(letters: list[DeadLetter] | None = None) -> EventFeatures:
    return EventFeatures(None, np.zeros(0, dtype=bool), list(letters or []), [])


def _placeholder(spec: FeatureSpec, stats: dict, col_type: pa.DataType):
    """A label value every check accepts, put in (only) while an unlabelled row is validated and
    featurized: its target is never used (the row is not trainable)."""
    if spec.task == "classification" and spec.positive_above is None:
        value = (stats.get("classes") or [""])[0]
    elif spec.positive_above is not None:
        value = float(spec.positive_above)
    else:
        value = float(stats.get("label_mean", 0.0))
    try:
        return pa.scalar(value).cast(col_type)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
        return pa.scalar(None, col_type)


def _with_label(batch: pa.RecordBatch, spec: FeatureSpec, keep: np.ndarray, fill) -> pa.RecordBatch:
    """The rows not in ``keep`` with the placeholder label ``fill`` (and weight 1 with ``--weight-column``: an
    unlabelled event needs no weight, it is scored only)."""
    i = batch.schema.get_field_index(spec.label)
    col = pc.if_else(pa.array(keep), batch.column(i), fill)
    batch = batch.set_column(i, spec.label, col)
    if spec.weight_column and spec.weight_column in batch.schema.names:
        j = batch.schema.get_field_index(spec.weight_column)
        weights = pc.cast(batch.column(j), pa.float64())
        batch = batch.set_column(j, spec.weight_column, pc.if_else(pa.array(keep), weights, pa.scalar(1.0)))
    return batch


class StreamFeaturizer:
    """Events of one dataset -> ``EventFeatures``, with the batch ETL's feature code.

    ``spec`` and ``stats`` are the dataset manifest's; ``enrichment`` an optional domain step;
    ``keep`` event fields (not features) carried into the features as text, e.g. an id.
    ``event_format`` (``--event-format``: json, avro, protobuf; ``pipelines.stream.formats``) says how the raw
    values are decoded, with ``schema_registry`` (the Confluent wire format) or ``schema_file`` (the writer's
    schema without a registry).
    A failure on a batch (an event no check foresaw) is retried row by row, so only the rows
    that fail become dead letters (reason: the error); the batch goes on.
    """

    def __init__(self, spec: FeatureSpec, stats: dict, enrichment: Enrichment | None = None,
                 keep: Sequence[str] = (), *, event_format: str = "json", schema_registry: str | None = None,
                 schema_file: str | None = None):
        from pipelines.stream.formats import event_format as make_format

        self.spec, self.stats, self.enrichment, self.keep = spec, stats, enrichment, tuple(keep)
        events = enrichment.events if enrichment is not None else event_schema(spec)
        extra = [EventField(k, (str, int, float, bool), None, required=False, nullable=True)
                 for k in self.keep if k not in events.names]
        self.events = EventSchema(events.fields + tuple(extra))
        self.format = make_format(event_format, self.events, schema_file=schema_file, registry=schema_registry)

    @classmethod
    def from_manifest(cls, manifest: dict, enrichment: Enrichment | None = None,
                      keep: Sequence[str] = ()) -> StreamFeaturizer:
        """From a ``flowtrain batch`` dataset manifest (``connectors.dataset.read_manifest``)."""
        return cls(FeatureSpec.from_dict(manifest["spec"]), manifest["stats"], enrichment, keep)

    @property
    def columns(self) -> list[str]:
        """The event fields this featurizer reads."""
        return self.events.names

    # --- the public steps -------------------------------------------------------------------------
    def featurize_payloads(self, payloads: Sequence[bytes | None], sources: Sequence[tuple[str, int, int]],
                           bounds: ParseBounds = DEFAULT_BOUNDS) -> EventFeatures:
        """Raw Kafka values and their ``(topic, partition, offset)`` -> ``EventFeatures``."""
        table, letters = self.format.decode(payloads, sources, bounds)
        out = self.featurize_table(table)
        if letters:  # parse letters first, then the feature code's, as the pipeline sends them
            out = out._replace(dead_letters=letters + out.dead_letters)
        return out

    def featurize_table(self, table: pa.Table | None) -> EventFeatures:
        """An events table (``parse_batch``) -> ``EventFeatures``."""
        if table is None or not table.num_rows:
            return empty_result()
        try:
            return self._featurize(table)
        except Exception:  # noqa: BLE001 - find the event(s) the feature code fails on
            pass
        parts, letters = [], []
        sources = table.column("source").to_pylist()
        for i in range(table.num_rows):
            try:
                parts.append(self._featurize(table.slice(i, 1)))
            except Exception as err:  # noqa: BLE001 - one event's content must not stop the pipeline
                row = {k: v for k, v in table.slice(i, 1).to_pylist()[0].items() if k not in SOURCE_COLUMNS}
                letters.append(DeadLetter(row, sources[i], f"featurizing failed: {type(err).__name__}: "
                                                           f"{str(err)[:500]}"))
        return concat_results(parts, letters)

    # --- the feature code -------------------------------------------------------------------------
    def _featurize(self, table: pa.Table) -> EventFeatures:
        spec, stats = self.spec, self.stats
        if self.enrichment is not None:
            table = self.enrichment.enrich(table)
        batch = table.combine_chunks().to_batches()[0] if table.num_rows else None
        if batch is None:
            return empty_result()
        batch = batch.append_column(_ROW, pa.array(np.arange(batch.num_rows, dtype=np.int64)))
        label = batch.column(spec.label)
        labelled = np.asarray(label.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
        fill = _placeholder(spec, stats, label.type)
        checked = _with_label(batch, spec, labelled, fill) if not labelled.all() else batch
        extra = self.enrichment.checks(checked) if self.enrichment is not None else []
        good, letters = split_valid(checked, spec, extra, stats=stats)  # the statistics' numeric ranges too
        if letters:
            letters = _clean_letters(letters, spec.label, {s for s, ok in zip(
                batch.column("source").to_pylist(), labelled) if not ok})
        if not good.num_rows:
            return empty_result(letters)
        rows = good.column(_ROW).to_numpy()
        labelled_good = labelled[rows]
        _, known = encode_labels(good.column(spec.label), spec, stats)
        trainable = labelled_good & known
        unseen_rows = labelled_good & ~known
        unseen: list[DeadLetter] = []
        if unseen_rows.any():  # the batch ETL's reason, from its own code (labelled rows hold their label)
            _, unseen = featurize_rows(good.filter(pa.array(unseen_rows)).drop_columns([_ROW]), spec, stats)
        if not trainable.all():
            good = _with_label(good, spec, trainable, fill)
        features, bad = featurize_rows(good.drop_columns([_ROW]), spec, stats)
        if bad:  # cannot happen (every label is known or the placeholder); never lose a row silently
            raise ValueError(f"{len(bad)} row(s) lost featurizing: {bad[0].reason}")
        i = features.schema.get_field_index(LABEL)
        target = features.column(i).to_numpy(zero_copy_only=False).copy()
        target[~trainable] = np.nan
        features = features.set_column(i, LABEL, pa.array(target, pa.float32()))
        for name in ("src_partition", "src_offset", *self.keep):
            features = features.append_column(name, good.column(name))
        return EventFeatures(features, trainable, letters, unseen)


def _clean_letters(letters: list[DeadLetter], label: str, unlabelled_sources: set) -> list[DeadLetter]:
    """Dead letters as the event was: without the row index, and an unlabelled event's label null
    again (it held the placeholder while it was checked)."""
    out = []
    for letter in letters:
        payload = dict(letter.payload) if isinstance(letter.payload, dict) else letter.payload
        if isinstance(payload, dict):
            payload.pop(_ROW, None)
            if letter.source in unlabelled_sources:
                payload[label] = None
        out.append(letter._replace(payload=payload))
    return out


def concat_results(parts: Sequence[EventFeatures], letters: Sequence[DeadLetter] = ()) -> EventFeatures:
    """Several ``EventFeatures`` (in order) as one; ``letters`` added to its dead letters."""
    batches = [p.features for p in parts if p.features is not None and p.features.num_rows]
    trainable = [p.trainable for p in parts if p.features is not None and p.features.num_rows]
    dead = [d for p in parts for d in p.dead_letters] + list(letters)
    unseen = [d for p in parts for d in p.unseen_class]
    if not batches:
        return EventFeatures(None, np.zeros(0, dtype=bool), dead, unseen)
    features = pa.Table.from_batches(batches).combine_chunks().to_batches()[0]
    return EventFeatures(features, np.concatenate(trainable), dead, unseen)


def featurize_payloads(payloads: Sequence[bytes | None], sources: Sequence[tuple[str, int, int]],
                       featurizer: StreamFeaturizer, bounds: ParseBounds = DEFAULT_BOUNDS) -> EventFeatures:
    """``featurizer.featurize_payloads(payloads, sources, bounds)``: the module doc's contract."""
    return featurizer.featurize_payloads(payloads, sources, bounds)

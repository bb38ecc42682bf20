"""Features over time in the stream's parts (the feature pipeline, the scorer): the declaration's inputs as event
fields, one ``StreamFeatures`` per raw partition (``pipelines.features.stream``: watermark, allowed lateness, the
state in a SQLite file per consumer group and partition), late events as dead letters, and each event's feature
values logged as JSON lines for ``flowtrain skew``.

The events of a dataset trained on aggregates carry the aggregations' inputs (keys, the time column, the
aggregated columns, the joins' keys), not the aggregates: ``event_fields`` takes the aggregate and joined columns
out of the dataset's event fields and adds the inputs. The aggregates are appended before the batch ETL's feature
code, so the model's columns are made from them as in training.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa

from connectors.dataset_spec import FeatureSpec
from connectors.deadletter import DeadLetter
from pipelines.features.asof import AsOfTable
from pipelines.features.columns import MISSING_TIME
from pipelines.features.core import KeyFeatures
from pipelines.features.declare import EVENTS, NUMERIC, Declaration, declare
from pipelines.features.output import feature_types, read_table
from pipelines.features.store import StateStore
from pipelines.features.stream import LATE, StreamFeatures, StreamPlan
from pipelines.stream.events import EventField, EventSchema
from pipelines.stream.featurize import EventFeatures, StreamFeaturizer
from pipelines.stream.join_topic import TopicTable, is_topic

_NUMBER = (int, float)
_ANY_VALUE = (str, int, float, bool)
_OFFSET = "_offset"
#: The scorer keeps the values of the events it sent for this many offsets behind its read.
SENT_KEPT = 200_000


def kinds_of(decl: Declaration, spec: FeatureSpec, recorded: dict | None = None) -> tuple[tuple[str, str], ...]:
    """Each aggregated column's kind: as the backfill of the dataset recorded it (its manifest's ``features``), else
    number for a numeric feature or a column with a numeric aggregation, text otherwise."""
    numeric = set(spec.numeric) | set(spec.optional_numeric)
    out = {}
    for a in decl.aggregations:
        if a.column == EVENTS:
            continue
        if recorded and a.column in recorded:
            out[a.column] = recorded[a.column]
        else:
            out[a.column] = "number" if a.column in numeric or set(a.aggs) & NUMERIC else "text"
    return tuple(out.items())


class Aggregates:
    """The declaration of a stream part, its tables and its partitions' states."""

    def __init__(self, options, spec: FeatureSpec, *, group_id: str, state_dir: str,
                 recorded_kinds: dict | None = None):
        self.decl = declare(options.aggregations or (), options.joins or ())
        if self.decl.aggregations and not spec.time_column:
            raise ValueError("--aggregate needs the dataset's time column (train it with --time-column)")
        self.spec, self.group_id, self.state_dir = spec, group_id, state_dir
        self.tables = [TopicTable(j, options.kafka.bootstrap, options.kafka.config, time_format=spec.time_format)
                       if is_topic(j) else AsOfTable(j, read_table(j.table), time_format=spec.time_format)
                       for j in self.decl.joins]
        self.plan = StreamPlan(self.decl, spec.time_column or "", spec.time_format,
                               kinds_of(self.decl, spec, recorded_kinds), float(options.allowed_lateness))
        self.outputs = [*self.decl.aggregate_names(), *(n for t in self.tables for n in t.columns)]
        self.log_dir = options.log_features
        self.log_id = getattr(options, "log_features_id", None)
        self.parts: dict[tuple[str, int], StreamFeatures] = {}
        self.logs: dict[tuple[str, int], object] = {}
        types = [(n, t) for g in self.plan_groups() for n, _, t in feature_types(g, self.plan.kind)]
        types += [(n, c.type) for t in self.tables for n, c in t.columns.items()]
        self.output_schema = pa.schema(types)

    def plan_groups(self):
        return [KeyFeatures(self.decl.by_key(k)) for k in self.decl.keys()]

    def event_fields(self, events: EventSchema) -> EventSchema:
        """The dataset's event fields without the aggregate and joined columns, with the declaration's inputs."""
        outputs = set(self.outputs)
        fields = [f for f in events.fields if f.name not in outputs]
        have = {f.name for f in fields}
        kinds = dict(self.plan.kinds)
        wanted = [*(c for k in self.decl.keys() for c in k), *kinds, *(c for j in self.decl.joins for c in j.key),
                  *([self.log_id] if self.log_id else [])]
        for name in dict.fromkeys(wanted):
            if name in have:
                continue
            if kinds.get(name) == "number":
                fields.append(EventField(name, _NUMBER, pa.float64(), required=False, nullable=True))
            else:
                fields.append(EventField(name, _ANY_VALUE, None, required=False, nullable=True))
            have.add(name)
        if self.plan.time_column and self.plan.time_column not in have:
            fields.append(EventField(self.plan.time_column, (str, int, float), None, required=True, nullable=True,
                                     time_text=True))
        return EventSchema(tuple(fields))

    def partition(self, topic: str, partition: int) -> StreamFeatures:
        """The partition's features, its state opened (or made) at ``<state_dir>/<group>-<topic>-<p>.sqlite``."""
        key = (topic, partition)
        feats = self.parts.get(key)
        if feats is not None and feats.store.read_offset() != feats.read_offset:
            # another instance of the step read this partition's last records (a runner may hand a partition's
            # bundles to other instances): this one's memory is behind its file, so it reads the file again
            feats.store.close()
            feats = None
        if feats is None:
            path = Path(self.state_dir) / f"{_safe(self.group_id)}-{_safe(topic)}-{partition}.sqlite"
            feats = self.parts[key] = StreamFeatures(self.plan, StateStore(path), self.tables)
        return feats

    def late_letters(self, late: pa.Table | None, behind: np.ndarray) -> list[DeadLetter]:
        """Dead letters of the late events (reason ``late``) and of those without a time."""
        if late is None:
            return []
        out = []
        lateness = self.plan.allowed_lateness_s
        for row, watermark in zip(late.to_pylist(), behind.tolist()):
            source = row.get("source", "")
            payload = {k: v for k, v in row.items() if k not in ("source", "src_partition", "src_offset", "src_ms")}
            if watermark == MISSING_TIME:
                reason = f"late: no event time in {self.plan.time_column!r} (missing or not a time)"
            else:
                reason = (f"{LATE}: event time {payload.get(self.plan.time_column)!r} is more than the allowed lateness "
                          f"({lateness:g} s) behind its partition's watermark ({watermark / 1e6:.6f} s since the "
                          f"epoch)")
            out.append(DeadLetter(payload, source, reason))
        return out

    def log(self, topic: str, partition: int, ready: pa.Table | None) -> None:
        """Each event's fields and feature values as one JSON line (floats exactly, NaN as null), flushed."""
        if not self.log_dir or ready is None or not ready.num_rows:
            return
        key = (topic, partition)
        if key not in self.logs:
            Path(self.log_dir).mkdir(parents=True, exist_ok=True)
            self.logs[key] = open_log(Path(self.log_dir) / f"{_safe(self.group_id)}-{_safe(topic)}-{partition}.jsonl")
        fh = self.logs[key]
        rows = ready.drop_columns([c for c in (_OFFSET, "src_partition", "src_offset")
                                   if c in ready.column_names]).to_pylist()
        fh.write("".join(json.dumps({k: _plain(v) for k, v in row.items()}, allow_nan=False) + "\n" for row in rows))
        fh.flush()

    def score_records(self, items: list, featurizer: StreamFeaturizer, bounds) -> tuple[EventFeatures, dict]:
        """A scorer's micro-batch of one partition (offset order) -> (the features of the events that go on, in
        offset order, dead letters included; {offset: Kafka time in ms} of those events). The scorer commits its
        offsets after the predictions, downstream: events its store holds already (read again after a restart) go
        on again with the values kept for them (``StateStore.sent``, for the last ``SENT_KEPT`` offsets)."""
        topic, partition = items[0].topic, items[0].partition
        feats = self.partition(topic, partition)
        stamps = {r.offset: r.timestamp for r in items}
        old = [r for r in items if r.offset < feats.read_offset]
        new = [r for r in items if r.offset >= feats.read_offset]
        parts, letters, sent = [], [], {}
        if old and feats.store is not None:
            kept = feats.store.sent([r.offset for r in old])
            again = [r for r in old if r.offset in kept]
            if again:
                table, _ = featurizer.format.decode([r.value for r in again],
                                                    [(r.topic, r.partition, r.offset) for r in again], bounds)
                if table is not None:
                    values = pa.Table.from_pylist([json.loads(kept[o]) for o in table.column("src_offset").to_pylist()],
                                                  schema=self.output_schema)
                    for name in values.column_names:
                        table = table.append_column(name, values.column(name))
                    parts.append(table)
        if new:
            table, letters = featurizer.format.decode([r.value for r in new],
                                                      [(r.topic, r.partition, r.offset) for r in new], bounds)
            offsets = table.column("src_offset").to_numpy() if table is not None else []
            if table is not None:  # each event's Kafka time travels with it while it waits
                table = table.append_column("src_ms", pa.array([stamps[int(o)] for o in offsets], pa.int64()))
            offered = feats.offer(table, offsets, first=new[0].offset, last=new[-1].offset)
            letters = letters + self.late_letters(offered.late, offered.late_watermark)
            if offered.ready is not None:
                ready = offered.ready.drop_columns([_OFFSET])
                stamps.update(zip(ready.column("src_offset").to_pylist(), ready.column("src_ms").to_pylist()))
                ready = ready.drop_columns(["src_ms"])
                self.log(topic, partition, ready)
                for row in ready.select(self.output_schema.names + ["src_offset"]).to_pylist():
                    sent[row.pop("src_offset")] = json.dumps({k: _plain(v) for k, v in row.items()})
                parts.append(ready)
        ready_all = None
        if parts:
            ready_all = pa.concat_tables([p.select(parts[0].column_names) for p in parts], promote_options="permissive")
            ready_all = ready_all.take(pa.array(np.argsort(ready_all.column("src_offset").to_numpy(), kind="stable")))
        out = featurizer.featurize_table(ready_all)
        # kept for the last SENT_KEPT offsets: a restart reads again from the scorer's committed offset, which trails
        # the read by a few micro-batches (the predictions in flight)
        feats.checkpoint(sent=sent, committed=max(0, feats.read_offset - SENT_KEPT))
        return out._replace(dead_letters=letters + out.dead_letters), stamps

    def waiting(self) -> int:
        return sum(p.waiting for p in self.parts.values())

    def join_counts(self) -> dict[str, int]:
        """The joined topics' bad records (rejected) and versions that came after their time was joined (late)."""
        topics = [t for t in self.tables if isinstance(t, TopicTable)]
        return {"join_rejected": sum(t.rejected for t in topics),
                "join_late_updates": sum(t.late_updates for t in topics)} if topics else {}

    def close(self) -> None:
        for fh in self.logs.values():
            fh.close()
        for p in self.parts.values():
            if p.store is not None:
                p.store.close()
        for t in self.tables:
            if isinstance(t, TopicTable):
                t.close()
        self.logs, self.parts = {}, {}


def open_log(path: Path):
    """``path`` opened to append JSON lines. A last line without its newline was cut by a kill (its micro-batch was
    logged before its state was checkpointed, so it is done and logged again): it is dropped, never glued to the
    next line."""
    if path.exists():
        with open(path, "rb+") as fh:
            size = fh.seek(0, 2)
            if size:
                fh.seek(max(0, size - (1 << 20)))
                tail = fh.read()
                if not tail.endswith(b"\n"):
                    cut = tail.rfind(b"\n")
                    if cut < 0 and size > len(tail):
                        raise ValueError(f"{path}: its last line is longer than 1 MiB and has no end")
                    fh.truncate(size - len(tail) + cut + 1)
    return open(path, "a", encoding="utf-8")


def _plain(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if hasattr(v, "isoformat"):
        return v.isoformat()
    return v


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in str(text))


class AggregateInputs:
    """The ``Enrichment`` a featurizer of aggregates is given: its events are the raw fields (``event_fields``); the
    aggregates are in the table already when the feature code runs."""

    def __init__(self, events: EventSchema):
        self.events = events

    def enrich(self, table: pa.Table) -> pa.Table:
        return table

    def checks(self, batch: pa.RecordBatch) -> list:
        return []

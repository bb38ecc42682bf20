"""Reading a predictions topic (``flowtrain predictions``, its options in ``flowtrain.commands.stream.predictions``): each
message decoded in its format (``pipelines.serving.codec``), the rows as tables, written as they come."""
from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from connectors.arrow import decode_batch
from connectors.dataset import read_manifest
from connectors.dataset_spec import FeatureSpec
from connectors.fields import build, check
from connectors.kafka import (
    KafkaUnavailable,
    check_brokers,
    close_client,
    new_consumer,
    summarize_reconnects,
    topic_end_offsets,
)
from flowtrain.commands.kafka_options import kafka_config
from flowtrain.commands.stream.options import dataset_topics
from flowtrain.commands.stream.predictions import PredictionsJob
from flowtrain.errors import FlowtrainError
from flowtrain.local.processes import StopSignals
from pipelines.serving.codec import PredictionsCodec, detect_format
from pipelines.serving.predictions import prediction_layout
from pipelines.stream.formats.registry import SchemaRegistry

__all__ = ["read_predictions", "read_table", "run_predictions", "write_topic"]

#: Records taken per poll, and how long a poll waits when the topic is at its end.
_POLL_RECORDS, _POLL_MS = 5000, 500


def _codec(job: PredictionsJob, fmt: str) -> PredictionsCodec:
    """The decoder of ``fmt`` predictions: with the registry, or with the dataset's columns."""
    schema = None
    if job.dataset:
        manifest = read_manifest(job.dataset)
        spec = FeatureSpec.from_dict(manifest["spec"])
        schema = prediction_layout(spec, manifest.get("stats", {}).get("classes"), job.id_column).schema
    registry = SchemaRegistry(job.schema_registry) if job.schema_registry and fmt in ("avro", "protobuf") else None
    if fmt in ("avro", "protobuf") and registry is None and schema is None:
        raise FlowtrainError(f"--predictions-format {fmt}: give --schema-registry URL (the scorer's) or --dataset DIR "
                             f"(and its --id-column) to read the records")
    return PredictionsCodec(fmt, registry, schema=schema)


def _as_table(rows: list[dict]) -> pa.Table:
    """Decoded predictions (dicts) as a table; milliseconds in ``pred_*_time`` columns as UTC timestamps."""
    table = pa.Table.from_pylist(rows)
    for i, name in enumerate(table.column_names):
        if name.startswith("pred_") and name.endswith("_time") and pa.types.is_integer(table.schema.field(i).type):
            table = table.set_column(i, name, table.column(i).cast(pa.int64()).cast(pa.timestamp("ms", tz="UTC")))
    return table


class _Decoder:
    """Messages -> tables: each message in its own format (``auto``: by its first bytes)."""

    def __init__(self, job: PredictionsJob):
        self.job, self.codecs = job, {}

    def codec(self, value: bytes) -> PredictionsCodec:
        fmt = self.job.predictions_format
        if fmt == "auto":
            fmt = detect_format(value)
            if fmt in (None, "wire"):
                raise FlowtrainError(f"{self.job.topic}: a message that is neither an Arrow record batch nor JSON: "
                                     f"give --predictions-format avro or protobuf (the scorer's), with "
                                     f"--schema-registry or --dataset")
        if fmt not in self.codecs:
            self.codecs[fmt] = _codec(self.job, fmt)
        return self.codecs[fmt]

    def tables(self, values: list[bytes]) -> Iterator[pa.Table]:
        rows: list[dict] = []
        for value in values:
            codec = self.codec(value)
            if codec.fmt == "arrow":
                if rows:
                    yield _as_table(rows)
                    rows = []
                yield pa.Table.from_batches([decode_batch(value)])
            else:
                try:
                    rows += codec.decode(value)
                except ValueError as err:
                    raise FlowtrainError(f"{self.job.topic}: a {codec.fmt} record cannot be read: {err}") from None
        if rows:
            yield _as_table(rows)


def _read(job: PredictionsJob, stop: Callable[[], bool]) -> Iterator[pa.Table]:
    """The topic's predictions as tables, from its beginning to its end (``follow``: on until ``stop``)."""
    cfg = kafka_config(job.kafka_config, job.kafka_config_file)
    try:  # no broker: one line naming it, within --connect-timeout (a consumer would wait 30 s, then a traceback)
        check_brokers(job.bootstrap, timeout_s=job.connect_timeout, client_config=cfg)
    except KafkaUnavailable as err:
        raise FlowtrainError(str(err)) from None
    consumer = new_consumer(job.bootstrap, cfg, enable_auto_commit=False, group_id=None,
                            max_poll_records=_POLL_RECORDS)
    decoder = _Decoder(job)
    try:
        try:
            ends = topic_end_offsets(consumer, job.topic, timeout_s=job.connect_timeout)
        except KafkaUnavailable as err:
            raise FlowtrainError(str(err)) from None
        if not ends:
            raise FlowtrainError(f"--topic {job.topic}: no such topic at {job.bootstrap}; check the name (the "
                                 f"scorer's --predictions-topic)")
        tps = sorted(ends, key=lambda tp: tp.partition)
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        while not stop():
            polled = consumer.poll(timeout_ms=_POLL_MS)
            values = [r.value for tp in sorted(polled, key=lambda t: t.partition) for r in polled[tp]
                      if r.value is not None]
            yield from decoder.tables(values)
            if not job.follow and all(consumer.position(tp) >= ends[tp] for tp in tps):
                return
    finally:
        close_client(consumer)


class _Writer:
    """Tables -> ``--out`` (Parquet or CSV) or CSV on stdout, as they come; a later table cast to the first's
    schema (a column a format left null there takes its type)."""

    def __init__(self, out: str | None):
        self.out, self.writer, self.schema, self.rows = out, None, None, 0

    def write(self, table: pa.Table) -> None:
        if self.schema is None:
            self.schema = table.schema
            if self.out and self.out.lower().endswith((".parquet", ".pq")):
                self.writer = pq.ParquetWriter(self.out, self.schema)
            else:
                sink = self.out if self.out else sys.stdout.buffer
                self.writer = pacsv.CSVWriter(sink, self.schema)
        else:
            table = table.select(self.schema.names).cast(self.schema) if table.schema != self.schema else table
        self.writer.write_table(table)
        self.rows += table.num_rows
        if not self.out:
            sys.stdout.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _limited(tables: Iterator[pa.Table], limit: int | None) -> Iterator[pa.Table]:
    seen = 0
    for table in tables:
        if limit is not None and seen + table.num_rows >= limit:
            yield table.slice(0, limit - seen)
            return
        seen += table.num_rows
        yield table


def read_table(job: PredictionsJob) -> pa.Table:
    """Every prediction on ``job.topic`` now (from its beginning to its end), as one table."""
    summarize_reconnects()
    tables = list(_limited(_read(job, lambda: False), job.limit))
    return pa.concat_tables(tables, promote_options="permissive") if tables else pa.table({})


def write_topic(job: PredictionsJob) -> int:
    """``job.topic``'s predictions to ``job.out`` (or CSV on stdout), as they come; ``job.follow``: until Ctrl-C or
    SIGTERM (what was read is written). Returns the rows written."""
    summarize_reconnects()
    writer = _Writer(job.out)
    with StopSignals() as stop:
        try:
            for table in _limited(_read(job, stop.is_set), job.limit):
                writer.write(table)
        finally:
            writer.close()
    return writer.rows


def _with_topic(job: PredictionsJob) -> PredictionsJob:
    """``job`` with its topic: given, or the one the scorer names after ``--dataset``."""
    if job.topic:
        return job
    if not job.dataset:
        raise FlowtrainError("predictions needs --topic TOPIC (the scorer's --predictions-topic) or --dataset DIR")
    return dataclasses.replace(job, topic=dataset_topics(job.dataset)["predictions_topic"])


def read_predictions(topic: str | None = None, **options: Any):
    """``flowtrain.predictions(topic, bootstrap=..., ...)``: every prediction on the topic now (from its beginning
    to its end), as one pyarrow Table; options are ``PredictionsJob``'s (not ``out`` nor ``follow``)."""
    job = _with_topic(check(build(PredictionsJob, {**options, "topic": topic})))
    if job.out or job.follow:
        raise FlowtrainError("flowtrain.predictions returns the table: leave out out= and follow= (the command "
                             "line's --out and --follow write a file)")
    return read_table(job)


def run_predictions(job: PredictionsJob) -> dict:
    """Read the topic and write its predictions (``--out``, or CSV on stdout); returns ``{"rows", "seconds"}``."""
    job = _with_topic(check(job))
    if job.out and Path(job.out).exists() and not job.overwrite:
        raise FlowtrainError(f"--out {job.out} exists; give a new path, or --overwrite to replace it")
    t0 = time.monotonic()
    rows = write_topic(job)
    took = time.monotonic() - t0
    if job.out:
        print(f"predictions: {rows:,} predictions from {job.topic} -> {job.out} ({took:.1f} s)", file=sys.stderr,
              flush=True)
    return {"rows": rows, "seconds": took}

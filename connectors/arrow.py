"""Arrow record batches as Kafka messages: one batch per message, Arrow IPC stream format.

``encode_batch`` / ``decode_batch`` are plain functions for code outside Beam (the trainer);
``EncodeArrow`` / ``DecodeArrow`` are the Beam transforms. A batch whose schema differs from
the expected one is rejected with both schemas named: a dead letter in a pipeline, a
``SchemaMismatch`` from the plain function.
"""
from __future__ import annotations

from collections.abc import Iterable

import apache_beam as beam
import pyarrow as pa

from connectors.deadletter import ERRS, DeadLetter

__all__ = ["SchemaMismatch", "encode_batch", "encode_batches", "decode_batch", "EncodeArrow", "DecodeArrow"]


class SchemaMismatch(ValueError):
    """A decoded batch does not have the schema the reader expects."""


def encode_batch(batch: pa.RecordBatch | pa.Table) -> bytes:
    """One IPC stream holding exactly one record batch (a table is combined into one)."""
    if isinstance(batch, pa.Table):
        batch = batch.combine_chunks().to_batches()[0] if batch.num_rows else \
            pa.RecordBatch.from_pylist([], schema=batch.schema)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def encode_batches(batch: pa.RecordBatch | pa.Table, max_bytes: int | None = None) -> list[bytes]:
    """``batch`` as one or more messages of at most ``max_bytes`` each, rows in order.

    Each message is a complete IPC stream (``decode_batch`` reads it alone); concatenating the
    decoded batches gives ``batch`` back. Without ``max_bytes`` this is ``[encode_batch(batch)]``.
    A single row larger than ``max_bytes`` cannot be split: ``ValueError`` says so.
    """
    if isinstance(batch, pa.Table):
        batch = batch.combine_chunks().to_batches()[0] if batch.num_rows else \
            pa.RecordBatch.from_pylist([], schema=batch.schema)
    whole = encode_batch(batch)
    if max_bytes is None or len(whole) <= max_bytes:
        return [whole]
    overhead = len(encode_batch(pa.RecordBatch.from_pylist([], schema=batch.schema)))  # schema, framing
    if batch.num_rows <= 1 or overhead >= max_bytes:
        raise ValueError(f"an Arrow message of {batch.num_rows} row(s) encodes to {len(whole):,} bytes "
                         f"(schema {overhead:,} bytes), more than the {max_bytes:,} bytes a message may have")
    per_row = max(1.0, (len(whole) - overhead) / batch.num_rows)
    rows = max(1, min(batch.num_rows // 2, int((max_bytes - overhead) / per_row * 0.95)))
    out: list[bytes] = []
    for start in range(0, batch.num_rows, rows):
        piece = batch.slice(start, rows)
        encoded = encode_batch(piece)
        out += [encoded] if len(encoded) <= max_bytes else encode_batches(piece, max_bytes)
    return out


def _check_schema(got: pa.Schema, expected: pa.Schema | None) -> None:
    if expected is not None and not got.equals(expected, check_metadata=False):
        raise SchemaMismatch(f"record batch schema does not match the expected schema.\n"
                             f"expected:\n{expected.to_string(show_schema_metadata=False)}\n"
                             f"found:\n{got.to_string(show_schema_metadata=False)}")


def decode_batch(payload: bytes, expected_schema: pa.Schema | None = None) -> pa.RecordBatch:
    """The one record batch in ``payload``; ``SchemaMismatch`` if its schema is not the expected."""
    reader = pa.ipc.open_stream(pa.py_buffer(payload))
    _check_schema(reader.schema, expected_schema)
    batches = list(reader)
    if len(batches) == 1:
        return batches[0]
    table = pa.Table.from_batches(batches, schema=reader.schema).combine_chunks()
    return table.to_batches()[0] if table.num_rows else pa.RecordBatch.from_pylist([], schema=reader.schema)


class EncodeArrow(beam.PTransform):
    """RecordBatch -> IPC bytes, or with ``key_fn`` a ``(key, bytes)`` pair for ``WriteToKafka``.

    With ``max_message_bytes`` (e.g. the topic's ``max.message.bytes`` less the record's
    overhead: ``connectors.kafka.value_budget``) a batch too large for one message becomes
    several, rows in order, each a complete IPC stream.
    """

    def __init__(self, *, key_fn=None, max_message_bytes: int | None = None):
        super().__init__()
        self._key_fn = key_fn
        self._max = max_message_bytes

    def expand(self, batches):
        key_fn, max_bytes = self._key_fn, self._max
        if key_fn is None:
            return batches | "Encode" >> beam.FlatMap(lambda b: encode_batches(b, max_bytes))
        return batches | "Encode" >> beam.FlatMap(
            lambda b: [(key_fn(b), m) for m in encode_batches(b, max_bytes)])


class _DecodeArrowFn(beam.DoFn):
    def __init__(self, expected_schema: pa.Schema | None):
        self._expected = expected_schema

    def process(self, element) -> Iterable:
        payload, source = _payload_and_source(element)
        try:
            yield decode_batch(payload, self._expected)
        except SchemaMismatch as err:
            yield beam.pvalue.TaggedOutput(ERRS, DeadLetter(payload, source, str(err)))
        except (pa.ArrowInvalid, pa.ArrowException, OSError, TypeError) as err:
            yield beam.pvalue.TaggedOutput(
                ERRS, DeadLetter(payload, source, f"not an Arrow IPC stream: {err}"))


def _payload_and_source(element) -> tuple[bytes, str]:
    # KafkaRecord without importing it (a NamedTuple with topic/partition/offset/value).
    if hasattr(element, "value") and hasattr(element, "offset"):
        return element.value, f"{element.topic}/{element.partition}/{element.offset}"
    return element, ""


class DecodeArrow(beam.PTransform):
    """IPC bytes (or ``KafkaRecord``s) -> RecordBatches; bad payloads to the ``errs`` output.

    ``batches, errs = records | DecodeArrow(expected_schema=schema)``
    """

    def __init__(self, *, expected_schema: pa.Schema | None = None):
        super().__init__()
        self._expected = expected_schema

    def expand(self, payloads):
        return payloads | "Decode" >> beam.ParDo(_DecodeArrowFn(self._expected)).with_outputs(
            ERRS, main="batches")

"""What an Arrow IPC stream holds, read from its metadata before any body is decompressed.

A compressed IPC message is small on the wire and large in memory: a 8.5 KB message of
zstd-compressed zeros decodes to 256 MiB. ``stream_facts`` walks the stream's messages
(``pyarrow.ipc.MessageReader``: no body is decoded) and reads each record batch's header
(the flatbuffer ``RecordBatch`` table of Arrow's ``Message.fbs``: its row count, its buffers
and whether they are compressed); a compressed buffer starts with its uncompressed length
(an int64), so the decoded size is known exactly before anything is decompressed.
``decode_bounded`` decodes only a stream whose decoded size is within a bound.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

__all__ = ["IpcFacts", "IpcTooLarge", "NotArrowIpc", "stream_facts", "decode_bounded"]


class NotArrowIpc(ValueError):
    """The payload is not one Arrow IPC stream (or its metadata is damaged)."""


class IpcTooLarge(ValueError):
    """The stream would decode to more bytes than allowed."""


@dataclass(frozen=True)
class IpcFacts:
    schema: pa.Schema
    rows: int  # rows of all record batches
    decoded_bytes: int  # bytes of every buffer once decompressed (record batches and dictionaries)
    compressed: bool


# Message.fbs: union MessageHeader { Schema = 1, DictionaryBatch = 2, RecordBatch = 3, ... }
_DICTIONARY_BATCH, _RECORD_BATCH = 2, 3


def _field_at(buf: bytes, table: int, index: int) -> int | None:
    """Absolute position of field ``index`` of the flatbuffer table at ``table`` (None: absent)."""
    vtable = table - struct.unpack_from("<i", buf, table)[0]
    vtable_size = struct.unpack_from("<H", buf, vtable)[0]
    slot = 4 + 2 * index
    if slot >= vtable_size:
        return None
    offset = struct.unpack_from("<H", buf, vtable + slot)[0]
    return table + offset if offset else None


def _follow(buf: bytes, at: int) -> int:
    return at + struct.unpack_from("<I", buf, at)[0]


def _batch_header(metadata: bytes) -> tuple[int, list[tuple[int, int]], bool] | None:
    """(rows, [(offset, length) of each body buffer], compressed) of a record or dictionary batch."""
    message = _follow(metadata, 0)
    kind_at, header_at = _field_at(metadata, message, 1), _field_at(metadata, message, 2)
    kind = metadata[kind_at] if kind_at is not None else 0
    if kind not in (_DICTIONARY_BATCH, _RECORD_BATCH) or header_at is None:
        return None
    batch = _follow(metadata, header_at)
    if kind == _DICTIONARY_BATCH:  # table DictionaryBatch { id: long; data: RecordBatch; isDelta: bool }
        data_at = _field_at(metadata, batch, 1)
        if data_at is None:
            return None
        batch = _follow(metadata, data_at)
    # table RecordBatch { length: long; nodes: [FieldNode]; buffers: [Buffer]; compression: BodyCompression }
    rows_at, buffers_at = _field_at(metadata, batch, 0), _field_at(metadata, batch, 2)
    rows = struct.unpack_from("<q", metadata, rows_at)[0] if rows_at is not None else 0
    buffers = np.empty((0, 2), dtype=np.int64)
    if buffers_at is not None:
        vector = _follow(metadata, buffers_at)
        count = struct.unpack_from("<I", metadata, vector)[0]
        buffers = np.frombuffer(metadata, dtype="<i8", count=2 * count, offset=vector + 4).reshape(count, 2)
    return rows, buffers, _field_at(metadata, batch, 3) is not None


def stream_facts(payload: bytes) -> IpcFacts:
    """Schema, rows and decoded size of an IPC stream, without decoding or decompressing a body."""
    try:
        reader = pa.ipc.MessageReader.open_stream(pa.py_buffer(payload))
        first = reader.read_next_message()
        if first.type != "schema":
            raise NotArrowIpc(f"an Arrow IPC stream starts with its schema, this one with a {first.type} message")
        schema = pa.ipc.read_schema(first)
        rows = decoded = 0
        compressed = False
        for message in reader:
            header = _batch_header(message.metadata.to_pybytes())
            if header is None:
                continue
            batch_rows, buffers, is_compressed = header
            if batch_rows < 0:
                raise NotArrowIpc(f"a record batch claims {batch_rows} rows")
            body = message.body
            body_size = body.size if body is not None else 0
            if message.type == "record batch":
                rows += batch_rows
            compressed = compressed or is_compressed
            offsets, lengths = buffers[:, 0], buffers[:, 1]
            outside = (offsets < 0) | (lengths < 0) | (offsets + lengths > body_size)
            if outside.any():
                k = int(np.flatnonzero(outside)[0])
                raise NotArrowIpc(f"a buffer [{offsets[k]}, {offsets[k] + lengths[k]}) lies outside its message "
                                  f"body of {body_size} bytes")
            if is_compressed:
                batch_bytes = 0
                for offset, length in zip(offsets.tolist(), lengths.tolist()):
                    if length >= 8:
                        size = struct.unpack_from("<q", body, offset)[0]  # -1: this buffer is stored as it is
                        batch_bytes += length - 8 if size == -1 else size
            else:
                batch_bytes = int(lengths.sum())
            # at least a byte a value: a column without buffers (type null) still has its rows
            decoded += max(batch_bytes, batch_rows * len(schema))
    except (NotArrowIpc, IpcTooLarge):
        raise
    except StopIteration:
        raise NotArrowIpc("an empty payload is not an Arrow IPC stream") from None
    except (pa.ArrowException, OSError, struct.error, IndexError, TypeError, ValueError) as err:
        raise NotArrowIpc(f"not an Arrow IPC stream: {str(err).splitlines()[0] if str(err) else type(err).__name__}"
                          ) from None
    return IpcFacts(schema, rows, decoded, compressed)


def decode_bounded(payload: bytes, max_decoded_bytes: int) -> tuple[pa.Table, IpcFacts]:
    """The stream as one table, decoded only when ``stream_facts`` says it fits ``max_decoded_bytes``."""
    facts = stream_facts(payload)
    if facts.decoded_bytes > max_decoded_bytes:
        raise IpcTooLarge(f"decodes to {facts.decoded_bytes:,} bytes ({facts.rows:,} rows, "
                          f"{len(payload):,} bytes {'compressed' if facts.compressed else 'on the wire'}), "
                          f"more than the bound of {max_decoded_bytes:,} bytes")
    try:
        table = pa.ipc.open_stream(pa.py_buffer(payload)).read_all()
    except (pa.ArrowException, OSError, ValueError) as err:
        raise NotArrowIpc(f"not a valid Arrow IPC stream: {str(err).splitlines()[0]}") from None
    return table, facts

"""The Confluent Schema Registry wire format: what a record's value holds around its Avro or Protobuf payload.

``[0x00 magic][schema id: 4 bytes, big-endian][Protobuf only: the message indexes][payload]``. The message
indexes say which message of the registered ``.proto`` file the payload is: a zig-zag varint count, then
that many zig-zag varint indexes; the first message (``[0]``) is written as the single byte ``0x00``.
"""
from __future__ import annotations

import struct

MAGIC = 0


class WireError(ValueError):
    """A record value that is not in the wire format (its text is the dead letter's reason)."""


def _zigzag(n: int) -> int:
    return (n << 1) ^ (n >> 63)


def _unzigzag(n: int) -> int:
    return (n >> 1) ^ -(n & 1)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        if pos >= len(data):
            raise WireError("wire format: truncated message indexes")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise WireError("wire format: a message index varint longer than 10 bytes")


def message_indexes(indexes: tuple[int, ...] = (0,)) -> bytes:
    """The Protobuf message-index bytes (``[0]``: the single byte 0)."""
    if tuple(indexes) == (0,):
        return b"\x00"
    return _varint(_zigzag(len(indexes))) + b"".join(_varint(_zigzag(i)) for i in indexes)


def frame(schema_id: int, payload: bytes, indexes: tuple[int, ...] | None = None) -> bytes:
    """A payload in the wire format (``indexes``: Protobuf's message indexes; None for Avro)."""
    head = struct.pack(">bI", MAGIC, schema_id)
    return head + (message_indexes(indexes) if indexes is not None else b"") + payload


def unframe(value: bytes | None, protobuf: bool = False) -> tuple[int, tuple[int, ...] | None, bytes]:
    """(schema id, message indexes or None, payload) of a record value; ``WireError`` naming what is wrong."""
    if value is None:
        raise WireError("wire format: the record has no value")
    if len(value) < 5:
        raise WireError(f"wire format: truncated: {len(value)} bytes, fewer than the 5 of the magic byte and "
                        f"schema id")
    if value[0] != MAGIC:
        raise WireError(f"wire format: magic byte {value[0]}, expected {MAGIC} (not a Schema Registry record)")
    schema_id = struct.unpack(">I", value[1:5])[0]
    pos, indexes = 5, None
    if protobuf:
        count, pos = _read_varint(value, pos)
        count = _unzigzag(count)
        if count == 0:
            indexes = (0,)
        elif count < 0 or count > 100:
            raise WireError(f"wire format: {count} message indexes")
        else:
            found = []
            for _ in range(count):
                i, pos = _read_varint(value, pos)
                found.append(_unzigzag(i))
            indexes = tuple(found)
    return schema_id, indexes, value[pos:]

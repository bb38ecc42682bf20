"""Dead letters: what a decoding or validation step could not use, with where it came from and why.

Every such transform in ``connectors`` has a second output, tagged ``errs``, of ``DeadLetter``s.
Nothing is dropped silently: ``in = out + dead letters``. Two sinks write them out.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import uuid
from collections.abc import Sequence
from typing import Any

import apache_beam as beam
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems
from apache_beam.transforms.window import GlobalWindow
from apache_beam.utils.windowed_value import WindowedValue

from connectors.kafka import KafkaRecord, WriteToKafka, record_size, topic_max_message_bytes, value_budget
from connectors.paths import absolute_path, is_local_path
from connectors.rows import DeadLetter  # the Beam-free record (also importable from here)
from connectors.spill import remove_spill

__all__ = ["DeadLetter", "ERRS", "WriteDeadLettersToKafka", "WriteDeadLettersToJsonl",
           "dead_letter_to_json", "dead_letter_record", "dead_letter_from_record", "MAX_REASON_CHARS",
           "PARTS_SUFFIX", "reason_kind"]

#: Output tag of every decoding / validation transform's dead letters.
ERRS = "errs"


#: The longest kind (``reason_kind``) a reason is counted under.
MAX_KIND_CHARS = 200
_NAMED = re.compile(r"(?:field|column) (?:'[^']*'|\"[^\"]*\")")


def reason_kind(reason: str) -> str:
    """The kind a dead letter's reason is counted under (by-reason counts, metrics, the status page): the
    text before its first ``": "``, with the field or column it names, so that a message holding
    positions or values is not a kind of its own: ``broken JSON: Expecting ',' delimiter: line 1 column
    14 (char 13)`` -> ``broken JSON``; ``wrong type: field 'dep_time' is not an ISO time ('x')`` ->
    ``wrong type: field 'dep_time'``. A reason without ``": "`` is its own kind. The dead letter itself
    keeps the whole message."""
    text = str(reason)
    head, sep, rest = text.partition(": ")
    if sep:
        named = _NAMED.match(rest)
        text = f"{head}: {named.group(0)}" if named else head
    return text if len(text) <= MAX_KIND_CHARS else text[:MAX_KIND_CHARS] + "..."


#: ``<dead-letter file>.parts-<id>/``: where bundles write their parts before the last step joins them.
PARTS_SUFFIX = ".parts-"
_RAW = CompressionTypes.UNCOMPRESSED
_COPY_BYTES = 8 << 20


def _payload_json(payload):
    if isinstance(payload, bytes):
        try:
            return {"text": payload.decode("utf-8")}
        except UnicodeDecodeError:
            return {"base64": base64.b64encode(payload).decode("ascii")}
    if isinstance(payload, str):
        return {"text": payload}
    try:
        json.dumps(payload, allow_nan=True, default=str)
        return {"json": payload}
    except (TypeError, ValueError):
        return {"text": repr(payload)}


def dead_letter_to_json(letter: DeadLetter) -> str:
    return json.dumps({"source": letter.source, "reason": letter.reason,
                       "payload": _payload_json(letter.payload)}, default=str)


class _WriteJsonlPartFn(beam.DoFn):
    """Dead letters -> one JSON-lines part file per bundle; emits the part's path when the bundle ends."""

    def __init__(self, parts_dir: str):
        self._dir = parts_dir

    def start_bundle(self):
        self._sink, self._path = None, None

    def process(self, letter: DeadLetter):
        if self._sink is None:
            self._path = FileSystems.join(self._dir, f"part-{uuid.uuid4().hex}.jsonl")
            self._sink = FileSystems.create(self._path, mime_type="text/plain", compression_type=_RAW)
        self._sink.write(dead_letter_to_json(letter).encode("utf-8") + b"\n")

    def finish_bundle(self):
        if self._sink is not None:
            self._sink.close()
            yield WindowedValue(self._path, GlobalWindow().max_timestamp(), [GlobalWindow()])
        self._sink = None


class _ConcatPartsFn(beam.DoFn):
    """Every part (in a stable order) into the one file, then the parts are deleted. Locally the
    file is written under a temporary name and renamed, so it appears whole."""

    def __init__(self, parts_dir: str, final_path: str):
        self._dir, self._final = parts_dir, final_path

    def process(self, parts: list):
        local = is_local_path(self._final)
        target = f"{self._final}.tmp-{uuid.uuid4().hex[:8]}" if local else self._final
        # the final name's suffix decides compression (.gz, ...), as WriteToText's did
        with FileSystems.create(target, mime_type="text/plain",
                                compression_type=CompressionTypes.detect_compression_type(self._final)) as out:
            for part in sorted(parts):
                with FileSystems.open(part, mime_type="text/plain", compression_type=_RAW) as fh:
                    while chunk := fh.read(_COPY_BYTES):
                        out.write(chunk)
        if local:
            os.replace(target, self._final)
        remove_spill(self._dir)  # a directory and all under it, any filesystem
        yield self._final


class WriteDeadLettersToJsonl(beam.PTransform):
    """One JSON object per line: ``{"source", "reason", "payload"}``.

    By default (``shard_name_template=""``) into the one file ``file_path_prefix + file_name_suffix``:
    each bundle writes its own part beside it (``<file>.parts-<id>/``), and a last step joins the
    parts into the file and deletes them, so no step gathers the dead letters in memory. Another
    ``shard_name_template`` writes sharded files with ``WriteToText``.

    The input may be one PCollection or a tuple of them (dead letters of several steps): each is
    written in the stage that makes it, where a ``Flatten`` first would make Beam's local runners
    hold every dead letter in memory.
    """

    def __init__(self, file_path_prefix: str, *, shard_name_template: str = "", file_name_suffix: str = ""):
        super().__init__()
        self._prefix, self._template, self._suffix = file_path_prefix, shard_name_template, file_name_suffix

    def expand(self, letters):
        many = isinstance(letters, (tuple, list))  # several PCollections: written each where it is made
        if self._template != "":
            if many:
                letters = letters | "Flatten" >> beam.Flatten()
            return (letters
                    | "ToJson" >> beam.Map(dead_letter_to_json)
                    | "Write" >> beam.io.WriteToText(self._prefix, shard_name_template=self._template,
                                                     file_name_suffix=self._suffix))
        final = absolute_path(self._prefix + self._suffix)
        parts_dir = f"{final}{PARTS_SUFFIX}{uuid.uuid4().hex[:12]}"
        parts = [pc | f"WriteParts{i if many else ''}" >> beam.ParDo(_WriteJsonlPartFn(parts_dir))
                 for i, pc in enumerate(letters if many else [letters])]
        if many:
            parts = parts | "Parts" >> beam.Flatten()
        else:
            parts = parts[0]
        return (parts
                | "AllParts" >> beam.combiners.ToList()
                | "JoinParts" >> beam.ParDo(_ConcatPartsFn(parts_dir, final)))


# --------------------------------------------------------------------------------------------
# The one Kafka wire format of a dead letter
# --------------------------------------------------------------------------------------------
#: A reason (or source) longer than this is cut: a reason is words for a user, not a payload.
MAX_REASON_CHARS = 4096


def _payload_bytes(payload) -> tuple[bytes, str]:
    """(bytes, format): bytes as they are, text as UTF-8, anything else as JSON."""
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return bytes(payload), "bytes"
    if payload is None:
        return b"", "none"
    if isinstance(payload, str):
        return payload.encode("utf-8", errors="surrogateescape"), "text"
    return json.dumps(payload, default=str, allow_nan=True).encode("utf-8"), "json"


def _cut(text: str, limit: int = MAX_REASON_CHARS) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def dead_letter_record(letter: DeadLetter, *, max_bytes: int | None = None) -> tuple[bytes, bytes, list]:
    """``(key, value, headers)`` of a dead letter on Kafka (what ``WriteDeadLettersToKafka`` and the
    stream pipeline produce; ``dead_letter_from_record`` reads it back).

    key = source; value = the payload (bytes as they are, text as UTF-8, anything else as JSON);
    headers ``source``, ``reason``, ``payload_format`` (bytes | text | json | none). A record
    that would not fit ``max_bytes`` (the topic's ``max.message.bytes``) keeps its source and
    reason and the start of its payload, with headers ``payload_truncated`` = ``true``,
    ``payload_size`` (the original size in bytes) and ``payload_sha256`` (of the original).
    """
    source, reason = _cut(str(letter.source), 1024), _cut(str(letter.reason))
    value, fmt = _payload_bytes(letter.payload)
    key = source.encode("utf-8", errors="replace")
    headers = [("source", key), ("reason", reason.encode("utf-8", errors="replace")),
               ("payload_format", fmt.encode())]
    if max_bytes is not None and record_size(key, value, headers) > max_bytes:
        extra = [("payload_truncated", b"true"), ("payload_size", str(len(value)).encode()),
                 ("payload_sha256", hashlib.sha256(value).hexdigest().encode())]
        headers += extra
        keep = value_budget(max_bytes, key, headers)
        if keep < 0:
            raise ValueError(f"a dead letter's source and reason alone do not fit {max_bytes:,} bytes")
        value = value[:keep]
    return key, value, headers


def dead_letter_from_record(value: bytes | None, headers) -> tuple[DeadLetter, dict]:
    """A dead letter read back from its Kafka record, and its truncation facts (``{}`` when whole:
    else ``{"truncated": True, "size": original bytes, "sha256": hex}``)."""
    h = {k: v for k, v in (headers or ())}
    fmt = h.get("payload_format", b"bytes").decode()
    value = value or b""
    info = {}
    if h.get("payload_truncated") == b"true":
        info = {"truncated": True, "size": int(h["payload_size"]), "sha256": h["payload_sha256"].decode()}
    payload: Any = value
    if not info:
        if fmt == "text":
            payload = value.decode("utf-8", errors="surrogateescape")
        elif fmt == "json":
            payload = json.loads(value)
        elif fmt == "none":
            payload = None
    return DeadLetter(payload, h.get("source", b"").decode("utf-8", errors="replace"),
                      h.get("reason", b"").decode("utf-8", errors="replace")), info


class _DeadLetterRecordFn(beam.DoFn):
    """DeadLetter -> KafkaRecord in the one wire format, fitted to the topic's max.message.bytes."""

    def __init__(self, bootstrap_servers, topic, client_config):
        self._bootstrap, self._topic, self._client_config = bootstrap_servers, topic, client_config
        self._max = None

    def setup(self):
        self._max = topic_max_message_bytes(self._bootstrap, self._topic, client_config=self._client_config)

    def process(self, letter: DeadLetter):
        key, value, headers = dead_letter_record(letter, max_bytes=self._max)
        yield KafkaRecord(self._topic, -1, -1, None, key, value, tuple(headers))


class WriteDeadLettersToKafka(beam.PTransform):
    """To a dead-letter topic in the one wire format of ``dead_letter_record``: the raw payload as
    value, ``source``, ``reason`` and ``payload_format`` as headers; a payload too large for the
    topic is truncated (its original size and SHA-256 in headers), never lost with its reason.
    Every record is confirmed by Kafka before the bundle completes (``WriteToKafka``)."""

    def __init__(self, bootstrap_servers: str | Sequence[str], topic: str, **write_kwargs):
        super().__init__()
        self._bootstrap, self._topic, self._kwargs = bootstrap_servers, topic, write_kwargs

    def expand(self, letters):
        security = {k: v for k, v in (self._kwargs.get("producer_config") or {}).items()
                    if k.startswith(("security_", "ssl_", "sasl_"))}
        return (letters
                | "ToRecord" >> beam.ParDo(_DeadLetterRecordFn(self._bootstrap, self._topic, security))
                | "Produce" >> WriteToKafka(self._bootstrap, self._topic, **self._kwargs))

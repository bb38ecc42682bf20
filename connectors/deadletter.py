"""Dead letters: what a decoding or validation step could not use, with where it came from and why.

Every such transform in ``connectors`` has a second output, tagged ``errs``, of ``DeadLetter``s.
Nothing is dropped silently: ``in = out + dead letters``. Two sinks write them out: ``WriteDeadLettersToJsonl``
here, and ``connectors.kafka.WriteDeadLettersToKafka`` in the one Kafka wire format (``connectors.kafka.deadletters``:
this module imports no Kafka client, so a batch job or ``flowtrain predict`` does not load one).
"""
from __future__ import annotations

import base64
import json
import os
import re
import uuid

import apache_beam as beam
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems
from apache_beam.transforms.window import GlobalWindow
from apache_beam.utils.windowed_value import WindowedValue

from connectors.paths import absolute_path, is_local_path
from connectors.rows import DeadLetter  # the Beam-free record (also importable from here)
from connectors.spill import remove_spill

__all__ = ["DeadLetter", "ERRS", "WriteDeadLettersToJsonl", "dead_letter_to_json", "PARTS_SUFFIX", "reason_kind"]

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

"""Dead letters: what a decoding or validation step could not use, with where it came from and why.

Every such transform in ``connectors`` has a second output, tagged ``errs``, of ``DeadLetter``s.
Nothing is dropped silently: ``in = out + dead letters``. Two sinks write them out.
"""
from __future__ import annotations

import base64
import json
from typing import Any, NamedTuple, Sequence

import apache_beam as beam

__all__ = ["DeadLetter", "ERRS", "WriteDeadLettersToKafka", "WriteDeadLettersToJsonl",
           "dead_letter_to_json"]

#: Output tag of every decoding / validation transform's dead letters.
ERRS = "errs"


class DeadLetter(NamedTuple):
    payload: Any  # the raw input: bytes, str or a JSON-able row
    source: str  # "topic/partition/offset" or "file:row"
    reason: str  # why it was rejected, in words a user can act on


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


class WriteDeadLettersToJsonl(beam.PTransform):
    """One JSON object per line: ``{"source", "reason", "payload"}``."""

    def __init__(self, file_path_prefix: str, *, shard_name_template: str = "", file_name_suffix: str = ""):
        super().__init__()
        self._prefix, self._template, self._suffix = file_path_prefix, shard_name_template, file_name_suffix

    def expand(self, letters):
        return (letters
                | "ToJson" >> beam.Map(dead_letter_to_json)
                | "Write" >> beam.io.WriteToText(self._prefix, shard_name_template=self._template,
                                                 file_name_suffix=self._suffix))


class WriteDeadLettersToKafka(beam.PTransform):
    """To a dead-letter topic: the raw payload as value, ``source`` and ``reason`` as headers."""

    def __init__(self, bootstrap_servers: str | Sequence[str], topic: str, **write_kwargs):
        super().__init__()
        self._bootstrap, self._topic, self._kwargs = bootstrap_servers, topic, write_kwargs

    def expand(self, letters):
        from connectors.kafka import KafkaRecord, WriteToKafka

        def to_record(letter: DeadLetter) -> KafkaRecord:
            payload = letter.payload
            if isinstance(payload, str):
                payload = payload.encode("utf-8")
            elif not isinstance(payload, bytes):
                payload = json.dumps(payload, default=str).encode("utf-8")
            return KafkaRecord(self._topic, -1, -1, None, letter.source.encode("utf-8"), payload,
                               (("source", letter.source.encode("utf-8")),
                                ("reason", letter.reason.encode("utf-8"))))

        return (letters | "ToRecord" >> beam.Map(to_record)
                | "Produce" >> WriteToKafka(self._bootstrap, self._topic, **self._kwargs))

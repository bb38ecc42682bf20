"""Event formats of the raw topic: JSON, Avro and Protobuf (``--event-format``), each with or without a
Schema Registry (``--schema-registry URL``: the Confluent wire format, ``formats.wire``).

    fmt = event_format("avro", events, registry=SchemaRegistry(url), subject="sensors-raw-value")
    value = fmt.encode(event_dict)                         # the producer's side (flowtrain replay)
    table, dead_letters = fmt.decode(payloads, sources, bounds)   # the pipeline's and the scorer's side

``decode`` gives what ``pipelines.stream.parse.parse_batch`` gives for JSON (it *is* ``parse_batch`` for
JSON): the events table of the dataset's fields in payload order, and a ``DeadLetter`` with its reason for
every payload that is not an event, never an exception. Avro and Protobuf payloads are decoded with the
*writer's* schema (the registry's by the record's schema id; else ``--schema-file``, else the dataset's
own) and resolved to the dataset's fields by name: a field the writer added is ignored, one it removed
that the dataset does not need is null, an integer is widened to the dataset's number; a schema that
lacks a field the dataset needs makes its events dead letters naming the field.
"""
from __future__ import annotations

from pipelines.stream.formats.avro import AvroFormat
from pipelines.stream.formats.base import EventFormat
from pipelines.stream.formats.codecs import FORMATS, JsonFormat, event_format
from pipelines.stream.formats.protobuf import ProtobufFormat
from pipelines.stream.formats.registry import RegistryError, RegistryUnavailable, SchemaRegistry, wait_for_registry
from pipelines.stream.formats.schemas import avro_schema, fields_of_avro, fields_of_proto, proto_text
from pipelines.stream.formats.wire import WireError, frame, unframe

__all__ = ["FORMATS", "AvroFormat", "EventFormat", "JsonFormat", "ProtobufFormat", "event_format", "SchemaRegistry",
           "RegistryError", "RegistryUnavailable", "wait_for_registry", "avro_schema", "fields_of_avro", "fields_of_proto", "proto_text",
           "WireError", "frame", "unframe"]

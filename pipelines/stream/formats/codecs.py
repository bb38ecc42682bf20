"""The event formats by name (``FORMATS``: ``--event-format``; ``event_format`` makes one) and JSON's (see the
package doc). A new format: a module of this package with its ``EventFormat``, and its entry in ``FORMATS``."""
from __future__ import annotations

import json

from connectors.avro_schema import AvroSchemaError, check_avro_schema
from pipelines.stream.events import DEFAULT_BOUNDS, EventSchema, ParseBounds
from pipelines.stream.formats.avro import AvroFormat
from pipelines.stream.formats.base import EventFormat
from pipelines.stream.formats.protobuf import ProtobufFormat
from pipelines.stream.formats.registry import SchemaRegistry
from pipelines.stream.formats.schemas import (
    fields_of_avro,
    fields_of_proto,
)
from pipelines.stream.parse import foreign_keys, parse_batch


class JsonFormat(EventFormat):
    """JSON objects keyed by field name: ``parse_batch``, unchanged."""

    name = "json"

    def __init__(self, events: EventSchema, *, schema_text: str | None = None, registry: SchemaRegistry | None = None,
                 subject: str | None = None, record: str = "Event"):
        if registry is not None or schema_text is not None:
            raise ValueError("--event-format json takes no --schema-registry or --schema-file (JSON events are "
                             "objects keyed by column name); use --event-format avro or protobuf")
        super().__init__(events, record=record)

    def dataset_schema_text(self) -> str:
        return ""

    def encode(self, event: dict) -> bytes:
        return json.dumps(event).encode()

    def decode(self, payloads, sources, bounds: ParseBounds = DEFAULT_BOUNDS):
        return parse_batch(payloads, sources, self.events, bounds)

    def foreign_keys(self, payloads):
        return foreign_keys(payloads, self.events)


#: ``--event-format`` choices.
FORMATS: dict[str, type[EventFormat]] = {"json": JsonFormat, "avro": AvroFormat, "protobuf": ProtobufFormat}


def event_format(name: str, events: EventSchema, *, schema_file: str | None = None, registry: str | None = None,
                 subject: str | None = None, record: str = "Event") -> EventFormat:
    """The format ``name`` for these event fields; ``schema_file``: the writer's schema (an ``.avsc`` / ``.proto``
    file); ``registry``: the registry's URL (the Confluent wire format); ``subject``: where a producer registers."""
    if name not in FORMATS:
        raise ValueError(f"--event-format {name!r}: expected one of {', '.join(FORMATS)}")
    text = None
    if schema_file:
        try:
            with open(schema_file, encoding="utf-8") as fh:
                text = fh.read()
        except OSError as err:
            raise ValueError(f"--schema-file {schema_file}: {err.strerror or err}") from None
    client = SchemaRegistry(registry) if registry else None
    fmt = FORMATS[name](events, schema_text=text, registry=client, subject=subject, record=record)
    if text is not None:  # a schema file that does not parse: one line now, not a dead letter per event
        try:
            if name == "avro":
                check_avro_schema(json.loads(text))  # before any value of it is encoded or decoded
            fields_of_avro(text) if name == "avro" else fields_of_proto(text)
        except AvroSchemaError as err:
            raise ValueError(f"--schema-file {schema_file}: refused: the Avro schema {err}") from None
        except RecursionError:
            raise ValueError(f"--schema-file {schema_file}: nested too deeply to be read (a table's schema is "
                             f"flat)") from None
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"--schema-file {schema_file}: not a {name} schema of a record ({err})") from None
    return fmt

"""The feature pipeline's options and the raw events' options, declared once next to the engine that reads them
(``connectors.fields``: each field is a flag, a ``--config`` key and a ``config.json`` key, with its default, range
and help).

- ``ParseBounds``: the limits on one raw event (size, JSON nesting, number magnitude); an event beyond one is a
  dead letter naming the bound (``pipelines.stream.events``).
- ``EventOptions``: how raw events are read, by the feature pipeline and by the scorer: the parse bounds, the
  event format, its schema registry or file, the enrichment.
- ``PipelineOptions``: the feature pipeline's micro-batches and reader.

``flowtrain stream``'s jobs (``flowtrain.commands.stream.options``) compose them, and the engine's
``pipelines.stream.pipeline.StreamConfig`` is them plus what the command resolves (brokers, topics, the dataset's
spec and statistics, the enrichment's factory, Kafka client settings). Stdlib only (no Beam, no pyarrow):
``flowtrain --help`` imports this.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from connectors.fields import COMPOSED, above, at_least, check_value, option, options_of
from pipelines.features.options import StreamFeatureOptions

#: Kafka clients (``--client``, ``--read-client``; the first is the default): the values of
#: ``connectors.kafka.CLIENTS``, written here so that ``flowtrain --help`` does not import Beam.
CLIENTS = ("kafka-python", "confluent")
#: The raw topic read in lists of up to this many records (ReadFromKafka(batch_records=N): Beam's per-element cost once
#: per list): the feature pipeline's ``--read-batch-records`` default, and the scorer's read.
DEFAULT_READ_BATCH_RECORDS = 2000
#: ``--event-format`` (``pipelines.stream.formats.FORMATS``).
EVENT_FORMATS = ("json", "avro", "protobuf")

#: --help sections (``option(..., group=...)``).
PIPELINE = "feature pipeline (`stream pipeline`)"
EVENTS = "raw events (feature pipeline and scorer)"


@dataclass
class MaxEventBytes:
    """``--max-event-bytes``: the largest raw event, the stream's parse bound (``ParseBounds``, section events) and what
    ``flowtrain replay --malformed`` makes events 'too large' beyond."""

    SECTION: ClassVar[str] = COMPOSED
    max_event_bytes: int | None = option(1048576, "a raw event larger than this is a dead letter", parse=at_least(1),
                                         group=EVENTS)


@dataclass
class ParseBounds(MaxEventBytes):
    """Limits on one raw event; an event beyond one is a dead letter naming the bound.

    The defaults are far above a typical event (~300 bytes, depth 1, numbers < 10^5) and far
    below what hurts: a 1 MiB event, 32 levels of JSON, and numbers exact in a float64.
    """

    SECTION: ClassVar[str] = "events"  # --config's section (connectors.sections): events: {max_event_bytes: 4096}
    max_json_depth: int = option(32, "a raw event nesting objects/arrays deeper than this is a dead letter",
                                 parse=at_least(1), group=EVENTS)
    max_abs_number: float = option(9007199254740992.0, "a raw event with a number beyond +-this is a dead letter",
                                   parse=above(0), group=EVENTS)

    def __post_init__(self):
        check_bounds(self)


def check_bounds(options: Any) -> None:
    """The parse bounds of ``options`` (a ``ParseBounds`` or any options holding them) checked as the command line
    checks them; an ``OptionError`` naming the bound."""
    for opt in options_of(ParseBounds):
        check_value(opt, getattr(options, opt.name))


def parse_bounds(options: Any) -> ParseBounds:
    """The ``ParseBounds`` of ``options`` (``EventOptions``, a job or an engine config holding them): the one
    place the bounds are taken from the options."""
    if type(options) is ParseBounds:
        return options
    return ParseBounds(**{opt.name: getattr(options, opt.name) for opt in options_of(ParseBounds)})


DEFAULT_BOUNDS = ParseBounds()


# --- how events are written: the stream's and the scorer's (section events), `flowtrain replay`'s and `flowtrain
# predictions`' (the schema registry of the predictions) too; each declared once ------------------------------------
@dataclass
class EventFormat:
    """``--event-format``."""

    SECTION: ClassVar[str] = COMPOSED
    event_format: str = option(
        "json", "how raw events are written: json (objects keyed by column name), avro or protobuf (the dataset's "
                "schema: `flowtrain schema`; decoded with the writer's schema and resolved by field name)",
        choices=EVENT_FORMATS, group=EVENTS)


@dataclass
class SchemaRegistryOption:
    """``--schema-registry``."""

    SECTION: ClassVar[str] = COMPOSED
    schema_registry: str | None = option(
        None, "a Confluent-compatible Schema Registry (Apicurio: http://HOST:PORT/apis/ccompat/v7): avro/protobuf "
              "events in its wire format, writers' schemas fetched by id (default: none)", metavar="URL",
        group=EVENTS)


@dataclass
class SchemaFile:
    """``--schema-file``."""

    SECTION: ClassVar[str] = COMPOSED
    schema_file: str | None = option(
        None, "without --schema-registry: the writers' schema, an .avsc or .proto file (default: the dataset's own)",
        metavar="FILE", group=EVENTS)


@dataclass
class EventOptions(SchemaFile, SchemaRegistryOption, EventFormat, StreamFeatureOptions, ParseBounds):
    """How raw events are read: by the feature pipeline and by the scorer (the parse bounds, features over time:
    ``--aggregate``, ``--join``, ``--allowed-lateness``, then these)."""

    SECTION: ClassVar[str] = "events"
    enrichment: str = option(
        "auto", "a domain's reference-data step before the features: auto (the enrichment of the dataset's preset, "
                "e.g. the demo's weather and planes join; none for your own files; default), none, or the name of a "
                "dataset preset (docs/presets.md)", group=EVENTS)


@dataclass
class PipelineOptions:
    """The feature pipeline's micro-batches and reader."""

    SECTION: ClassVar[str] = "pipeline"
    # 500 cost 2x the CPU per event in parse + featurize + train (bench stream)
    batch_size: int = option(2000, "events per micro-batch (closed by size ...)", parse=at_least(1), group=PIPELINE)
    max_delay: float = option(1.0, "... or by this many seconds after its first event", parse=above(0),
                              group=PIPELINE)
    # N: one list of up to N records per fetched chunk (Beam's per-element cost once per chunk, needed for ~10k
    # events/s on 2 cores); None (the Python API only): ReadFromKafka's per-record elements, taken alike
    read_batch_records: int | None = option(
        DEFAULT_READ_BATCH_RECORDS, "read the raw topic in lists of up to N records per fetched chunk (ReadFromKafka(batch_records=N)) "
              "instead of one element per record", parse=at_least(1), group=PIPELINE)
    read_client: str = option("kafka-python", "Kafka client of the raw topic's reader (confluent: the extra "
                                              "flowtrain[kafka-confluent])", choices=CLIENTS, group=PIPELINE)

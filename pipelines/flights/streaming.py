"""The flights stream: the generic stream pipeline (``pipelines.stream``) plus the flights' enrichment.

A flight event carries the raw flight columns (``FLIGHT_EVENTS``); ``FlightEnrichment`` joins
the weather at the origin in the scheduled hour and the plane by tail number, derives the
schedule and calendar columns (``join_reference``, the batch ETL's own join) and adds the
flights' impossible-value checks. Everything else (parsing, validation, featurizing with the
batch ETL's code, micro-batching, delivery, commits) is the generic stream's.

The reference tables are read through Beam's ``FileSystems`` (any registered filesystem:
``gs://``, ``s3://``, ...) once per DoFn instance (``FlightReference``, a picklable factory
called in the DoFn's ``setup``) rather than as side inputs: Beam 2.77 could not translate the
fused DoFn's form with a side input, and a side input would break the fusion with the read that
keeps a partition's flushes in order.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from connectors.deadletter import DeadLetter
from pipelines.flights import features as FF
from pipelines.flights.events import FLIGHT_EVENTS
from pipelines.stream.events import EventSchema
from pipelines.stream.featurize import EventFeatures, StreamFeaturizer
from pipelines.stream.pipeline import KAFKA_DEFAULT_MAX_MESSAGE_BYTES, StreamConfig
from pipelines.stream.steps import MicroBatcher, ParsedEvent, featurize_events

__all__ = ["FlightEnrichment", "FlightReference", "FlightFeaturizer", "flights_featurizer", "flights_stream_config",
           "load_reference_tables", "read_table", "MicroBatcher", "StreamConfig",
           "KAFKA_DEFAULT_MAX_MESSAGE_BYTES"]


def read_table(path: str) -> pa.Table:
    """A Parquet file through Beam's FileSystems (local, gs://, s3://, any registered scheme)."""
    from apache_beam.io.filesystem import CompressionTypes
    from apache_beam.io.filesystems import FileSystems

    try:
        with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as fh:
            data = fh.read()
    except Exception as err:  # noqa: BLE001 - BeamIOError, OSError, a filesystem's own errors
        raise FileNotFoundError(f"stream pipeline: cannot read reference table {path!r} "
                                f"({type(err).__name__}: {err})") from err
    return pq.read_table(pa.BufferReader(data))


def load_reference_tables(weather_path: str, planes_path: str) -> tuple[pa.Table, pa.Table]:
    """The prepared weather and planes tables the features join, read through FileSystems."""
    return FF.prepare_weather(read_table(weather_path)), FF.prepare_planes(read_table(planes_path))


class FlightEnrichment:
    """The flights' step of the generic stream: weather + planes join, derived columns, checks."""

    events: EventSchema = FLIGHT_EVENTS

    def __init__(self, weather: pa.Table, planes: pa.Table):
        self.weather, self.planes = weather, planes

    def enrich(self, table: pa.Table) -> pa.Table:
        return FF.join_reference(table, self.weather, self.planes)

    def checks(self, batch: pa.RecordBatch) -> list[tuple[str, np.ndarray]]:
        return FF.impossible_values(batch)


@dataclass(frozen=True)
class FlightReference:
    """A picklable ``StreamConfig.enrichment_factory``: loads the reference tables where it is called."""

    weather_path: str
    planes_path: str

    def __call__(self) -> FlightEnrichment:
        return FlightEnrichment(*load_reference_tables(self.weather_path, self.planes_path))


def flights_featurizer(stats: dict, weather_path: str, planes_path: str, spec=FF.FLIGHTS_SPEC) -> StreamFeaturizer:
    """The generic featurizer with the flights' enrichment (a flights dataset's stats)."""
    return StreamFeaturizer(spec, stats, FlightReference(weather_path, planes_path)())


def flights_stream_config(*, stats: dict, weather_path: str, planes_path: str, spec: dict | None = None,
                          **fields) -> StreamConfig:
    """A ``StreamConfig`` of the flights stream (``spec``: the dataset's; default the flights spec)."""
    return StreamConfig(spec=spec or FF.FLIGHTS_SPEC.to_dict(), stats=stats,
                        enrichment_factory=FlightReference(weather_path, planes_path), **fields)


#: What the flights stream called an arrival delay that is missing before events became label-optional.
NO_ARRIVAL = "cancelled or diverted: no arrival delay"


class FlightFeaturizer:
    """Flight events -> (training features or None, dead letters): the generic featurizer with
    the flights' enrichment, for callers that want training rows only. A flight without an
    arrival delay is a dead letter here (``NO_ARRIVAL``), as the batch ETL has it; use
    ``self.stream`` (``StreamFeaturizer``) to score such flights instead."""

    def __init__(self, stats: dict, weather: pa.Table, planes: pa.Table):
        self.stats = stats
        self.stream = StreamFeaturizer(FF.FLIGHTS_SPEC, stats, FlightEnrichment(weather, planes))

    @classmethod
    def load(cls, stats: dict, weather_path: str, planes_path: str) -> FlightFeaturizer:
        return cls(stats, *load_reference_tables(weather_path, planes_path))

    def featurize(self, events: list[ParsedEvent]) -> tuple[pa.RecordBatch | None, list[DeadLetter]]:
        return self._training(featurize_events(self.stream, events))

    def featurize_table(self, table: pa.Table | None) -> tuple[pa.RecordBatch | None, list[DeadLetter]]:
        """An events table (``parse_batch``) -> (training features or None, dead letters)."""
        return self._training(self.stream.featurize_table(table))

    @staticmethod
    def _training(out: EventFeatures) -> tuple[pa.RecordBatch | None, list[DeadLetter]]:
        letters = list(out.training_dead_letters)
        if out.features is not None and out.unlabelled:
            trainable = set(np.flatnonzero(out.trainable).tolist())
            unseen = {d.source for d in out.unseen_class}
            rows = out.features.to_pylist()
            letters += [DeadLetter({k: v for k, v in r.items() if k != "label"}, r["source"], NO_ARRIVAL)
                        for i, r in enumerate(rows) if i not in trainable and r["source"] not in unseen]
        return out.training(), letters

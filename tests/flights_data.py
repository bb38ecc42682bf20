"""A small, real flights dataset for the tests that need one."""
from __future__ import annotations


def make_flights_dataset(base, *, every: int) -> str:
    """The flights ETL on every ``every``-th flight (all months), written under ``base``; returns
    the dataset directory. Shared by the tests that need a real, small dataset."""
    from pathlib import Path

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from flowtrain.local.paths import cache_root
    from flowtrain.local.runners import pipeline_options
    from pipelines.flights.batch import run_flights_etl
    from pipelines.flights.preset import FLIGHTS

    base = Path(base)
    tables = FLIGHTS.demo_inputs(cache_root())
    flights = pq.read_table(tables["flights"])
    pq.write_table(flights.take(pa.array(np.arange(0, flights.num_rows, every))), base / "flights.parquet")
    run_flights_etl(dataset_path=str(base / "ds"), dead_letters_path=None, options=pipeline_options("batch"),
                    tables={**tables, "flights": str(base / "flights.parquet")})
    return str(base / "ds")

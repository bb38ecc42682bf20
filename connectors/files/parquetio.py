"""Parquet files, one unit per row group (``units.list_units``): a runner reads the row groups of one file in
parallel. ``ReadFromParquet`` reads them in Beam (``ReadFromFiles`` too, by the file name). Columns keep the file's
types; declared types then apply (a value that does not fit rejects its row); ``_source_row`` is the row's index.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

import pyarrow.parquet as pq

from connectors.files.units import FileUnit, ReadUnits, ReadUnitsFn, numbered

__all__ = ["ReadFromParquet", "read_parquet"]


def read_parquet(fh, unit: FileUnit, *, columns: Sequence[str] | None = None, batch_rows: int = 65_536,
                 **_) -> Iterator[tuple]:
    """The reader of a Parquet unit (``units.Reader``): the rows of its row group, numbered in the file."""
    return numbered(unit, pq.ParquetFile(fh).iter_batches(batch_size=batch_rows, row_groups=[unit.row_group],
                                                           columns=list(columns) if columns else None))


class _ReadParquetFn(ReadUnitsFn):
    reader = staticmethod(read_parquet)


class ReadFromParquet(ReadUnits):
    """Parquet files as ``pyarrow.RecordBatch``es, a row group at a time (the options of ``units.ReadUnits``)."""

    read_fn = _ReadParquetFn
    fixed_format = "parquet"

"""``flowtrain.batch(input=df, ...)``: a pandas DataFrame or a pyarrow Table as the batch job's input, written as
one Parquet file that the ETL reads like any other (its rows named ``dataframe.parquet:<row>`` in dead letters;
a random split hashes that name, so the same frame splits the same way in every run)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa

from flowtrain.errors import FlowtrainError

__all__ = ["FRAME_FILE", "is_frame", "check_paths", "write_frame"]

#: The file a frame is written to (in a temporary directory of the call).
FRAME_FILE = "dataframe.parquet"


def write_frame(frame: Any, directory: str | Path) -> str:
    """``frame`` (a pandas DataFrame, a pyarrow Table or RecordBatch) as ``directory/dataframe.parquet``; its
    path. A frame that Arrow cannot hold (a column of Python objects of mixed types) is one line naming it."""
    import pyarrow.parquet as pq

    try:
        if isinstance(frame, pa.RecordBatch):
            table = pa.Table.from_batches([frame])
        elif isinstance(frame, pa.Table):
            table = frame
        else:
            table = pa.Table.from_pandas(frame, preserve_index=False)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as err:
        raise FlowtrainError(f"input: the DataFrame cannot be read as a table ({str(err).splitlines()[0][:300]}); "
                             f"give each column one type") from None
    if table.num_rows == 0:
        raise FlowtrainError("input: the DataFrame has no rows")
    path = Path(directory) / FRAME_FILE
    pq.write_table(table, path)
    return str(path)


def is_frame(value: Any) -> bool:
    """A pandas DataFrame, a pyarrow Table or RecordBatch (told by type, without importing pandas)."""
    kind = type(value)
    return (kind.__module__.startswith("pandas") and kind.__name__ == "DataFrame") or \
        (kind.__module__.startswith("pyarrow") and kind.__name__ in ("Table", "RecordBatch"))


def check_paths(value: Any) -> None:
    """``input=`` must be paths (or globs) when it is no frame: anything else is one line naming its type, never
    printing its contents."""
    if value is None or isinstance(value, str) or hasattr(value, "__fspath__"):
        return
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) or hasattr(v, "__fspath__") for v in value):
        return
    raise FlowtrainError(f"input: expected files or globs (a path, or a list of them), a pandas DataFrame or a "
                         f"pyarrow Table, not a {type(value).__module__}.{type(value).__name__}")

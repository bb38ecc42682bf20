"""Reading the columns of a record batch: numbers as float64 (text that is no number becomes NaN,
never an exception) and each row's source (``file:row``), for the rest of the tabular feature code."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from connectors.dataset_spec import SOURCE
from connectors.rows import SOURCE_FILE, SOURCE_ROW, parse_numbers


def source_strings(batch: pa.RecordBatch) -> pa.Array:
    """``file:row`` for each row (the reader's source columns), or an existing ``source``."""
    if SOURCE in batch.schema.names:
        return batch.column(SOURCE)
    if SOURCE_FILE in batch.schema.names:
        return pc.binary_join_element_wise(batch.column(SOURCE_FILE),
                                           pc.cast(batch.column(SOURCE_ROW), pa.string()), ":")
    return pa.array([""] * batch.num_rows)


def as_float(col: pa.Array) -> pa.Array:
    """Numbers as float64; text that is not a number becomes NaN (never an exception)."""
    if pa.types.is_dictionary(col.type):
        col = col.cast(col.type.value_type)
    if pa.types.is_boolean(col.type):
        return pc.cast(col, pa.int8()).cast(pa.float64())
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        values, _ = parse_numbers(col)
        return values
    if pa.types.is_null(col.type):
        return pa.nulls(len(col), pa.float64())
    return pc.cast(col, pa.float64(), safe=False)


def floats(col: pa.Array) -> np.ndarray:
    """``as_float`` as a float64 numpy array."""
    return as_float(col).to_numpy(zero_copy_only=False).astype(np.float64, copy=False)

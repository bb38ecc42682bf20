"""What the connectors say about a row, without Beam: the source columns the file readers add, numbers parsed from
text as the readers parse them, and the ``DeadLetter`` of a row (or record) that cannot be used.

Beam's transforms that produce and write these live in ``connectors.files`` and ``connectors.deadletter``; the
feature code and a loaded bundle's ``predict`` (which runs no Beam pipeline) import only this module.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["SOURCE_FILE", "SOURCE_ROW", "DeadLetter", "parse_numbers"]

#: Columns added by ``with_source=True``: where each row came from (for dead letters).
SOURCE_FILE = "_source_file"
SOURCE_ROW = "_source_row"

_NUMBER = r"^[-+]?(\d+\.?\d*([eE][-+]?\d+)?|\.\d+([eE][-+]?\d+)?|(?i:inf|infinity|nan))$"


class DeadLetter(NamedTuple):
    payload: Any  # the raw input: bytes, str or a JSON-able row
    source: str  # "topic/partition/offset" or "file:row"
    reason: str  # why it was rejected, in words a user can act on


def parse_numbers(col: pa.Array) -> tuple[pa.Array, np.ndarray]:
    """Strings -> float64 and a mask of the non-null values that are not numbers (-> null)."""
    col = pc.utf8_trim_whitespace(col.cast(pa.string()))
    ok = pc.match_substring_regex(col, _NUMBER)
    values = pc.cast(pc.if_else(ok, col, pa.scalar(None, pa.string())), pa.float64())
    bad = np.asarray(pc.and_(pc.is_valid(col), pc.invert(pc.fill_null(ok, False))).to_numpy(zero_copy_only=False),
                     dtype=bool)
    return values, bad

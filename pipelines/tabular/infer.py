"""The feature columns of a table when none are declared: inferred from a bounded sample of its first rows, read
with the ETL's own readers (``preflight.file_head``), deterministically (the files in sorted order, their first
rows; no random sampling).

- numbers are numeric features; with a missing value in the sample, optional ones (a missing value becomes the
  training mean); integers that are all different (one per row) look like IDs and are left out;
- booleans and text with few distinct values are categorical;
- a column of dates or timestamps (typed so, or text that reads as times) is the time column the rows split by
  (the first one; others are left out), unless ``--time-column`` names one;
- text with many distinct values (names, ids, free text) is left out, and suggested as ``--id-columns``;
- a constant column, or one with no value at all, is left out;
- ``--exclude`` drops columns; ``--id-columns`` and ``--time-column`` take theirs as declared.

``infer_columns`` returns the choice (``Inferred``), which the batch job prints once and records in the dataset's
spec and manifest (``Inferred.as_dict``) and the report."""
from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from connectors.files import MAX_RECORD_BYTES
from pipelines.tabular.preflight import file_head, no_label
from pipelines.tabular.schema import SchemaError, column_kind
from pipelines.tabular.times import time_seconds

#: Rows read to infer the types: the first rows of the files, in order, up to this many (each file's head is at
#: most its first 4 MB or first row group).
SAMPLE_ROWS = 20_000
#: Text with at most this many distinct values in the sample is categorical ...
MAX_CATEGORIES = 50
#: ... or with at most this share of the sample's values distinct (a city of 6,000 customers); more is an ID.
MAX_CATEGORY_SHARE = 0.05
#: Integer columns with every value distinct in a sample of at least this many rows look like row ids.
MIN_ROWS_FOR_ID = 50


@dataclass
class Inferred:
    """The inferred roles of a table's columns (each list in the file's column order)."""

    numeric: list[str] = field(default_factory=list)
    optional_numeric: list[str] = field(default_factory=list)
    categorical: list[str] = field(default_factory=list)
    time_column: str | None = None
    #: high-cardinality columns left out that could be ``--id-columns``
    id_suggested: list[str] = field(default_factory=list)
    #: column -> why it is not a feature
    left_out: dict[str, str] = field(default_factory=dict)
    rows: int = 0
    files: list[str] = field(default_factory=list)

    @property
    def features(self) -> list[str]:
        return [*self.numeric, *self.optional_numeric, *self.categorical]

    def as_dict(self) -> dict:
        return asdict(self)

    def flags(self) -> str:
        """The choice as the flags that declare it (to change it, give them edited)."""
        parts = [(self.numeric, "--numeric"), (self.optional_numeric, "--optional-numeric"),
                 (self.categorical, "--categorical")]
        out = [f"{flag} {','.join(cols)}" for cols, flag in parts if cols]
        if self.time_column:
            out.append(f"--time-column {self.time_column}")
        return " ".join(out)

    def describe(self) -> str:
        """The lines the batch job prints once."""
        kinds = [(self.numeric, "numeric"), (self.optional_numeric, "numeric with missing values (optional)"),
                 (self.categorical, "categorical")]
        used = "; ".join(f"{kind} {', '.join(cols)}" for cols, kind in kinds if cols)
        lines = [f"columns: inferred from the first {self.rows:,} rows of {', '.join(self.files)} (no --numeric or "
                 f"--categorical given): {used}"]
        if self.time_column:
            lines.append(f"columns: time column {self.time_column} (the rows split by time; --time-column chooses)")
        if self.left_out:
            lines.append("columns: left out: " + "; ".join(f"{c} ({why})" for c, why in self.left_out.items()))
        if self.id_suggested:
            n = len(self.id_suggested)
            lines.append(f"columns: {', '.join(self.id_suggested)} look{'s' if n == 1 else ''} like {'an ID' if n == 1 else 'IDs'}: "
                         f"--id-columns "
                         f"{','.join(self.id_suggested)} gives {'it' if n == 1 else 'each'} an embedding table that grows with its values "
                         f"(docs/ids.md)")
        lines.append(f"columns: to choose yourself, give the flags: {self.flags()} (--exclude COL,... drops columns)")
        return "\n".join(lines)


def unknown_columns(given: Sequence[str], columns: Sequence[str], option: str, where: str) -> None:
    """Columns ``given`` to ``option`` that ``where`` does not have: a ``SchemaError`` naming them, the nearest
    name, and the file's columns."""
    missing = [c for c in given if c not in set(columns)]
    if missing:
        close = difflib.get_close_matches(missing[0], list(columns), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise SchemaError(f"{option} {','.join(missing)}: no such column in {where}{hint}; it has "
                          f"{', '.join(columns)}")


def sample(files: Sequence[str], *, max_rows: int = SAMPLE_ROWS,
           max_record_bytes: int = MAX_RECORD_BYTES) -> tuple[pa.Table, list[str]]:
    """The first rows of ``files`` (in order) up to ``max_rows``, as the ETL's readers type them; the files read."""
    tables, read, rows = [], [], 0
    for path in files:
        head = file_head(path, max_record_bytes)
        tables.append(head)
        read.append(path)
        rows += head.num_rows
        if rows >= max_rows:
            break
    try:
        table = pa.concat_tables(tables, promote_options="permissive") if len(tables) > 1 else tables[0]
    except (pa.ArrowInvalid, pa.ArrowTypeError):  # the files' heads type a column differently: the first decides
        table = tables[0]
    return table.slice(0, max_rows), read


def infer_columns(files: Sequence[str], label: str, *, exclude: Sequence[str] = (), id_columns: Sequence[str] = (),
                  time_column: str | None = None, max_rows: int = SAMPLE_ROWS,
                  max_record_bytes: int = MAX_RECORD_BYTES, weight_column: str | None = None) -> Inferred:
    """The feature columns of ``files`` (``label`` and the declared ``id_columns`` / ``time_column`` /
    ``weight_column`` (sample weights, never a feature) aside,
    ``exclude`` dropped), from their first rows. A name in ``exclude``, ``id_columns`` or ``time_column`` that
    is no column is a ``SchemaError`` listing the file's columns."""
    table, read = sample(files, max_rows=max_rows, max_record_bytes=max_record_bytes)
    columns = table.schema.names
    where = read[0] if len(read) == 1 else f"{read[0]} (and {len(read) - 1} more)"
    if label not in columns:  # as the ETL's own pre-flight says it
        raise SchemaError(no_label(label, where, columns))
    unknown_columns(exclude, columns, "--exclude", where)
    unknown_columns(id_columns, columns, "--id-columns", where)
    unknown_columns([time_column] if time_column else [], columns, "--time-column", where)
    unknown_columns([weight_column] if weight_column else [], columns, "--weight-column", where)
    out = Inferred(rows=table.num_rows, files=list(read), time_column=time_column)
    skip = {label, *exclude, *id_columns, *([time_column] if time_column else []),
            *([weight_column] if weight_column else [])}
    for name in columns:
        if name in skip or name.startswith("_"):  # the reader's own (``_source_file``...) never are features
            continue
        role, why = _role(table.column(name).combine_chunks(), table.num_rows)
        if role == "time" and out.time_column is None:
            out.time_column = name
        elif role == "time":
            out.left_out[name] = f"a time column; the rows split by {out.time_column}"
        elif role == "numeric":
            out.numeric.append(name)
        elif role == "optional":
            out.optional_numeric.append(name)
        elif role == "categorical":
            out.categorical.append(name)
        else:
            out.left_out[name] = why
            if role == "id":
                out.id_suggested.append(name)
    if not out.features:
        raise SchemaError(f"no feature column could be inferred from the first {table.num_rows:,} rows of {where} "
                          f"({'; '.join(f'{c}: {w}' for c, w in out.left_out.items()) or 'no column but the label'}); "
                          f"declare them with --numeric / --categorical (the file has {', '.join(columns)})")
    return out


def _role(col: pa.Array, rows: int) -> tuple[str, str]:
    """(role, why) of one column from its sample: numeric, optional, categorical, time, id or left."""
    kind = column_kind(col.type)
    values = pc.drop_null(col)
    n = len(values)
    if kind == "null" or n == 0:
        return "left", "no value in the sample"
    if kind == "string":
        values = pc.utf8_trim_whitespace(values)
        values = values.filter(pc.not_equal(values, ""))
        n = len(values)
        if n == 0:
            return "left", "no value in the sample"
    distinct = len(pc.unique(values))
    if distinct == 1:
        return "left", f"constant: {str(values[0].as_py())[:40]!r} in every row of the sample"
    if kind == "time":
        return "time", ""
    if kind == "boolean":
        return "categorical", ""
    if kind == "number":
        if pa.types.is_integer(col.type) and distinct == n and n >= MIN_ROWS_FOR_ID:
            return "id", f"{distinct:,} different integers, one per row: an ID"
        return ("optional", "") if col.null_count else ("numeric", "")
    if kind == "string":
        if _all_times(values):
            return "time", ""
        if distinct <= MAX_CATEGORIES or distinct <= MAX_CATEGORY_SHARE * n:
            return "categorical", ""
        return "id", f"text with {distinct:,} different values in {n:,} rows: too many for categories"
    return "left", f"values of type {col.type}, not a feature type"


def _all_times(values: pa.Array) -> bool:
    """Text whose every value reads as a date or a timestamp (ISO, YYYY/MM/DD), not as a plain number."""
    if not pc.all(pc.match_substring_regex(values, r"^\d{4}[-/]\d{1,2}[-/]\d{1,2}")).as_py():
        return False
    return bool(np.isfinite(time_seconds(values)).all())

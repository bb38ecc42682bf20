"""Pre-flight of the tabular ETL: the input files before the pipeline runs (the paths a pattern matches,
a file's first rows, the declared columns of every file, the task when none is given), and after it, the
check that no split of the dataset is empty (``SplitError`` naming why)."""
from __future__ import annotations

import dataclasses
import difflib
import io
import json
import os
from collections.abc import Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
from apache_beam.io.filesystems import FileSystems

from connectors.dataset_spec import SPLITS, FeatureSpec
from connectors.files import (
    CSV_NULLS,
    MAX_RECORD_BYTES,
    avro_head,
    check_avro_file,
    csv_header,
    file_format,
    read_csv_header,
    record_end,
)
from pipelines.tabular.schema import SchemaError, check_schema, column_kind
from pipelines.tabular.times import format_time, time_cutoff

_HEAD_BYTES = 4 << 20


def file_head(path: str, max_record_bytes: int = MAX_RECORD_BYTES) -> pa.Table:
    """The first rows of a file (the records in the first 4 MB of a text file after its header, the
    first row group of a Parquet file) with the types a reader infers; rows that cannot be read are
    skipped here. Only for guessing what was not declared (``infer_task``): declared types are never
    taken from it."""
    fmt = file_format(path)
    if fmt == "avro":  # every block's framing read first: a truncated or corrupt file is named before any run
        check_avro_file(path)
        return avro_head(path)  # typed from the file's schema, as a Parquet file's
    with FileSystems.open(path) as fh:
        if fmt == "parquet":
            pf = pq.ParquetFile(fh)
            return pf.read_row_group(0) if pf.metadata.num_row_groups else pf.schema_arrow.empty_table()
        if fmt == "csv":
            names, rest = read_csv_header(fh, path, max_record_bytes)  # a header of any size up to the bound
            head = rest + fh.read(max(0, _HEAD_BYTES - len(rest)))
        else:
            head = fh.read(_HEAD_BYTES)
    if fmt == "csv":
        cut = record_end(head)
        if cut <= 0:  # no whole record in the head (an empty file, or a first record over 4 MB)
            return pa.table({n: pa.nulls(0) for n in names})
        parse = pacsv.ParseOptions(newlines_in_values=True, invalid_row_handler=lambda row: "skip")
        opts = pacsv.ConvertOptions(null_values=CSV_NULLS, strings_can_be_null=True)
        try:
            return pacsv.read_csv(io.BytesIO(head[:cut]), parse_options=parse,
                                  convert_options=opts, read_options=pacsv.ReadOptions(column_names=names))
        except pa.ArrowInvalid as err:
            raise SchemaError(f"{path}: cannot be read as CSV: {err}") from None
    rows = [obj for obj in _json_objects(head, max_record_bytes)]
    try:
        return pa.Table.from_pylist(rows)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return pa.table({k: pa.array([r.get(k) for r in rows], type=pa.string()) if any(
            isinstance(r.get(k), str) for r in rows) else pa.nulls(len(rows)) for k in _keys(rows)})


def _json_objects(head: bytes, max_record_bytes: int):
    """The JSON objects among the whole lines of ``head`` (a bad or oversized line is skipped here)."""
    for line in head[: head.rfind(b"\n") + 1].splitlines():
        if line.strip() and len(line) <= max_record_bytes:
            try:
                obj = json.loads(line)
            except Exception:  # noqa: BLE001 - a bad line is the pipeline's dead letter, not a pre-flight error
                continue
            if isinstance(obj, dict):
                yield obj


def _keys(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(k for r in rows for k in r))


def _check_columns(names: Sequence[str], spec: FeatureSpec, where: str) -> None:
    """Declared columns missing from a text file's header (or first JSON objects) -> ``SchemaError``;
    their types are not checked here: a value that does not fit is its row's dead letter."""
    missing = [c for c in spec.input_columns if c not in set(names)]
    if missing:
        raise SchemaError(f"{where}: missing declared column(s) {', '.join(missing)}; "
                            f"the file has {', '.join(names)}")


def _text_has_rows(path: str, fmt: str, max_record_bytes: int) -> bool:
    with FileSystems.open(path) as fh:
        rest = read_csv_header(fh, path, max_record_bytes)[1] if fmt == "csv" else b""
        return bool((rest + fh.read(1 << 16)).strip())


def expand_inputs(patterns: Sequence[str]) -> list[str]:
    files = []
    for pattern in patterns:
        matched = FileSystems.match([pattern])[0].metadata_list
        if not matched:
            raise SchemaError(f"input {pattern!r} matches no file; check the path")
        folders = [m.path for m in matched if os.path.isdir(m.path)]  # a local folder matches itself
        if folders:
            raise SchemaError(f"input {folders[0]!r} is a directory, not a file; give its files "
                              f"({os.path.join(folders[0], '*.parquet')!r}, or *.csv, *.jsonl, *.avro)")
        files += sorted(m.path for m in matched)
    return files


#: An integer label with at most this many distinct values (in the files' first rows) is
#: taken for class labels when ``--task`` is not given.
MAX_INTEGER_CLASSES = 10


def infer_task(label: str, head: pa.Table) -> tuple[str, str]:
    """(task, why) from the label column of a file's first rows: text or booleans are classes, a
    float is a regression target, integers are classes when they take few values."""
    if label not in head.schema.names:
        return "regression", f"label {label!r} not found in the first rows"
    if head.column(label).null_count == head.num_rows:
        return "regression", f"label {label!r} holds no values in the first rows"
    t = head.schema.field(label).type
    kind = column_kind(t)
    if kind in ("string", "boolean"):
        return "classification", f"label {label!r} holds {'text' if kind == 'string' else 'booleans'}"
    if pa.types.is_integer(t):
        distinct = len(pc.unique(pc.drop_null(head.column(label))))
        if distinct <= MAX_INTEGER_CLASSES:
            return "classification", f"label {label!r} holds integers with {distinct} distinct values"
        return "regression", f"label {label!r} holds integers with {distinct} distinct values (> {MAX_INTEGER_CLASSES})"
    return "regression", f"label {label!r} holds numbers of type {t}"


def resolve_task(files: Sequence[str], spec: FeatureSpec) -> tuple[FeatureSpec, str | None]:
    """``spec`` with its task decided from the first file whose first rows hold a label value, when it
    has none; (spec, why or None). A label that is no column of the first file, or that no file's first
    rows hold a value of, is a ``SchemaError`` naming it (before anything is printed about the task)."""
    if spec.task is not None:
        return spec, None
    if spec.positive_class is not None:  # a positive class: the label is classes, whatever its type
        return dataclasses.replace(spec, task="classification"), f"--positive-class {spec.positive_class}"
    rows = 0
    for path in files:
        head = file_head(path)
        if head.num_columns and spec.label not in head.schema.names:  # as preflight would say, but first
            raise SchemaError(no_label(spec.label, path, head.schema.names))
        rows += head.num_rows
        if head.num_rows and head.column(spec.label).null_count < head.num_rows:
            task, why = infer_task(spec.label, head)
            return dataclasses.replace(spec, task=task), why
    if not rows:  # no rows at all: preflight says so
        return dataclasses.replace(spec, task="regression"), None
    raise SchemaError(f"label column {spec.label!r} holds no values: it is empty in the first {rows:,} rows of "
                        f"{', '.join(files)}; check --label, or give --task if later rows hold values")


def no_label(label: str, path: str, names: Sequence[str]) -> str:
    """``--label 'tir' is not a column of t.csv (did you mean 'tip'?); it has ...``."""
    close = difflib.get_close_matches(label, list(names), n=1)
    return (f"--label {label!r} is not a column of {path}{f' (did you mean {close[0]!r}?)' if close else ''}; "
            f"it has {', '.join(names)}")


def preflight(files: Sequence[str], spec: FeatureSpec, *, max_record_bytes: int = MAX_RECORD_BYTES) -> None:
    """Check every file has the declared columns (and a Parquet file's own column types); raise
    ``SchemaError`` naming the first bad one. Text files' types are never inferred from their first
    rows: the pipeline reads them with the declared types, and a value that does not fit, in line 3
    or line 3,000,000, is that row's dead letter naming file and line."""
    nonempty = False
    for path in files:
        fmt = file_format(path)
        if fmt in ("parquet", "avro"):
            head = file_head(path)
            check_schema(head.schema, spec, where=path)  # the file's declared schema, not an inference
            nonempty = nonempty or head.num_rows > 0
        elif fmt == "csv":
            _check_columns(csv_header(path, max_record_bytes), spec, where=path)
            nonempty = nonempty or _text_has_rows(path, fmt, max_record_bytes)
        else:
            rows = list(_json_objects(file_head_bytes(path), max_record_bytes))
            if rows:
                _check_columns(_keys(rows), spec, where=path)
            nonempty = nonempty or _text_has_rows(path, fmt, max_record_bytes)
    if not nonempty:
        raise SchemaError(f"the input is empty: {', '.join(files)} hold{'s' if len(files) == 1 else ''} no rows")
    if spec.time_column and spec.valid_from is not None and spec.test_from is not None:
        lo, hi = (time_cutoff(spec.valid_from, spec.time_format), time_cutoff(spec.test_from, spec.time_format))
        if lo > hi:
            raise SchemaError(f"--valid-from {spec.valid_from} is after --test-from {spec.test_from}: the "
                                f"validation period must come before the test period")


def file_head_bytes(path: str) -> bytes:
    """The first 4 MB of a file, as bytes."""
    with FileSystems.open(path) as fh:
        return fh.read(_HEAD_BYTES)


class SplitError(ValueError):
    """A split of the dataset is empty; the message names the column, its range and the cutoffs."""


def check_splits(manifest: dict) -> None:
    """Raise ``SplitError`` when the train, valid or test split of a dataset has no rows, or when its training split
    weighs nothing (``check_weights``)."""
    rows = manifest.get("rows", {})
    empty = [s for s in SPLITS if not rows.get(s)]
    if not empty:
        check_weights(manifest)
        return
    counts = ", ".join(f"{s} {rows.get(s, 0):,}" for s in SPLITS)
    tally = manifest.get("counts") or {}
    if not tally.get("out") and tally.get("dead_letters"):  # every row rejected: say why, not "too small"
        reasons = sorted((tally.get("dead_letters_by_reason") or {}).items(), key=lambda kv: -kv[1])
        said = "; ".join(f"{reason} ({n:,})" for reason, n in reasons[:3])
        raise SplitError(f"no row can be used: all {tally['dead_letters']:,} rows are dead letters ({said}); "
                         f"see the dead letters file, and check the declared columns and types")
    info = manifest.get("split") or {}
    spec = manifest.get("spec", {})
    if info.get("time_column"):
        fmt = format_time
        lo, hi = info.get("min"), info.get("max")
        span = (f"runs from {fmt(lo)} to {fmt(hi)}" if lo is not None and hi is not None
                else "has no readable time in any row")
        raise SplitError(
            f"the {' and '.join(empty)} split{'s are' if len(empty) > 1 else ' is'} empty ({counts} rows): time column "
            f"{info['time_column']!r} {span}; cutoffs: valid from {fmt(info['valid_from'])}"
            f"{' (--valid-from ' + str(spec.get('valid_from')) + ')' if spec.get('valid_from') else ' (by fraction)'}, "
            f"test from {fmt(info['test_from'])}"
            f"{' (--test-from ' + str(spec.get('test_from')) + ')' if spec.get('test_from') else ' (by fraction)'}. "
            f"Choose --valid-from/--test-from inside the column's range "
            f"(train < valid-from <= valid < test-from <= test)"
            f"{'' if spec.get('time_format') else ', or set --time-format if the times are read wrongly'}")
    raise SplitError(f"the {' and '.join(empty)} split{'s are' if len(empty) > 1 else ' is'} empty ({counts} rows; "
                     f"random split {spec.get('fractions')} by --seed): the table is too small to split; "
                     f"give more rows")


def check_weights(manifest: dict) -> None:
    """Raise ``SplitError`` when the training split's sample weights (``--weight-column``) are all zero: nothing
    would be trained on."""
    column = (manifest.get("spec") or {}).get("weight_column")
    stats = manifest.get("stats") or {}
    if column and not stats.get("weight_sum", 0.0) > 0:
        raise SplitError(f"--weight-column {column!r}: every training row weighs 0 ({stats.get('train_rows', 0):,} "
                         f"rows), so nothing would be trained on; give some rows a weight > 0")

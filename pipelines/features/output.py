"""The aggregates as Arrow columns (their types, their empty values) and the backfill's output file."""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from apache_beam.io.filesystems import FileSystems

from connectors.files import file_format, list_units, read_unit
from connectors.spill import read_spill_file
from pipelines.features.core import KeyFeatures
from pipelines.features.declare import TOPIC_SCHEME, DeclarationError, last_k
from pipelines.tabular.preflight import expand_inputs

#: Aggregations whose value is a whole number (and 0 when empty).
COUNTS = ("count", "distinct")


def feature_types(group: KeyFeatures, kind_of: Callable[[str], str]) -> Iterator[tuple[str, str, pa.DataType]]:
    """(name, aggregation, Arrow type) of each output column of ``group``: ``KEY_seen``, counts and distinct
    counts int64, last/lastK the column's own kind (float64 or string), the others float64."""
    yield group.seen, "seen", pa.int64()
    for a in group.aggregations:
        for w in a.windows:
            for agg in a.aggs:
                base = a.feature(agg, w)
                if agg in COUNTS:
                    yield base, agg, pa.int64()
                elif agg.startswith("last"):
                    t = pa.float64() if kind_of(a.column) == "number" else pa.string()
                    k = last_k(agg)
                    for i in range(1, k + 1) if k else (None,):
                        yield (f"{base}_{i}" if i else base), agg, t
                else:
                    yield base, agg, pa.float64()


def _arrow(values: np.ndarray, t: pa.DataType) -> pa.Array:
    if pa.types.is_string(t):
        return pa.array(values.tolist() if values.dtype.kind == "O" else
                        [None if v != v else repr(float(v)) for v in values], type=t)
    if pa.types.is_integer(t):
        return pa.array(values.astype(np.int64), type=t)
    values = values.astype(np.float64)
    return pa.array(values, type=t, mask=np.isnan(values))


def feature_batch(group: KeyFeatures, out: dict[str, np.ndarray], kind_of: Callable[[str], str],
                  row_ids: np.ndarray, id_column: str = "_row_id") -> pa.RecordBatch:
    """``advance``'s output as a RecordBatch (NaN: null), the row ids first."""
    cols = {id_column: pa.array(row_ids, type=pa.int64())}
    for name, _, t in feature_types(group, kind_of):
        cols[name] = _arrow(out[name], t)
    return pa.RecordBatch.from_pydict(cols)


def empty_features(group: KeyFeatures, kind_of: Callable[[str], str], n: int) -> dict[str, pa.Array]:
    """The features of ``n`` rows without a key or a time: counts, sums and ``KEY_seen`` 0, the others null."""
    out = {}
    for name, agg, t in feature_types(group, kind_of):
        if agg in ("seen", *COUNTS):
            out[name] = pa.array(np.zeros(n, np.int64))
        elif agg == "sum":
            out[name] = pa.array(np.zeros(n))
        else:
            out[name] = pa.nulls(n, t)
    return out


def read_table(path: str) -> pa.Table:
    """A whole table (a join's): every file ``path`` matches (a file, a glob, or a dataset's directory: every file
    of a format flowtrain reads under it, names starting with ``_`` or ``.`` left out), any format flowtrain reads."""
    if path.startswith(TOPIC_SCHEME):
        raise DeclarationError(f"--join {path}: a Kafka topic joins on the stream only (flowtrain stream pipeline, "
                               f"stream score); here give the table's file, e.g. the rows published to the topic")
    batches = []
    for f in table_files(path):
        for unit in list_units(f, file_format(f)):
            batches.extend(read_unit(unit))
    if not batches:
        raise FileNotFoundError(f"{path}: no rows")
    return pa.Table.from_batches(batches) if len({b.schema for b in batches}) == 1 else \
        pa.concat_tables([pa.Table.from_batches([b]) for b in batches], promote_options="permissive")


def table_files(path: str) -> list[str]:
    """The files of a join's table: ``path``'s matches, or the table files under a directory (in name order)."""
    if not FileSystems.match([path])[0].metadata_list or path.endswith("/") or os.path.isdir(path):
        under = FileSystems.match([path.rstrip("/") + "/**"])[0].metadata_list
        files = sorted(m.path for m in under if _table_file(m.path, path))
        if files:
            return files
        if under or path.endswith("/") or os.path.isdir(path):
            raise FileNotFoundError(f"--join {path}: a directory without a table file (parquet, avro, csv, jsonl)")
    return expand_inputs([path])


def _table_file(name: str, root: str) -> bool:
    rel = name[len(root.rstrip("/")):].lstrip("/")
    if any(part[:1] in ("_", ".") for part in rel.split("/")):
        return False
    try:
        file_format(name)
    except ValueError:
        return False
    return True


def write_parts(parts: Sequence[str], out: str) -> int:
    """The parts (spill files, in order) as one Parquet file ``out`` (written to a temporary name, then renamed);
    their schemas unified (a column null in one part takes the others' type). Returns the rows written."""
    schemas = []
    for p in parts:
        with FileSystems.open(p) as fh:
            schemas.append(pa.ipc.open_stream(fh).schema)
    schema = pa.unify_schemas(schemas, promote_options="permissive") if schemas else pa.schema([])
    tmp = f"{out}.tmp-{np.random.default_rng().integers(1 << 40):x}"
    rows = 0
    sink = FileSystems.create(tmp)
    try:
        with pq.ParquetWriter(sink, schema) as writer:
            for p in parts:
                table = read_spill_file(p)
                writer.write_table(table.select(schema.names).cast(schema) if table.schema != schema else table)
                rows += table.num_rows
    finally:
        sink.close()
    FileSystems.rename([tmp], [out]) if not FileSystems.exists(out) else _replace(tmp, out)
    return rows


def _replace(tmp: str, out: str) -> None:
    FileSystems.delete([out])
    FileSystems.rename([tmp], [out])

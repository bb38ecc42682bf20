"""The backfill: every declared aggregate and join for every row of bounded input, as a Beam pipeline.

    files -> ReadFromFiles(with_source) -> Lean: per row its id (file, row); per KEY its shard (crc32 of the key)
                                           and its time block; the rows and the lean events (id, key, time,
                                           aggregated columns) to spill files
          -> per (KEY, shard): the time blocks in order, each through ``KeyFeatures.advance`` with the keys' states
             carried from block to block (the core the stream runs; ``pipelines.features.core``)
          -> per range of rows (a file's rows in blocks of 65,536): the rows, each KEY's features and the
             as-of joins, in the input's order -> a Parquet part
          -> the parts in order -> one Parquet file (``--out``)

Memory: a (KEY, shard) holds one time block of its events (blocks of the longest finite window, at least a day)
plus its keys' states (the points inside the longest window, and life aggregates); a range holds 65,536 rows.
No key's history is held whole, and only file names cross between stages (``connectors.spill``).

Rows without a time (missing, or not a time) or without a key keep their row with empty aggregates (``KEY_seen``
0) and count for no key; ``run_backfill`` returns their counts (Beam metrics ``flowtrain.features``).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics import Metrics
from apache_beam.metrics.metric import MetricsFilter

from connectors.files import SOURCE_FILE, SOURCE_ROW, FileReadError, ReadFromFiles
from connectors.paths import origin_of
from connectors.spill import WriteToSpill, read_spill_file, remove_spill, spill_directory, write_spill_file
from pipelines.features.asof import AsOfTable, join_columns
from pipelines.features.columns import MISSING_TIME, encode_keys, key_text, shards, time_micros, values_of
from pipelines.features.core import KeyFeatures
from pipelines.features.declare import EVENTS, Declaration, DeclarationError
from pipelines.features.output import empty_features, feature_batch, read_table, write_parts
from pipelines.tabular.preflight import expand_inputs, file_head
from pipelines.tabular.schema import SchemaError

METRICS_NAMESPACE = "flowtrain.features"
ROW_ID = "_row_id"
_KEY, _TIME = "_key", "_time"
#: Rows per range (the unit put back in order): a file's rows ``[k * 2**16, (k + 1) * 2**16)``.
RANGE_BITS = 16
_FILE_SHIFT = 40
DAY_US = 86_400 * 1_000_000


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the backfill computes and how it cuts the work."""

    decl: Declaration
    time_column: str
    time_format: str | None = None
    shards: int = 16
    kinds: tuple[tuple[str, str], ...] = ()  # (aggregated column, "number" | "text")

    @property
    def block_us(self) -> int:
        """The time block: the longest finite window, at least a day."""
        return max([a.longest or 0 for a in self.decl.aggregations] + [DAY_US])

    def groups(self) -> list[KeyFeatures]:
        return [KeyFeatures(self.decl.by_key(k)) for k in self.decl.keys()]

    def columns(self, group: KeyFeatures) -> list[str]:
        return list(dict.fromkeys(a.column for a in group.column_aggs))

    def kind(self, column: str) -> str:
        return dict(self.kinds).get(column, "number")


def _typed_values(col: pa.Array, kind: str, name: str) -> pa.Array:
    values = values_of(col)
    if kind == "number":
        if values.dtype.kind != "f":
            raise DeclarationError(f"column {name!r} holds text in some rows and numbers in the first file's")
        return pa.array(values, mask=np.isnan(values))
    return pa.array(values.tolist() if values.dtype.kind != "f" else
                    [None if np.isnan(v) else repr(float(v)) for v in values], type=pa.string())


class _LeanFn(beam.DoFn):
    """Input batch -> ((\"rows\", range), rows with their id) and ((\"lean\", group, shard, block), lean events)."""

    def __init__(self, plan: Plan, files: Sequence[str]):
        self.plan = plan
        self.files = {**{f: i for i, f in enumerate(files)}, **{origin_of(f): i for i, f in enumerate(files)}}

    def setup(self):
        self.groups = self.plan.groups()
        self.rows_in = Metrics.counter(METRICS_NAMESPACE, "rows_in")
        self.no_time = Metrics.counter(METRICS_NAMESPACE, "rows without a time")

    def process(self, batch: pa.RecordBatch):
        plan = self.plan
        file_ids = np.array([self.files[f] for f in batch.column(SOURCE_FILE).to_pylist()], dtype=np.int64)
        row_ids = (file_ids << _FILE_SHIFT) + batch.column(SOURCE_ROW).to_numpy(zero_copy_only=False)
        self.rows_in.inc(batch.num_rows)
        rows = batch.drop_columns([SOURCE_FILE, SOURCE_ROW]).append_column(ROW_ID, pa.array(row_ids))
        ranges = row_ids >> RANGE_BITS
        yield from _split(rows, ranges, lambda r: ("rows", int(r)))
        times = time_micros(batch.column(plan.time_column), plan.time_format)
        timed = times != MISSING_TIME
        self.no_time.inc(int((~timed).sum()))
        blocks = np.floor_divide(times, plan.block_us)
        for gi, group in enumerate(self.groups):
            keys = key_text(batch, group.key)
            names, codes, has = encode_keys(keys)
            ok = has & timed
            Metrics.counter(METRICS_NAMESPACE, f"rows without a key: {group.seen.removesuffix('_seen')}").inc(
                int((~has).sum()))
            if not ok.any():
                continue
            cols = {ROW_ID: pa.array(row_ids), _KEY: keys, _TIME: pa.array(times)}
            for c in plan.columns(group):
                cols[c] = _typed_values(batch.column(c), plan.kind(c), c)
            lean = pa.RecordBatch.from_pydict(cols).filter(pa.array(ok))
            shard = shards(names, codes, plan.shards)[ok]
            part = shard * (1 << 32) + (blocks[ok] - blocks[ok].min())
            base = int(blocks[ok].min())
            yield from _split(lean, part, lambda p, gi=gi, base=base: ("lean", gi, int(p >> 32),
                                                                          int(p & 0xFFFFFFFF) + base))


def _split(batch: pa.RecordBatch, parts: np.ndarray, key_of):
    """(key_of(part), the rows of that part) for each part value, rows in their order."""
    if not len(parts):
        return
    order = np.argsort(parts, kind="stable")
    sorted_parts = parts[order]
    cuts = np.flatnonzero(np.diff(sorted_parts)) + 1
    for lo, hi in zip(np.concatenate([[0], cuts]), np.concatenate([cuts, [len(parts)]])):
        yield key_of(sorted_parts[lo]), batch.take(pa.array(order[lo:hi]))


class _ComputeFn(beam.DoFn):
    """((group, shard), [(block, path)]) -> ((\"feat\", group, range), features with row ids): the blocks in time
    order, the keys' states carried between them."""

    def __init__(self, plan: Plan):
        self.plan = plan

    def setup(self):
        self.groups = self.plan.groups()

    def process(self, element):
        (gi, _shard), refs = element
        group = self.groups[gi]
        by_block: dict[int, list[str]] = {}
        for block, path in refs:
            by_block.setdefault(block, []).append(path)
        states: dict | None = {} if len(by_block) > 1 else None
        blocks = sorted(by_block)
        for i, block in enumerate(blocks):
            table = pa.concat_tables([read_spill_file(p) for p in sorted(by_block[block])]).combine_chunks()
            names, codes, _ = encode_keys(table.column(_KEY))
            columns = {c: values_of(table.column(c)) for c in self.plan.columns(group)}
            out = group.advance(names, codes, table.column(_TIME).to_numpy(), columns, states,
                                keep=i < len(blocks) - 1)
            row_ids = table.column(ROW_ID).to_numpy()
            features = feature_batch(group, out, self.plan.kind, row_ids)
            yield from _split(features, row_ids >> RANGE_BITS, lambda r, gi=gi: ("feat", gi, int(r)))


class _AssembleFn(beam.DoFn):
    """(range, [(tag, path)]) -> the range's rows in order with every aggregate and join, as a Parquet part."""

    def __init__(self, plan: Plan, parts_dir: str, tables: Sequence[pa.Table]):
        self.plan, self.parts_dir, self.tables = plan, parts_dir, tables

    def setup(self):
        self.groups = self.plan.groups()
        self.joins = [AsOfTable(j, t, time_format=self.plan.time_format) for j, t in
                      zip(self.plan.decl.joins, self.tables)]
        self.rows_out = Metrics.counter(METRICS_NAMESPACE, "rows_out")

    def process(self, element):
        rng, refs = element
        rows_paths = sorted(p for tag, p in refs if tag == "rows")
        rows = pa.concat_tables([read_spill_file(p) for p in rows_paths], promote_options="permissive")
        rows = rows.take(pc.sort_indices(rows.column(ROW_ID))).combine_chunks()
        row_ids = rows.column(ROW_ID).to_numpy()
        out = {n: rows.column(n) for n in rows.column_names if n != ROW_ID}
        for gi, group in enumerate(self.groups):
            paths = sorted(p for tag, p in refs if tag == gi)
            feats = pa.concat_tables([read_spill_file(p) for p in paths]) if paths else None
            out.update(_aligned(group, self.plan.kind, feats, row_ids))
        if self.joins:
            times = time_micros(rows.column(self.plan.time_column), self.plan.time_format)
            for name, col in join_columns(self.joins, rows, times).items():
                if name in out:
                    raise DeclarationError(f"--join: column {name} is also an input column or an aggregate")
                out[name] = col
        table = pa.table(out)
        path = FileSystems.join(self.parts_dir, f"part-{rng:020d}.arrows")
        write_spill_file(path, table)
        self.rows_out.inc(table.num_rows)
        yield rng, path


def _aligned(group: KeyFeatures, kind, feats: pa.Table | None, row_ids: np.ndarray) -> dict[str, pa.Array]:
    """The group's features for these rows (sorted ids): found by id, empty values for rows without any."""
    empty = empty_features(group, kind, len(row_ids))
    if feats is None or not feats.num_rows:
        return empty
    feats = feats.take(pc.sort_indices(feats.column(ROW_ID)))
    ids = feats.column(ROW_ID).to_numpy()
    at = np.searchsorted(row_ids, ids)
    if (at >= len(row_ids)).any() or not np.array_equal(row_ids[np.minimum(at, len(row_ids) - 1)], ids):
        raise RuntimeError("features of rows that are not in their range (a bug)")
    if len(ids) == len(row_ids):
        return {n: feats.column(n).combine_chunks() for n in empty}
    mask = np.zeros(len(row_ids), dtype=bool)
    mask[at] = True
    index = np.full(len(row_ids), -1, dtype=np.int64)
    index[at] = np.arange(len(ids))
    take = pa.array(index, mask=~mask)
    out = {}
    for name, col in empty.items():
        got = feats.column(name).combine_chunks().take(take)
        out[name] = pc.if_else(pa.array(mask), got, col)
    return out


def _finish(parts: list, out: str) -> int:
    return write_parts([p for _, p in sorted(parts)], out)


def build_backfill(pipeline: beam.Pipeline, files: Sequence[str], plan: Plan, *, out: str, work_dir: str,
                   tables: Sequence[pa.Table] = (), column_types: dict | None = None):
    """Wire the backfill of ``files`` into ``pipeline``; its last step writes ``out`` (one Parquet file)."""
    raw = pipeline | "ReadFiles" >> ReadFromFiles(list(files), with_source=True, column_types=column_types)
    spilled = raw | "Lean" >> beam.ParDo(_LeanFn(plan, files)) | "SpillLean" >> WriteToSpill(work_dir)
    lean = (spilled | "LeanOnly" >> beam.Filter(lambda kv: kv[0][0] == "lean")
            | "ByShard" >> beam.Map(lambda kv: ((kv[0][1], kv[0][2]), (kv[0][3], kv[1])))
            | "GroupShards" >> beam.GroupByKey())
    feats = (lean | "Compute" >> beam.ParDo(_ComputeFn(plan))
             | "SpillFeatures" >> WriteToSpill(work_dir))
    rows = spilled | "RowsOnly" >> beam.Filter(lambda kv: kv[0][0] == "rows")
    parts = ((rows, feats) | "Both" >> beam.Flatten()
             | "ByRange" >> beam.Map(lambda kv: (kv[0][-1], ("rows" if kv[0][0] == "rows" else kv[0][1], kv[1])))
             | "GroupRanges" >> beam.GroupByKey()
             | "Assemble" >> beam.ParDo(_AssembleFn(plan, FileSystems.join(work_dir, "parts"), tables)))
    return (parts | "AllParts" >> beam.combiners.ToList()
            | "WriteOut" >> beam.Map(_finish, out))


def check_columns(schema: pa.Schema, decl: Declaration, time_column: str, where: str) -> None:
    """The time column, the keys and the aggregated columns are in the input (else one line naming them)."""
    needed = [time_column, *decl.input_columns()]
    missing = [c for c in dict.fromkeys(needed) if c not in schema.names]
    if missing:
        raise DeclarationError(f"{where} has no column {', '.join(missing)} (it has {', '.join(schema.names)}); "
                               f"check --time-column, --aggregate and --join")


def value_kinds(schema: pa.Schema, decl: Declaration) -> tuple[tuple[str, str], ...]:
    """Each aggregated column's kind, from the input's type (number or text)."""
    out = {}
    for a in decl.aggregations:
        if a.column == EVENTS:
            continue
        t = schema.field(a.column).type
        if pa.types.is_dictionary(t):
            t = t.value_type
        number = pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t) or \
            pa.types.is_boolean(t)
        out[a.column] = "number" if number else "text"
    return tuple(out.items())


def read_types(schema: pa.Schema, kinds) -> dict[str, pa.DataType]:
    """The types every input block is read with (a text file's blocks would otherwise each infer their own): the
    first rows' types (times as read), text where they hold only nulls, float64 for an aggregated column of numbers (a later
    fraction in a column of whole numbers still fits) and text for an aggregated column of text."""
    types = {f.name: (pa.string() if pa.types.is_null(f.type) else
                      None if pa.types.is_temporal(f.type) else f.type) for f in schema}  # None: as read
    types.update({c: (pa.float64() if k == "number" else pa.string()) for c, k in kinds})
    return types


class BackfillError(DeclarationError):
    """Input the backfill cannot read (no such file, a bad row, a missing column): one line naming it."""


def run_backfill(inputs: Sequence[str], decl: Declaration, *, time_column: str, time_format: str | None, out: str,
                 options, overwrite: bool = False, shards: int = 16) -> dict:
    """Run the backfill of the files ``inputs`` match into ``out`` (one Parquet file); returns the counts (rows in
    and out, rows without a time, rows without each key), the aggregated columns' ``kinds`` and the ``joined``
    columns. The first file's first rows decide whether an aggregated
    column is numbers or text, and every file is read with their types. A user's error is a ``BackfillError``."""
    if FileSystems.exists(out) and not overwrite:
        raise BackfillError(f"--out {out} exists: give --overwrite to replace it")
    try:
        files = expand_inputs(inputs)
        head = file_head(files[0])
        return _run(files, head, decl, time_column=time_column, time_format=time_format, out=out, options=options,
                    shards=shards)
    except (SchemaError, FileReadError, FileNotFoundError) as err:
        raise BackfillError(str(err)) from None


def _run(files, head, decl, *, time_column, time_format, out, options, shards) -> dict:
    check_columns(head.schema, decl, time_column, f"input {files[0]}")
    kinds = value_kinds(head.schema, decl)
    for a in decl.aggregations:
        bad = [x for x in a.aggs if x in ("sum", "mean", "min", "max", "std")]
        if a.column != EVENTS and dict(kinds)[a.column] == "text" and bad:
            raise DeclarationError(f"--aggregate {a.text}: {', '.join(bad)} need numbers and column {a.column!r} "
                                   f"holds text (in {files[0]})")
    plan = Plan(decl, time_column, time_format, shards, kinds)
    tables = [read_table(j.table) for j in decl.joins]
    column_types = read_types(head.schema, kinds)
    work_dir = spill_directory(out)
    try:
        with beam.Pipeline(options=options) as p:
            build_backfill(p, files, plan, out=out, work_dir=work_dir, tables=tables, column_types=column_types)
        result = p.result
    finally:
        remove_spill(work_dir)
    counts: dict = {}
    for c in result.metrics().query(MetricsFilter().with_namespace(METRICS_NAMESPACE))["counters"]:
        counts[c.key.metric.name] = counts.get(c.key.metric.name, 0) + c.committed
    # what a dataset made of the output records (its manifest's "features"): the columns' kinds, the joined columns
    counts["kinds"] = dict(kinds)
    counts["joined"] = [j.column_name(c) for j, t in zip(decl.joins, tables) for c in t.column_names
                        if c not in j.key and c != j.valid_from]
    return counts


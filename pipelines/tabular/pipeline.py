"""The generic tabular ETL as Beam transforms: validate, split, full-pass statistics, featurize.

    files -> ReadFromFiles(with_source) -> ValidateRows --errs--> dead letters
                                              |
                                         AssignSplits -> (split, batch)
                                              |--train--> ComputeStats (one full pass)
                                         Featurize(stats as side input) -> WriteDataset

Counts reconcile and go into the manifest: rows in = rows out (all splits) + dead letters.
"""
from __future__ import annotations

import io
from typing import Callable, Sequence

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.json as pajson
import pyarrow.parquet as pq
from apache_beam.io.filesystems import FileSystems

from connectors.dataset import WriteDataset
from connectors.deadletter import ERRS, WriteDeadLettersToJsonl
from connectors.files import CSV_NULLS, ReadFromFiles, file_format
from pipelines.tabular import features as F
from connectors.dataset_spec import SPLITS, FeatureSpec

ExtraChecks = Callable[[pa.RecordBatch], list]


# ---------------------------------------------------------------------------------------------
# Pre-flight: schema of every input file, before the pipeline runs
# ---------------------------------------------------------------------------------------------
def file_schema(path: str) -> pa.Schema:
    fmt = file_format(path)
    with FileSystems.open(path) as fh:
        if fmt == "parquet":
            return pq.ParquetFile(fh).schema_arrow
        head = fh.read(4 << 20)
    if fmt == "csv":
        head = head[: head.rfind(b"\n") + 1] or head
        opts = pacsv.ConvertOptions(null_values=CSV_NULLS, strings_can_be_null=True)
        return pacsv.read_csv(io.BytesIO(head), convert_options=opts).schema
    head = head[: head.rfind(b"\n") + 1] or head
    return pajson.read_json(io.BytesIO(head)).schema


def expand_inputs(patterns: Sequence[str]) -> list[str]:
    files = []
    for pattern in patterns:
        matched = FileSystems.match([pattern])[0].metadata_list
        if not matched:
            raise F.SchemaError(f"input {pattern!r} matches no file; check the path")
        files += sorted(m.path for m in matched)
    return files


def preflight(files: Sequence[str], spec: FeatureSpec) -> pa.Schema:
    """Check every file's columns and types; raise ``SchemaError`` naming the first bad one."""
    schema = None
    nonempty = False
    for path in files:
        s = file_schema(path)
        F.check_schema(s, spec, where=path)
        schema = schema or s
        nonempty = nonempty or FileSystems.match([path])[0].metadata_list[0].size_in_bytes > len(",".join(s.names)) + 1
    if not nonempty:
        raise F.SchemaError(f"the input is empty: {', '.join(files)} hold no rows")
    return schema


# ---------------------------------------------------------------------------------------------
# Beam steps
# ---------------------------------------------------------------------------------------------
class _ValidateFn(beam.DoFn):
    def __init__(self, spec: FeatureSpec, extra_checks: ExtraChecks | None):
        self._spec, self._extra = spec, extra_checks

    def process(self, batch: pa.RecordBatch):
        good, letters = F.split_valid(batch, self._spec, self._extra(batch) if self._extra else [])
        if good.num_rows:
            yield good
        for letter in letters:
            yield beam.pvalue.TaggedOutput(ERRS, letter)


class ValidateRows(beam.PTransform):
    """RecordBatches -> usable rows (main) and ``DeadLetter``s (``errs``)."""

    def __init__(self, spec: FeatureSpec, extra_checks: ExtraChecks | None = None):
        super().__init__()
        self._spec, self._extra = spec, extra_checks

    def expand(self, batches):
        return batches | beam.ParDo(_ValidateFn(self._spec, self._extra)).with_outputs(ERRS, main="rows")


class _TimeRange(beam.CombineFn):
    def __init__(self, column: str):
        self._col = column

    def create_accumulator(self):
        return (np.inf, -np.inf)

    def add_input(self, acc, batch):
        t = F._time_values(batch.column(self._col))
        t = t[np.isfinite(t)]
        return (min(acc[0], t.min()), max(acc[1], t.max())) if t.size else acc

    def merge_accumulators(self, accs):
        accs = list(accs)
        return (min(a[0] for a in accs), max(a[1] for a in accs))

    def extract_output(self, acc):
        return acc


def _cutoffs(spec: FeatureSpec, rows, *, label: str):
    """Side input with (valid_from, test_from) in the time column's units, or None."""
    if not spec.time_column:
        return beam.pvalue.AsSingleton(rows.pipeline | f"{label}NoCutoffs" >> beam.Create([None]))
    if spec.valid_from and spec.test_from:
        fixed = (F.time_cutoff(spec.valid_from), F.time_cutoff(spec.test_from))
        return beam.pvalue.AsSingleton(rows.pipeline | f"{label}Cutoffs" >> beam.Create([fixed]))
    f_train, f_valid, _ = spec.fractions

    def by_fraction(rng):
        lo, hi = rng
        return (lo + (hi - lo) * f_train, lo + (hi - lo) * (f_train + f_valid))

    return beam.pvalue.AsSingleton(rows | f"{label}TimeRange" >> beam.CombineGlobally(_TimeRange(spec.time_column))
                                   | f"{label}ByFraction" >> beam.Map(by_fraction))


class _AssignSplitsFn(beam.DoFn):
    def __init__(self, spec: FeatureSpec):
        self._spec = spec

    def process(self, batch: pa.RecordBatch, cutoffs):
        codes = F.assign_splits(batch, self._spec, cutoffs)
        for i, name in enumerate(SPLITS):
            mask = codes == i
            if mask.any():
                yield name, batch.filter(pa.array(mask))


class _StatsFn(beam.CombineFn):
    def __init__(self, spec: FeatureSpec):
        self._spec = spec

    def create_accumulator(self):
        return F.StatsAccumulator()

    def add_input(self, acc, batch):
        return acc.add(batch, self._spec)

    def merge_accumulators(self, accs):
        accs = iter(accs)
        first = next(accs)
        for acc in accs:
            first.merge(acc)
        return first

    def extract_output(self, acc):
        return acc.finalize(self._spec)


class ComputeStats(beam.PTransform):
    """One full pass: mean/std per numeric column, vocabulary per categorical column."""

    def __init__(self, spec: FeatureSpec):
        super().__init__()
        self._spec = spec

    def expand(self, batches):
        return batches | beam.CombineGlobally(_StatsFn(self._spec))


def _sum_counts(pairs) -> dict:
    out: dict = {}
    for key, n in pairs:
        out[key] = out.get(key, 0) + n
    return out


class FeaturizeSplits(beam.PTransform):
    """(split, valid batch) -> (split, feature batch), with the training statistics."""

    def __init__(self, spec: FeatureSpec, stats):
        super().__init__()
        self._spec, self._stats = spec, stats

    def expand(self, split_batches):
        spec = self._spec
        return split_batches | beam.Map(
            lambda pair, stats: (pair[0], F.featurize(pair[1], spec, stats)),
            stats=beam.pvalue.AsSingleton(self._stats))


def build_etl(raw_batches, spec: FeatureSpec, *, dataset_path: str, dead_letters_path: str | None,
              extra_checks: ExtraChecks | None = None,
              extra_metadata: dict | None = None, rows_in=None, overwrite: bool = True):
    """Wire the ETL after a reader; returns the PCollection holding the written manifest.

    ``rows_in`` counts the reader's rows (default: rows of ``raw_batches``); give it when
    rows were rejected before ``raw_batches`` (e.g. by a join's own checks) and fold those
    rejections into ``raw_batches``' dead letters yourself.
    """
    rows, errs = raw_batches | "ValidateRows" >> ValidateRows(spec, extra_checks)
    cutoffs = _cutoffs(spec, rows, label="Split")
    split_batches = rows | "AssignSplits" >> beam.ParDo(_AssignSplitsFn(spec), cutoffs)
    train = (split_batches | "TrainOnly" >> beam.Filter(lambda kv: kv[0] == "train")
             | "TrainBatches" >> beam.Values())
    stats = train | "ComputeStats" >> ComputeStats(spec)
    featurized = split_batches | "Featurize" >> FeaturizeSplits(spec, stats)

    if rows_in is None:
        rows_in = raw_batches | "CountIn" >> beam.Map(lambda b: b.num_rows) | "SumIn" >> beam.CombineGlobally(sum)
    rows_out = (featurized | "CountOut" >> beam.MapTuple(lambda split, b: (split, b.num_rows))
                | "SumOut" >> beam.combiners.ToList() | "OutDict" >> beam.Map(_sum_counts))
    dead = (errs | "CountDead" >> beam.Map(lambda d: (d.reason, 1))
            | "SumDead" >> beam.combiners.ToList() | "DeadDict" >> beam.Map(_sum_counts))
    extra = dict(extra_metadata or {})

    def metadata(stats_, n_in, out, dead_):
        n_out, n_dead = sum(out.values()), sum(dead_.values())
        if n_in != n_out + n_dead:
            raise RuntimeError(f"row counts do not reconcile: in {n_in} != out {n_out} + dead letters {n_dead}")
        return {**extra, "spec": spec.to_dict(), "stats": stats_,
                "counts": {"in": n_in, "out": n_out, "dead_letters": n_dead, "out_by_split": out,
                           "dead_letters_by_reason": dead_}}

    meta = stats | "Metadata" >> beam.Map(metadata, n_in=beam.pvalue.AsSingleton(rows_in),
                                          out=beam.pvalue.AsSingleton(rows_out),
                                          dead_=beam.pvalue.AsSingleton(dead))
    if dead_letters_path:
        _ = errs | "WriteDeadLetters" >> WriteDeadLettersToJsonl(dead_letters_path)
    return featurized | "WriteDataset" >> WriteDataset(dataset_path, metadata=meta, overwrite=overwrite)


def run_tabular_etl(inputs: Sequence[str], spec: FeatureSpec, *, dataset_path: str,
                    dead_letters_path: str | None, options) -> dict:
    """Pre-flight the files, run the ETL, return the manifest."""
    from connectors.dataset import read_manifest

    files = expand_inputs(inputs)
    preflight(files, spec)
    with beam.Pipeline(options=options) as p:
        raw = p | "ReadFiles" >> ReadFromFiles(files, with_source=True,
                                               columns=[*spec.input_columns])
        build_etl(raw, spec, dataset_path=dataset_path, dead_letters_path=dead_letters_path,
                  extra_metadata={"inputs": files})
    return read_manifest(dataset_path)

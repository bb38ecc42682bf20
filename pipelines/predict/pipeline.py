"""Batch prediction over files with Beam ``RunInference``::

    ReadFromFiles(inputs, the feature / id / keep / label columns, file:line sources, with dead letters)
      -> FeaturizeForPrediction   (the ETL's feature code with the training statistics; bad rows -> dead letters)
      -> RunInference(FlowtrainModelHandler)   (the stream scorer's handler, one fixed model: one forward per
                                               Arrow batch)
      -> one Arrow batch of predictions per input batch (column names: ``rows.output_names``)
      -> WriteToParquetBatched / WriteToText (CSV)     (one file, at --out)
    dead letters -> WriteDeadLettersToJsonl; counts in / predictions / dead letters and the unseen categorical
    values per column -> a small JSON file

This module needs no flowtrain import (imports flow flowtrain -> pipelines): the caller passes ``load``, a
picklable callable ``path -> (torch module in eval mode, version)``, as for the stream scorer.
"""
from __future__ import annotations

import io
import json
from collections.abc import Callable, Sequence
from typing import Any

import apache_beam as beam
import pyarrow as pa
import pyarrow.compute as pc
from apache_beam.ml.inference.base import PredictionResult, RunInference

from connectors.dataset_spec import FeatureSpec
from connectors.deadletter import ERRS, WriteDeadLettersToJsonl
from connectors.files import SOURCE_FILE, ReadFromFiles
from pipelines.predict.rows import OutputNames, featurize_for_prediction, output_batch, read_types, unseen_counts
from pipelines.serving.handler import FlowtrainModelHandler
from pipelines.serving.versions import ModelVersion


def bundle_version(path: str, run: str) -> ModelVersion:
    """The one version a bundle serves (version 0 of its run)."""
    return ModelVersion(0, run, path, None, "", (0, 0, 0))


def bundle_handler(load: Callable[[str], tuple[Any, int]], path: str, run: str, spec: FeatureSpec, *,
                   target_scale: Sequence[float], n_classes: int, device: str = "cpu",
                   torch_threads: int | None = None) -> FlowtrainModelHandler:
    """The stream scorer's model handler (``pipelines.serving.handler``) serving one fixed model: the bundle at
    ``path``, loaded by ``load(path) -> (module, 0)``; one Arrow batch (a ``PredictionInput``) per forward."""
    return FlowtrainModelHandler(load, bundle_version(path, run), spec, device=device, max_batch_size=1,
                                 target_scale=tuple(target_scale), n_classes=n_classes, torch_threads=torch_threads)


COUNTS = "counts"  # the tag of the per-batch count dicts, summed into the counts file


class _OutputFn(beam.DoFn):
    """A predicted batch -> its output record batch (carried columns, predictions, model version); its row count
    on ``COUNTS``."""

    def __init__(self, kind: str, classes: Sequence[str] | None, version: str, schema: pa.Schema, names: OutputNames,
                 spec: FeatureSpec | None):
        self._kind, self._classes, self._version, self._schema = kind, classes, version, schema
        self._names, self._spec = names, spec

    def process(self, result: PredictionResult):
        outputs, _scored_ms = result.inference
        out = output_batch(result.example, outputs, self._kind, self._classes, self._version, self._names,
                           self._spec).cast(self._schema)
        yield beam.pvalue.TaggedOutput(COUNTS, {"predictions": out.num_rows})
        yield out


class _FeaturizeFn(beam.DoFn):
    """A read batch -> its model input (main), its bad rows (``ERRS``) and, on ``COUNTS``, its rows read, its
    dead letters, its unseen categorical values per column and its rows from files without an optional column
    (``absent``: ``{file as sources name it: [columns]}``)."""

    def __init__(self, spec: FeatureSpec, stats: dict, carry: Sequence[str], source_name: str,
                 absent: dict[str, list[str]] | None = None):
        self._spec, self._stats, self._carry, self._source = spec, stats, list(carry), source_name
        self._absent = {f: cols for f, cols in (absent or {}).items() if cols}

    def process(self, batch: pa.RecordBatch):
        counts = {"in": batch.num_rows}
        if self._absent and batch.num_rows:
            files = batch.column(SOURCE_FILE)
            for file, cols in self._absent.items():
                rows = int(pc.sum(pc.equal(files, file)).as_py() or 0)
                for col in cols:
                    counts[f"absent:{col}"] = counts.get(f"absent:{col}", 0) + rows
        inp, letters = featurize_for_prediction(batch, self._spec, self._stats, self._carry, self._source)
        for letter in letters:
            yield beam.pvalue.TaggedOutput(ERRS, letter)
        counts["dead_letters"] = len(letters)
        if inp is not None:
            counts.update({f"unseen:{c}": n for c, n in unseen_counts(inp.features, self._spec).items()})
            yield inp
        yield beam.pvalue.TaggedOutput(COUNTS, counts)


def _csv_text(batch: pa.RecordBatch) -> str:
    import pyarrow.csv as pacsv

    buf = io.BytesIO()
    pacsv.write_csv(batch, buf, write_options=pacsv.WriteOptions(include_header=False))
    return buf.getvalue().decode("utf-8").rstrip("\n")


def csv_header(schema: pa.Schema) -> str:
    import pyarrow.csv as pacsv

    buf = io.BytesIO()
    pacsv.write_csv(schema.empty_table(), buf)
    return buf.getvalue().decode("utf-8").rstrip("\n")


def _sum_counts(parts) -> dict:
    total: dict = {}
    for part in parts:
        for k, v in part.items():
            total[k] = total.get(k, 0) + v
    return total


def _counts_json(total: dict, spec: FeatureSpec) -> str:
    """The summed count dicts -> the counts file: in, predictions, dead letters, unseen values per column, rows
    of files without an optional column per column."""
    unseen = {c: total.get(f"unseen:{c}", 0) for c in spec.categorical}
    absent = {k.split(":", 1)[1]: n for k, n in total.items() if k.startswith("absent:")}
    return json.dumps({"in": total.get("in", 0), "predictions": total.get("predictions", 0),
                       "dead_letters": total.get("dead_letters", 0), "unseen": unseen, "absent": absent})


def build_predict(p, files: Sequence[str], *, handler: FlowtrainModelHandler, spec: FeatureSpec, stats: dict,
                  carry: Sequence[str], out: str, schema: pa.Schema, dead_letters_path: str, counts_path: str,
                  kind: str, classes: Sequence[str] | None, version: str, names: OutputNames,
                  flag_unseen: bool = False, drift: tuple[dict, str] | None = None,
                  absent: dict[str, list[str]] | None = None):
    """Wire the prediction pipeline into ``p`` (``names``: the output's ``pred_*`` column names). ``drift``:
    (a reference profile, a path): the rows' counts in its buckets as JSON there (``pipelines.drift``).
    ``absent``: the optional feature columns each file lacks (read as missing), counted."""
    types = {**{c: None for c in carry}, **read_types(spec)}
    raw, read_errs = p | "ReadFiles" >> ReadFromFiles(files, with_source=True, columns=list(types),
                                                      column_types=types, with_errors=True)
    inputs, errs, counts = raw | "Featurize" >> beam.ParDo(
        _FeaturizeFn(spec, stats, carry, names.source, absent)).with_outputs(ERRS, COUNTS, main="rows")
    batches, predicted_counts = (
        inputs | "RunInference" >> RunInference(handler)
        | "Predictions" >> beam.ParDo(_OutputFn(kind, classes, version, schema, names,
                                                spec if flag_unseen else None)).with_outputs(COUNTS, main="batches"))
    if out.lower().endswith(".csv"):
        _ = (batches | "CsvText" >> beam.Map(_csv_text) | "NonEmpty" >> beam.Filter(bool)
             | "WriteCsv" >> beam.io.WriteToText(out, shard_name_template="", header=csv_header(schema)))
    else:
        _ = (batches | "Tables" >> beam.Map(lambda b: pa.Table.from_batches([b], schema=schema))
             | "WriteParquet" >> beam.io.WriteToParquetBatched(out, schema, shard_name_template="", num_shards=1))
    _ = (read_errs, errs) | "WriteDeadLetters" >> WriteDeadLettersToJsonl(dead_letters_path)
    if drift is not None:
        from pipelines.drift.transforms import WriteDriftCounts

        _ = inputs | "DriftCounts" >> WriteDriftCounts(drift[0], spec, stats, drift[1])

    read_rejected = read_errs | "CountReadErrs" >> beam.Map(lambda _: {"in": 1, "dead_letters": 1})
    _ = ((counts, predicted_counts, read_rejected) | "AllCounts" >> beam.Flatten()
         | "SumCounts" >> beam.CombineGlobally(_sum_counts)
         | "CountsJson" >> beam.Map(_counts_json, spec)
         | "WriteCounts" >> beam.io.WriteToText(counts_path, shard_name_template=""))

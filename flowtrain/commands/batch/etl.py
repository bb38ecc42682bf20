"""The batch job's first step: the dataset a run trains on. An existing one (``--dataset``, or the resumed
run's), or the Beam ETL's: of the files given (``--input`` with the columns' roles) or of a dataset preset's demo
inputs (``--preset``, default the demo's; ``pipelines.presets``)."""
from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from connectors.dataset import read_manifest
from connectors.dataset_spec import FeatureSpec
from connectors.paths import is_url
from flowtrain.commands.batch.options import BatchJob, range_of
from flowtrain.commands.features.job import backfill, declaration_of, feature_columns
from flowtrain.errors import FlowtrainError
from flowtrain.local.paths import cache_root
from flowtrain.local.runners import pipeline_options
from flowtrain.train.staging import fetch_dir, fetch_inputs
from pipelines.features.declare import parse_join
from pipelines.presets import default_preset, load_preset
from pipelines.tabular import pipeline, preflight
from pipelines.tabular.infer import infer_columns  # pyarrow and Beam's FileSystems: not at `flowtrain --help`
from pipelines.tabular.preflight import expand_inputs

if TYPE_CHECKING:
    from pipelines.tabular.infer import Inferred


def batch_preset(job: BatchJob):
    """The dataset preset a batch without --input builds: --preset's, else the default (the demo's)."""
    try:
        return load_preset(job.preset) if job.preset else default_preset()
    except ValueError as err:
        raise FlowtrainError(f"--preset {job.preset}: {err}" if job.preset else str(err)) from None


def declares_features(job: BatchJob) -> bool:
    """Whether the job names its feature columns (else, with --input, they are inferred from the files)."""
    return bool(job.numeric or job.optional_numeric or job.categorical)


def spec_from(job: BatchJob, inferred: Inferred | None = None):
    """(the --input patterns, or None for a preset's demo inputs; the FeatureSpec the ETL builds): the declared
    columns, or ``inferred``'s (``pipelines.tabular.infer``) where none are declared."""
    if job.preset and job.input:
        raise FlowtrainError("--preset builds a preset's own dataset: leave out --input (or --preset)")
    if not job.input:
        if job.label or job.numeric or job.categorical or job.weight_column:
            raise FlowtrainError("--label/--numeric/--categorical/--weight-column describe your files: give them with "
                                 "--input")
        spec = batch_preset(job).spec
        if job.id_columns:  # the demo with ID columns (e.g. tailnum,route): docs/ids.md
            return None, dataclasses.replace(spec, id_columns=list(job.id_columns), max_id_bytes=job.max_id_bytes,
                                             required_ids=list(job.required_ids))
        return None, spec
    if not job.label:
        raise FlowtrainError("--input needs --label (the column to predict)")
    if job.exclude and declares_features(job):
        raise FlowtrainError("--exclude drops columns from the inferred features: with --numeric/--categorical given, "
                             "leave the columns out of them instead")
    if declares_features(job):
        inferred = None  # declared columns: nothing of an inference applies
    cols = inferred if inferred is not None else job
    try:
        spec = FeatureSpec(
            label=job.label, task=job.task, numeric=list(cols.numeric), categorical=list(cols.categorical),
            optional_numeric=list(cols.optional_numeric), positive_above=job.positive_above,
            positive_class=job.positive_class,
            time_column=job.time_column or (inferred.time_column if inferred is not None else None),
            valid_from=job.valid_from, test_from=job.test_from,
            time_format=job.time_format, seed=job.seed, min_count=job.min_count,
            numeric_range={col: bounds for col, bounds in map(range_of, job.numeric_range)},
            clip_numeric=job.clip_outliers, id_columns=list(job.id_columns), max_id_bytes=job.max_id_bytes,
            required_ids=list(job.required_ids), weight_column=job.weight_column)
    except ValueError as err:
        raise FlowtrainError(str(err)) from None
    return list(job.input), spec


def _infer(job: BatchJob, inputs: list[str]) -> Inferred:
    """The feature columns of the files, inferred (``pipelines.tabular.infer``) and printed once."""
    inferred = infer_columns(expand_inputs(inputs), job.label, exclude=job.exclude, id_columns=job.id_columns,
                             time_column=job.time_column, max_record_bytes=job.max_record_bytes,
                             weight_column=job.weight_column)
    print(inferred.describe(), flush=True)
    return inferred


def _features_over_time(job: BatchJob, inputs: list[str], run_dir: Path) -> tuple[list[str], dict]:
    """``--aggregate``/``--join``: the backfill of the inputs into ``<run>/features.parquet`` (``flowtrain features``'
    code), which the ETL then reads; ([that file], {"columns": their roles, "manifest": the declaration, the time
    column and the aggregated columns' kinds, for the stream})."""
    import pyarrow.parquet as pq

    decl = declaration_of(job)
    table = str(run_dir / "features.parquet")
    counts = backfill(job, inputs, table, overwrite=True)
    columns = feature_columns(decl, pq.read_schema(table), counts["joined"])
    manifest = {"aggregations": list(job.aggregations), "joins": [_joined_from_anywhere(j) for j in job.joins],
                "time_column": job.time_column,
                "time_format": job.time_format, "kinds": counts["kinds"], "columns": columns}
    return [table], {"columns": columns, "manifest": manifest}


def _joined_from_anywhere(join) -> str:
    """A ``--join`` as the dataset records it for the stream: a local table's path made absolute (the stream may run
    from another directory)."""
    j = parse_join(join)
    table = j.table if is_url(j.table) else os.path.abspath(j.table)
    return ":".join([table, "+".join(j.key), *([j.valid_from] if j.valid_from else [])])


def build_dataset(job: BatchJob, run_dir: Path, *, resume: bool) -> tuple[Path, str]:
    """(the dataset directory, the run's title): ``--dataset``'s (fetched from an object store), the resumed run's,
    or the one the ETL writes into ``run_dir/dataset`` (its dead letters in ``run_dir/dead_letters.jsonl``)."""
    beam_args = list(job.beam_args)
    if job.dataset:
        dataset_path = fetch_dir(job.dataset, "--dataset", marker="_manifest.json") if is_url(job.dataset) else \
            Path(job.dataset).resolve()
        read_manifest(dataset_path)
        title = f"dataset {dataset_path}"
    elif resume and (run_dir / "dataset" / "_manifest.json").exists():
        dataset_path = run_dir / "dataset"
        title = "resumed run"
    else:
        dataset_path = run_dir / "dataset"
        inferred, inputs, over_time = None, None, None
        if job.input and job.label and not job.preset:
            inputs = fetch_inputs(list(job.input), "--input")  # on an object store: downloaded once
            if getattr(job, "aggregations", ()) or getattr(job, "joins", ()):  # the backfill, then its rows
                inputs, over_time = _features_over_time(job, inputs, run_dir)
            if not declares_features(job):  # the feature columns from the files' first rows
                inferred = _infer(job, inputs)
        elif getattr(job, "aggregations", ()) or getattr(job, "joins", ()):
            raise FlowtrainError("--aggregate/--join compute features over your events: give them with --input")
        _, spec = spec_from(job, inferred)
        if over_time is not None and declares_features(job):  # the aggregates and joined columns are features too
            roles = over_time["columns"]
            spec = dataclasses.replace(spec, numeric=[*spec.numeric, *roles["numeric"]],
                                       optional_numeric=[*spec.optional_numeric, *roles["optional_numeric"]],
                                       categorical=[*spec.categorical, *roles["categorical"]])
        beam_opts = pipeline_options("batch", beam_args, runner=job.runner, flink_master=job.flink_master)
        dead = str(run_dir / "dead_letters.jsonl")
        t_etl = time.perf_counter()
        if inputs is None:  # the default dataset preset's ETL on its demo inputs (pipelines.presets)
            preset = batch_preset(job)
            if preset.build is None:
                raise FlowtrainError(f"dataset preset {preset.name!r} has no batch ETL: give your files with --input")
            print(f"etl: {preset.describe or preset.name} -> dataset (Beam, "
                  f"{beam_opts.get_all_options()['runner']})", flush=True)
            manifest = preset.build_dataset(preset.demo_inputs(cache_root()), dataset_path=str(dataset_path),
                                            dead_letters_path=dead, options=beam_opts, spec=spec)  # names the preset
            title = preset.title or preset.name
        else:
            spec, why = preflight.resolve_task(preflight.expand_inputs(inputs), spec)
            if why:
                print(f"task: {spec.task} ({why}; --task chooses)", flush=True)
            print(f"etl: {len(inputs)} input pattern(s) -> dataset", flush=True)
            manifest = pipeline.run_tabular_etl(
                inputs, spec, dataset_path=str(dataset_path), dead_letters_path=dead, options=beam_opts,
                max_record_bytes=job.max_record_bytes,
                extra_metadata={**({"inferred": inferred.as_dict()} if inferred is not None else {}),
                                **({"features": over_time["manifest"]} if over_time is not None else {})} or None)
            title = ", ".join(inputs)
        c = manifest["counts"]
        print(f"etl: {c['in']:,} rows in, {c['out']:,} out ({manifest['rows']}), {c['dead_letters']:,} dead "
              f"letters, {time.perf_counter() - t_etl:.1f} s", flush=True)
    return dataset_path, title

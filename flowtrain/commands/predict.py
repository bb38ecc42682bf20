"""Using a model: ``run_predict(PredictJob)`` (``flowtrain predict``, a Beam batch pipeline with RunInference),
``load(bundle)`` (a ``Predictor`` in this process) and ``run_export(ExportJob)`` (``flowtrain export``).

Both paths run the same code on each batch of rows (``pipelines.predict.rows``: the ETL's feature code with
the training statistics; the stream scorer's model handler for the forward; the same output columns), so
``load(DIR).predict(rows)`` equals ``flowtrain predict`` on the same rows.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowtrain.errors import BundleError, FlowtrainError
from flowtrain.fields import at_least, check, option, to_config

_IO = "input and output"
_RUN = "where the Beam pipeline runs"


@dataclass
class PredictJob:
    """The options of ``flowtrain predict``."""

    model: str | None = option(None, "a `flowtrain batch` run directory (its bundle/) or a bundle directory "
                               "(`flowtrain export`)", group=_IO, metavar="RUN_OR_BUNDLE")
    input: tuple[str, ...] = option((), "CSV, Parquet or JSON-lines files or globs to predict (repeat or "
                                    "comma-separate); the label column is optional", group=_IO, repeat=True)
    out: str | None = option(None, "predictions file: Parquet, or CSV when it ends in .csv", group=_IO)
    id_column: str | None = option(None, "copy this column (a row id) to every prediction", group=_IO)
    keep_columns: tuple[str, ...] = option((), "copy these columns too, comma-separated", group=_IO)
    dead_letters: str | None = option(None, "rows that cannot be predicted, with file:line and reason (JSON lines; "
                                      "default <out>.dead_letters.jsonl)", group=_IO)
    overwrite: bool = option(False, "replace an existing --out (and its dead letters and metrics files)", group=_IO)
    threads: int | None = option(None, "torch threads of each worker (default: torch's choice)", parse=at_least(1))
    device: str = option("cpu", "where the forward runs", choices=("cpu", "cuda"))
    runner: str | None = option(None, "flink: the local Flink cluster of `flowtrain flink start`, or "
                                "--flink-master's; any other value is Beam's --runner. Default: Beam's FnApiRunner",
                                group=_RUN)
    flink_master: str | None = option(None, "with --runner flink: the JobManager REST address of another Flink "
                                      "1.19 cluster", group=_RUN, metavar="HOST:PORT")
    beam_args: tuple[str, ...] = option((), "Beam pipeline options (on the command line, give Beam's options as "
                                        "they are)", group=_RUN, repeat=True)


@dataclass
class ExportJob:
    """The options of ``flowtrain export``."""

    run: str | None = option(None, "a `flowtrain batch` run directory", metavar="RUN")
    out: str | None = option(None, "the bundle directory to write")
    overwrite: bool = option(False, "replace an existing --out bundle")
    torch_export: bool = option(False, "also write model.pt2, a torch.export program of the model for use without "
                                "flowtrain (its inputs: see docs/predict.md)")


# --- the in-process predictor ---------------------------------------------------------------------------
class Predictor:
    """A loaded bundle. ``predict(rows)`` takes a pyarrow Table, a pandas DataFrame or a list of dicts with the
    raw columns and returns a pyarrow Table: ``source`` (``row:<n>``, from 1), the ``keep`` columns, then the
    prediction columns and ``model_version``, exactly as ``flowtrain predict`` writes them. Rows whose features
    fail a check are left out and listed in ``last_dead_letters``."""

    def __init__(self, path: str | Path):
        from connectors.dataset_spec import FeatureSpec
        from flowtrain.train.bundle import build_module, read_bundle

        self.bundle = read_bundle(path, option="flowtrain.load")
        self.module = build_module(self.bundle)
        self.spec = FeatureSpec.from_dict(self.bundle.features["spec"])
        self.stats = self.bundle.features["stats"]
        self.kind = self.bundle.features["kind"]
        self.classes = self.bundle.features.get("classes")
        self.target_scale = tuple(self.bundle.model["target_scale"])
        self.version = self.bundle.version
        self.last_dead_letters: list = []
        from pipelines.predict.pipeline import bundle_handler, bundle_version
        from pipelines.serving.handler import ServedModel

        # the model handler flowtrain predict (and the stream scorer) runs: the same forward, in this process
        run = self.bundle.manifest.get("run", "")
        self._handler = bundle_handler(None, str(self.bundle.path), run, self.spec, target_scale=self.target_scale,
                                       n_classes=len(self.classes or []), torch_threads=None)
        self._served = ServedModel(self.module, bundle_version(str(self.bundle.path), run))

    @property
    def columns(self) -> list[str]:
        """The raw columns the model needs."""
        from pipelines.predict.rows import required_columns

        return required_columns(self.spec)

    def predict(self, rows: Any, *, keep: tuple[str, ...] | list[str] = ()) -> Any:
        import pyarrow as pa

        from pipelines.predict.rows import check_columns, featurize_for_prediction, output_batch, read_types
        from pipelines.tabular.features import SchemaError

        table = _as_table(rows)
        try:
            check_columns(table.schema.names, self.spec, "predict(rows)", extra=list(keep))
        except SchemaError as err:
            raise BundleError(str(err)) from None
        types = read_types(self.spec)
        table = table.select([*dict.fromkeys([*keep, *types])])
        for name, t in types.items():  # the types the reader gives the feature columns
            i = table.schema.get_field_index(name)
            if table.schema.field(name).type != t:
                table = table.set_column(i, name, _conform(table.column(name), t))
        batch = table.combine_chunks().to_batches()[0] if table.num_rows else None
        self.last_dead_letters = []
        if batch is None:
            return pa.table({})
        inp, letters = featurize_for_prediction(batch, self.spec, self.stats, list(keep))
        self.last_dead_letters = letters
        if inp is None:
            return pa.table({})
        (result,) = self._handler.run_inference([inp], self._served)
        scores, _scored_ms = result.inference
        return pa.Table.from_batches([output_batch(inp, scores, self.kind, self.classes, self.version)])


def _as_table(rows: Any):
    import pyarrow as pa

    if isinstance(rows, pa.Table):
        return rows
    if isinstance(rows, pa.RecordBatch):
        return pa.Table.from_batches([rows])
    if isinstance(rows, list):
        return pa.Table.from_pylist(rows)
    if type(rows).__module__.startswith("pandas"):
        return pa.Table.from_pandas(rows, preserve_index=False)
    raise FlowtrainError(f"predict(rows): expected a pyarrow Table, a pandas DataFrame or a list of dicts, "
                         f"not a {type(rows).__name__}")


def _conform(col, t):
    """A column as the file reader would type it: numbers from text parsed, categories as text."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from connectors.files import parse_numbers

    col = col.combine_chunks() if hasattr(col, "combine_chunks") else col
    if pa.types.is_floating(t):
        if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
            return parse_numbers(col)[0]
        if pa.types.is_boolean(col.type):
            return pc.cast(pc.cast(col, pa.int8()), t)
        return pc.cast(col, t, safe=False)
    if pa.types.is_boolean(col.type):
        return pc.if_else(col, "true", "false")
    return pc.cast(col, t)


def load(path: str | Path) -> Predictor:
    """A bundle (or a run directory's ``bundle/``) as a ``Predictor``, checked first (checksums, version)."""
    return Predictor(path)


# --- flowtrain predict ------------------------------------------------------------------------------------
def _sidecar(out: Path, suffix: str) -> Path:
    return out.with_name(out.name + suffix)


def run_predict(job: PredictJob) -> dict:
    """Predict files with a Beam pipeline; returns the summary (counts, metrics when labelled) also written to
    ``<out>.metrics.json``. A bad bundle, missing column or path is a ``FlowtrainError`` naming it."""
    from flowtrain.commands.batch import user_error, user_errors

    job = check(job)
    try:
        return _run_predict(job)
    except user_errors() as err:
        raise user_error(err) from err


def _run_predict(job: PredictJob) -> dict:
    import pyarrow as pa

    from connectors.dataset_spec import FeatureSpec
    from flowtrain.local.runners import pipeline_options
    from flowtrain.train.bundle import load_module, read_bundle
    from pipelines.predict.pipeline import build_predict, bundle_handler
    from pipelines.predict.rows import SOURCE_COLUMN, VERSION_COLUMN, check_columns, prediction_columns
    from pipelines.tabular.pipeline import expand_inputs, file_head

    if not job.model:
        raise FlowtrainError("predict needs --model RUN_OR_BUNDLE (a `flowtrain batch` run directory or a bundle)")
    if not job.input:
        raise FlowtrainError("predict needs --input FILES (the rows to predict)")
    if not job.out:
        raise FlowtrainError("predict needs --out PATH (a .parquet or .csv file for the predictions)")
    t0 = time.perf_counter()
    bundle = read_bundle(job.model)
    spec = FeatureSpec.from_dict(bundle.features["spec"])
    kind, classes = bundle.features["kind"], bundle.features.get("classes")
    out = Path(job.out).resolve()
    dead_path = Path(job.dead_letters).resolve() if job.dead_letters else _sidecar(out, ".dead_letters.jsonl")
    metrics_path = _sidecar(out, ".metrics.json")
    if out.is_dir():
        raise FlowtrainError(f"--out {out} is a directory: give a file path ending in .parquet or .csv")
    existing = [p for p in (out, dead_path, metrics_path) if p.exists()]
    if existing and not job.overwrite:
        raise FlowtrainError(f"--out {out}: {existing[0]} exists; give a new path, or --overwrite to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)

    files = expand_inputs(list(job.input))
    extra = [c for c in [job.id_column, *job.keep_columns] if c]
    heads = {}
    for path in files:
        heads[path] = file_head(path)
        check_columns(heads[path].schema.names, spec, path, extra)
    labelled = all(spec.label in h.schema.names for h in heads.values())
    carry = list(dict.fromkeys([*extra, *([spec.label] if labelled else [])]))
    first = next(iter(heads.values()))
    fields = [pa.field(SOURCE_COLUMN, pa.string())] + [first.schema.field(c) for c in carry]
    dummy_scores = __import__("numpy").zeros((0, len(classes or [])) if kind == "multiclass" else 0)
    arrays, names = prediction_columns(dummy_scores, kind, classes)
    fields += [pa.field(n, a.type) for n, a in zip(names, arrays)] + [pa.field(VERSION_COLUMN, pa.string())]
    schema = pa.schema(fields)
    for path in existing:
        path.unlink()

    handler = bundle_handler(load_module, str(bundle.path), bundle.manifest.get("run", ""), spec,
                             target_scale=bundle.model["target_scale"], n_classes=len(classes or []),
                             device=job.device, torch_threads=job.threads)
    options = pipeline_options("batch", list(job.beam_args), runner=job.runner, flink_master=job.flink_master)
    import tempfile

    import apache_beam as beam

    with tempfile.TemporaryDirectory(prefix=".predict-", dir=out.parent) as tmp:
        counts_path = str(Path(tmp) / "counts.json")
        print(f"predict: {len(files)} file(s) with model {bundle.version} -> {out} (Beam, "
              f"{options.get_all_options()['runner']})", flush=True)
        with beam.Pipeline(options=options) as p:
            build_predict(p, files, handler=handler, spec=spec, stats=bundle.features["stats"], carry=carry,
                          out=str(out), schema=schema, dead_letters_path=str(dead_path), counts_path=counts_path,
                          kind=kind, classes=classes, version=bundle.version)
        counts = json.loads(Path(counts_path).read_text())
    if counts["in"] != counts["predictions"] + counts["dead_letters"]:
        raise RuntimeError(f"row counts do not reconcile: in {counts['in']} != predictions {counts['predictions']} "
                           f"+ dead letters {counts['dead_letters']}")
    summary: dict[str, Any] = {"model": str(bundle.path), "model_version": bundle.version, "inputs": files,
                               "out": str(out), "dead_letters": str(dead_path), "counts": counts}
    print(f"predict: {counts['in']:,} rows in, {counts['predictions']:,} predictions, {counts['dead_letters']:,} "
          f"dead letters ({dead_path.name}), {time.perf_counter() - t0:.1f} s", flush=True)
    if labelled:
        summary["metrics"] = _metrics(out, spec, bundle.features, kind, classes)
        if summary["metrics"]:
            shown = {k: v for k, v in summary["metrics"].items() if isinstance(v, (int, float))}
            print("predict: metrics on the labelled rows: " + ", ".join(f"{k} {v:.4f}" for k, v in shown.items()),
                  flush=True)
    metrics_path.write_text(json.dumps(summary, indent=1, default=float) + "\n")
    summary["seconds"] = time.perf_counter() - t0
    return summary


def read_predictions(path: str | Path):
    """A predictions file (Parquet or CSV) as a pyarrow Table."""
    path = str(path)
    if path.lower().endswith(".csv"):
        import pyarrow.csv as pacsv

        return pacsv.read_csv(path)
    import pyarrow.parquet as pq

    return pq.read_table(path)


def _metrics(out: Path, spec, features: dict, kind: str, classes) -> dict:
    """The task's metrics over the predicted rows that have a label (a label the training never saw as a class
    counts as unlabelled)."""
    import numpy as np
    import torch

    from flowtrain.train.loop import metrics_of
    from pipelines.tabular.features import encode_labels

    table = read_predictions(out)
    if table.num_rows == 0:
        return {}
    targets, known = encode_labels(table.column(spec.label).combine_chunks(), spec, features["stats"])
    known &= np.asarray(table.column(spec.label).is_valid().to_numpy(zero_copy_only=False), dtype=bool)
    if not known.any():
        return {}
    y = torch.from_numpy(targets[known].astype(np.float64))
    if kind == "regression":
        out_t = torch.from_numpy(table.column("prediction").to_numpy()[known])
    elif kind == "binary":
        p = np.clip(table.column("probability").to_numpy()[known], 1e-15, 1 - 1e-15)
        out_t = torch.from_numpy(np.log(p) - np.log1p(-p))
    else:
        probs = np.stack([table.column(f"probability_{c}").to_numpy() for c in classes], axis=1)[known]
        out_t = torch.from_numpy(np.log(np.clip(probs, 1e-300, None)))
    metrics = metrics_of(out_t, y, spec.task, classes if kind == "multiclass" else None)
    return {"rows": int(known.sum()), **metrics}


# --- flowtrain export -----------------------------------------------------------------------------------
def run_export(job: ExportJob) -> Path:
    """Write the bundle of run directory ``job.run`` into ``job.out`` (from its model.pt, config.json and
    dataset); returns the bundle's path."""
    import torch

    from flowtrain.commands.batch import BatchJob, train_config
    from flowtrain.fields import build
    from flowtrain.train.bundle import read_bundle, write_bundle
    from flowtrain.train.loader import TabularDataset
    from flowtrain.train.model import build_run_model

    job = check(job)
    if not job.run or not job.out:
        raise FlowtrainError("export needs RUN (a `flowtrain batch` run directory) and --out DIR")
    run = Path(job.run).resolve()
    out = Path(job.out).resolve()
    for name in ("model.pt", "config.json"):
        if not (run / name).is_file():
            raise FlowtrainError(f"export {run}: no {name}; give the directory of a finished `flowtrain batch` run")
    if out.exists() and not job.overwrite and out != run / "bundle":
        raise FlowtrainError(f"--out {out} exists; give a new directory, or --overwrite to replace it")
    options = json.loads((run / "config.json").read_text())
    try:
        batch_job = build(BatchJob, {k: v for k, v in options.items() if k in to_config(BatchJob())})
    except FlowtrainError as err:
        raise FlowtrainError(f"export {run}: config.json: {err}") from None
    dataset = Path(batch_job.dataset) if batch_job.dataset else run / "dataset"
    try:
        data = TabularDataset(dataset)
    except Exception as err:  # noqa: BLE001 - named for the user below
        raise FlowtrainError(f"export {run}: its dataset {dataset} cannot be read ({err}); export needs the run's "
                             f"dataset (later, the bundle alone is enough)") from None
    config = train_config(batch_job)
    model = build_run_model(batch_job.model, data, config)
    model.load_state_dict(torch.load(run / "model.pt", weights_only=True))
    write_bundle(out, model, data, config, factory=batch_job.model, run=run.name, torch_export=job.torch_export)
    read_bundle(out)  # the bundle written checks
    return out

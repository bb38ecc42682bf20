"""Using a model: ``run_predict(PredictJob)`` (``flowtrain predict``, a Beam batch pipeline with RunInference),
``load(bundle)`` (a ``Predictor`` in this process: ``flowtrain.commands.predict.predictor``) and ``run_export(ExportJob)``
(``flowtrain export``).

Both paths run the same code on each batch of rows (``pipelines.predict.rows``: the ETL's feature code with
the training statistics; the stream scorer's model handler for the forward; the same output columns), so
``load(DIR).predict(rows)`` equals ``flowtrain predict`` on the same rows.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from connectors.atomic import atomic_write, fsync_dir
from connectors.dataset_spec import FeatureSpec
from connectors.fields import build, check
from connectors.paths import is_url, origin_of
from flowtrain.commands.dead_letter_bound import check_dead_letters, common_reasons
from flowtrain.commands.drift.job import bundle_reference, drift_lines, predict_drift_section
from flowtrain.commands.predict.options import PredictJob
from flowtrain.commands.user_errors import user_error, user_errors
from flowtrain.errors import FlowtrainError
from flowtrain.local.runners import pipeline_options
from flowtrain.train.bundle import bundle_key, check_code, load_module, read_bundle
from flowtrain.train.metrics import metrics_of
from flowtrain.train.staging import fetch_bundle, fetch_inputs, staged_outputs
from pipelines.predict.pipeline import build_predict, bundle_handler
from pipelines.predict.rows import absent_line, check_columns, output_names, output_schema
from pipelines.tabular.labels import encode_labels
from pipelines.tabular.preflight import expand_inputs, file_head


# --- flowtrain predict ------------------------------------------------------------------------------------
def _sidecar(out: Path, suffix: str) -> Path:
    return out.with_name(out.name + suffix)


def run_predict_options(model: Any, inputs: list, out: Any, options: dict[str, Any]) -> dict:
    """``flowtrain.predict(model, input, out, **options)``: the job of the keyword options, run."""
    return run_predict(build(PredictJob, options, model=str(model), input=inputs, out=str(out)))


def run_predict(job: PredictJob) -> dict:
    """Predict files with a Beam pipeline; returns the summary (counts, metrics when labelled) also written to
    ``<out>.metrics.json``. A bad bundle, missing column or path is a ``FlowtrainError`` naming it."""
    job = check(job)

    try:
        if job.out and (is_url(job.out) or is_url(job.dead_letters)):
            summary = _predict_to_stores(job)
        else:
            summary = _run_predict(job)
    except user_errors() as err:
        raise user_error(err) from err
    # the outputs are written (the dead letters with their reasons); nothing predicted, or more dead letters than
    # --max-dead-letter-fraction allows, is exit status 3
    counts = summary["counts"]
    check_dead_letters(counts["in"], counts["dead_letters"], job.max_dead_letter_fraction, what="rows",
                       where=summary["dead_letters"],
                       reasons=common_reasons(summary["dead_letters"]) if counts["dead_letters"] else "",
                       nothing_used=counts["predictions"] == 0, done="predicted")
    return summary


def _run_predict(job: PredictJob) -> dict:
    if not job.model:
        raise FlowtrainError("predict needs --model RUN_OR_BUNDLE (a `flowtrain batch` run directory or a bundle)")
    if not job.input:
        raise FlowtrainError("predict needs --input FILES (the rows to predict)")
    if not job.out:
        raise FlowtrainError("predict needs --out PATH (a .parquet or .csv file for the predictions)")
    t0 = time.perf_counter()

    model = fetch_bundle(job.model, "--model") if is_url(job.model) else job.model  # checked as a local one
    bundle = read_bundle(model, key=bundle_key(job.bundle_key_file))
    check_code(bundle, job.trust_code)  # a user's factory: only with --trust-code, before any worker starts
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

    files = expand_inputs(fetch_inputs(list(job.input), "--input"))  # on an object store: downloaded once
    extra = [c for c in [job.id_column, *job.keep_columns] if c]
    heads, absent = {}, {}
    for path in files:
        heads[path] = file_head(path)
        absent[path] = check_columns(heads[path].schema.names, spec, path, extra)
    labelled = all(spec.label in h.schema.names for h in heads.values())
    carry = list(dict.fromkeys([*extra, *([spec.label] if labelled else [])]))
    first = next(iter(heads.values()))
    names = output_names(carry, kind, classes)
    fields = [pa.field(names.source, pa.string())] + [first.schema.field(c) for c in carry]
    schema = output_schema(fields, kind, classes, names, job.flag_unseen)

    # each worker checks the bundle again (with the key from the same file or environment) and runs no code
    # unless --trust-code
    loader = functools.partial(load_module, trust_code=job.trust_code, key_file=job.bundle_key_file)
    handler = bundle_handler(loader, str(bundle.path), bundle.manifest.get("run", ""), spec,
                             target_scale=bundle.model["target_scale"], n_classes=len(classes or []),
                             device=job.device, torch_threads=job.threads)
    options = pipeline_options("batch", list(job.beam_args), runner=job.runner, flink_master=job.flink_master)

    import apache_beam as beam

    # the new outputs are written beside the old ones under temporary names and replace them only once all of
    # them are complete: a run that fails (a bad --runner, a crash) leaves the previous outputs as they were
    staged = {path: path.with_name(f".partial-{os.getpid()}-{path.name}") for path in (out, dead_path, metrics_path)}
    try:
        with tempfile.TemporaryDirectory(prefix=".predict-", dir=out.parent) as tmp:
            counts_path = str(Path(tmp) / "counts.json")

            reference = bundle_reference(bundle)  # None for a bundle written before drift references
            drift_path = str(Path(tmp) / "drift.json")
            print(f"predict: {len(files)} file(s) with model {bundle.version} -> {out} (Beam, "
                  f"{options.get_all_options()['runner']})", flush=True)
            for name in names.renamed.items():
                print(f"predict: the input has a column {name[0]}: the predictions' column is {name[1]}", flush=True)
            with beam.Pipeline(options=options) as p:
                build_predict(p, files, handler=handler, spec=spec, stats=bundle.features["stats"], carry=carry,
                              out=str(staged[out]), schema=schema, dead_letters_path=str(staged[dead_path]),
                              counts_path=counts_path, kind=kind, classes=classes, version=bundle.version,
                              names=names, flag_unseen=job.flag_unseen,
                              drift=(reference, drift_path) if reference is not None else None,
                              absent={origin_of(f): cols for f, cols in absent.items() if cols})
            counts = json.loads(Path(counts_path).read_text())
            drift_counts = json.loads(Path(drift_path).read_text()) if reference is not None else None
        unseen = counts.pop("unseen", None) or {c: 0 for c in spec.categorical}
        absent_rows = counts.pop("absent", None) or {}
        if counts["in"] != counts["predictions"] + counts["dead_letters"]:
            raise RuntimeError(f"row counts do not reconcile: in {counts['in']} != predictions "
                               f"{counts['predictions']} + dead letters {counts['dead_letters']}")
        summary: dict[str, Any] = {"model": str(bundle.path), "model_version": bundle.version,
                                   "inputs": [origin_of(f) for f in files],  # a downloaded file by its URL
                                   "out": str(out), "dead_letters": str(dead_path), "counts": counts,
                                   "columns": _columns(names), "unseen": unseen}
        if names.renamed:
            summary["renamed_columns"] = dict(names.renamed)
        if absent_rows:  # optional feature columns an input file lacked: read as missing, said once
            summary["absent_columns"] = absent_rows
            lacking = sorted({origin_of(f) for f, cols in absent.items() if cols})
            print(f"predict: {absent_line(absent_rows, ', '.join(lacking))}", flush=True)
        print(f"predict: {counts['in']:,} rows in, {counts['predictions']:,} predictions, "
              f"{counts['dead_letters']:,} dead letters ({dead_path.name}), {time.perf_counter() - t0:.1f} s",
              flush=True)
        seen = {c: n for c, n in unseen.items() if n}
        if seen:
            print("predict: predicted with a categorical value training never saw (or a missing one): "
                  + ", ".join(f"{c} {n:,} row(s)" for c, n in seen.items())
                  + ("" if job.flag_unseen else f" (--flag-unseen lists them per row in {names.unseen})"), flush=True)
        if labelled:
            summary["metrics"] = _metrics(staged[out], spec, bundle.features, kind, classes, names)
            if summary["metrics"]:
                shown = {k: v for k, v in summary["metrics"].items() if isinstance(v, (int, float))}
                print("predict: metrics on the labelled rows: " + ", ".join(
                    f"{k} {v:,}" if isinstance(v, int) else f"{k} {v:.4f}" for k, v in shown.items()), flush=True)

        # the rows against the model's training data (its bundle's drift reference; none in an older bundle)
        summary["drift"] = None if reference is None else predict_drift_section(
            reference, drift_counts, scores=_scores(staged[out], kind, names), thresholds=job.drift_threshold)
        if summary["drift"] is not None:
            print(drift_lines(summary["drift"], prefix="predict: drift"), flush=True)

        # written whole (tmp, fsync, rename), then every output renamed into place and the renames made durable
        atomic_write(staged[metrics_path], json.dumps(summary, indent=1, default=float) + "\n")
        for final, partial in staged.items():
            os.replace(partial, final)
        for parent in {p.parent for p in staged}:
            fsync_dir(parent)
    finally:
        for partial in staged.values():
            if partial.is_file():
                partial.unlink()
    summary["seconds"] = time.perf_counter() - t0
    return summary


def _predict_to_stores(job: PredictJob) -> dict:
    """``flowtrain predict`` with ``--out`` (or ``--dead-letters``) on an object store: written locally, then
    uploaded, ``<out>.metrics.json`` last (it says the outputs are complete)."""
    dead = job.dead_letters or job.out + ".dead_letters.jsonl"
    outputs = {"--out": job.out, "--dead-letters": dead, "metrics": job.out + ".metrics.json"}
    with staged_outputs(outputs, overwrite=job.overwrite, last="metrics") as local:
        summary = _run_predict(dataclasses.replace(job, out=local["--out"], dead_letters=local["--dead-letters"]))
        summary.update(out=job.out, dead_letters=dead)
        metrics = Path(local["metrics"])
        if metrics.is_file():  # it names the URLs, not the local copies
            written = json.loads(metrics.read_text())
            written.update(out=job.out, dead_letters=dead)
            atomic_write(metrics, json.dumps(written, indent=1, default=float) + "\n")
    print(f"predict: published {job.out}, {dead} and {outputs['metrics']} (last)", flush=True)
    return summary


def _columns(names) -> dict:
    """The summary's names of the columns flowtrain added (``pipelines.predict.rows.output_names``)."""
    return {"source": names.source, "predictions": names.predictions, "model_version": names.version,
            "unseen": names.unseen}


def read_predictions(path: str | Path, columns: list[str] | None = None):
    """A predictions file (Parquet or CSV) as a pyarrow Table (``columns``: only those)."""
    path = str(path)
    if path.lower().endswith(".csv"):
        import pyarrow.csv as pacsv

        return pacsv.read_csv(path, convert_options=pacsv.ConvertOptions(include_columns=columns)
                              if columns else None)
    import pyarrow.parquet as pq

    return pq.read_table(path, columns=columns)


def _score_columns(kind: str, names) -> list[str]:
    """The predictions' score columns: the class probabilities (K classes), P(positive) (binary), the value."""
    return list(names.probabilities) if kind == "multiclass" else [
        names.value if kind == "regression" else names.probabilities[0]]


def _scores(out: Path, kind: str, names):
    """The model's scores in a predictions file (binary: P(positive); K classes: (rows, K) probabilities;
    regression: the value), for the drift section; None for an empty file."""
    wanted = _score_columns(kind, names)
    table = read_predictions(out, wanted)  # the score columns only
    if table.num_rows == 0:
        return None
    if kind == "multiclass":
        return np.stack([table.column(c).to_numpy() for c in wanted], axis=1)
    return table.column(wanted[0]).to_numpy()


def _metrics(out: Path, spec, features: dict, kind: str, classes, names) -> dict:
    """The task's metrics over the predicted rows that have a label (a label the training never saw as a class
    counts as unlabelled)."""
    table = read_predictions(out, [spec.label, *_score_columns(kind, names)])  # the label and scores only
    if table.num_rows == 0:
        return {}
    targets, known = encode_labels(table.column(spec.label).combine_chunks(), spec, features["stats"])
    known &= np.asarray(table.column(spec.label).is_valid().to_numpy(zero_copy_only=False), dtype=bool)
    if not known.any():
        return {}
    y = torch.from_numpy(targets[known].astype(np.float64))
    if kind == "regression":
        out_t = torch.from_numpy(table.column(names.value).to_numpy()[known])
    elif kind == "binary":
        p = np.clip(table.column(names.probabilities[0]).to_numpy()[known], 1e-15, 1 - 1e-15)
        out_t = torch.from_numpy(np.log(p) - np.log1p(-p))
    else:
        probs = np.stack([table.column(c).to_numpy() for c in names.probabilities], axis=1)[known]
        out_t = torch.from_numpy(np.log(np.clip(probs, 1e-300, None)))
    metrics = metrics_of(out_t, y, spec.task, classes if kind == "multiclass" else None)
    return {"rows": int(known.sum()), **metrics}

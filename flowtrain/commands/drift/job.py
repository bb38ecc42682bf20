"""``flowtrain drift``: a file set against a run's reference profile, and the reference itself.

``build_reference(data, model)`` is the profile ``flowtrain batch`` writes as ``<run>/drift_reference.json``
and into the bundle (``pipelines.drift.profile``: the training split's features and label, the model's scores
on the validation split). ``run_drift(DriftJob)`` reads files in this process, featurizes them with the model's
training statistics (the code ``flowtrain predict`` runs), runs the model for the score distribution, and
compares every feature, the label and the scores with the reference (``pipelines.drift.measures``): a JSON
and an HTML report (``flowtrain.observe.drift_report``) under ``--out``. ``flowtrain drift`` exits with 3
when a measure crosses its threshold.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from connectors.atomic import atomic_write
from connectors.dataset_spec import FeatureSpec
from connectors.fields import check
from connectors.files import file_format, iter_unit, list_units
from connectors.rows import DeadLetter
from flowtrain.commands.drift.options import REFERENCE, DriftJob
from flowtrain.commands.user_errors import user_error, user_errors
from flowtrain.errors import BundleError, FlowtrainError
from flowtrain.observe.drift_report import render_report
from flowtrain.train.bundle import build_module, bundle_key, read_bundle
from flowtrain.train.loader import target_scale
from flowtrain.train.loop import predict
from pipelines.drift.compare import compare
from pipelines.drift.measures import parse_thresholds
from pipelines.drift.profile import (
    Counter,
    check_profile,
    counts_from_json,
    merge,
    read_train_sample,
    reference_profile,
    score_counts,
)
from pipelines.predict.rows import check_columns, featurize_for_prediction, read_types
from pipelines.serving.forward import forward
from pipelines.tabular.labels import encode_labels
from pipelines.tabular.preflight import expand_inputs, file_head


# --- the reference a batch run writes --------------------------------------------------------------------
def build_reference(data, model, *, max_rows: int = 200_000) -> dict:
    """The reference profile of a ``TabularDataset``'s training split and ``model``'s scores on its
    validation split (binary: P(positive); K classes: probabilities; regression: the value)."""
    train = read_train_sample(str(data.path), data.spec, rows=max_rows)
    scores = None
    valid = data.split("valid")
    if len(valid):
        out = predict(model, valid, scale=target_scale(data) if data.kind == "regression" else (0.0, 1.0))
        if data.kind == "binary":
            out = torch.sigmoid(out)
        elif data.kind == "multiclass":
            out = torch.softmax(out, dim=1)
        scores = out.detach().cpu().numpy().astype(np.float64)
    return reference_profile(train, data.spec, data.stats, classes=data.classes, scores=scores)


def write_reference(run_dir: Path, data, model) -> dict:
    """``build_reference`` written to ``<run_dir>/drift_reference.json`` (atomically); returns it."""
    reference = build_reference(data, model)
    atomic_write(Path(run_dir) / REFERENCE, json.dumps(reference) + "\n")
    return reference


def load_reference(bundle, where: str) -> dict:
    """The reference profile of a bundle (checked with its checksums), else the run directory's; a model
    trained before references existed is a ``FlowtrainError`` saying to train again."""
    profile = bundle.extra_json(REFERENCE)
    if profile is None:
        raise FlowtrainError(f"{where}: the bundle {bundle.path} has no {REFERENCE} (trained before drift "
                             f"references existed); run `flowtrain batch` again to get one")
    try:
        return check_profile(profile, FeatureSpec.from_dict(bundle.features["spec"]), f"{bundle.path / REFERENCE}")
    except ValueError as err:
        raise FlowtrainError(str(err)) from None


# --- measuring files ---------------------------------------------------------------------------------------
def measure_files(files: list[str], bundle, profile: dict, *, module=None, scores=None) -> tuple[dict, dict]:
    """``(counts, totals)`` of ``files`` (read and featurized in this process like ``flowtrain predict``):
    the window counts of ``pipelines.drift.profile`` and ``{"in", "counted", "dead_letters"}``. ``module``: the
    model to run for the scores; ``scores``: scores already made (``flowtrain predict``'s), used instead."""
    spec = FeatureSpec.from_dict(bundle.features["spec"])
    stats, classes = bundle.features["stats"], bundle.features.get("classes")
    counter = Counter(profile)
    counts = counter.empty()
    totals = {"in": 0, "counted": 0, "dead_letters": 0}
    heads = {path: file_head(path).schema.names for path in files}
    for path, names in heads.items():
        check_columns(names, spec, path)  # a file without the model's columns: named before any reading
    for path in files:
        labelled = spec.label in heads[path]
        types = {**read_types(spec), **({spec.label: None} if labelled else {})}
        for unit in list_units(path, file_format(path)):
            for item in iter_unit(unit, columns=list(types), column_types=types, with_source=True):
                if isinstance(item, DeadLetter):
                    totals["in"] += 1
                    totals["dead_letters"] += 1
                    continue
                totals["in"] += item.num_rows
                inp, letters = featurize_for_prediction(item, spec, stats, carry=[spec.label] if labelled else [])
                totals["dead_letters"] += len(letters)
                if inp is None:
                    continue
                label = None
                if labelled:
                    targets, known = encode_labels(inp.carry.column(spec.label), spec, stats)
                    label = np.where(known, targets, np.nan)
                batch_scores = None
                if module is not None:
                    batch_scores = forward(module, inp.features, spec, n_classes=len(classes or []),
                                           target_scale=tuple(bundle.model["target_scale"]),
                                           what=f"the model of {bundle.path}")
                counts = merge(counts, counter.count(inp.features, label, batch_scores))
                totals["counted"] += inp.features.num_rows
    if scores is not None and profile.get("prediction") is not None:
        counts["prediction"] = score_counts(profile["prediction"], np.asarray(scores))
    return counts, totals


def run_drift(job: DriftJob) -> dict:
    """Compare ``job.input`` with ``job.model``'s reference; write ``<out>/drift.json`` and ``drift.html``; return
    the report (``report["alarms"]``: the features over a threshold; the command exits 3 when any)."""
    job = check(job)
    try:
        return _run_drift(job)
    except user_errors() as err:
        raise user_error(err) from err


def _run_drift(job: DriftJob) -> dict:
    if not job.model:
        raise FlowtrainError("drift needs --model RUN_OR_BUNDLE (a `flowtrain batch` run directory or a bundle)")
    if not job.input:
        raise FlowtrainError("drift needs --input FILES (the rows to compare with the training data)")
    t0 = time.perf_counter()
    bundle = read_bundle(job.model, key=bundle_key(job.bundle_key_file))
    profile = load_reference(bundle, f"--model {job.model}")
    module = None
    if not job.no_model:
        try:
            module = build_module(bundle, trust_code=job.trust_code)
        except BundleError as err:
            raise FlowtrainError(f"{err} (or --no-model: compare the features and label only)") from None
    files = expand_inputs(list(job.input))
    counts, totals = measure_files(files, bundle, profile, module=module)
    report = compare(profile, counts, parse_thresholds(job.drift_threshold), min_rows=job.min_rows)
    report.update({"model": str(bundle.path), "model_version": bundle.version, "inputs": files, "totals": totals})
    out = Path(job.out)
    if out.exists() and not out.is_dir():
        raise FlowtrainError(f"--out {out} is a file: give a directory for drift.json and drift.html")
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "drift.json", json.dumps(report, indent=1, default=float) + "\n")
    atomic_write(out / "drift.html", render_report(report, title=f"drift of {', '.join(files)[:200]}"))
    report["seconds"] = time.perf_counter() - t0
    print(drift_lines(report, prefix="drift"), flush=True)
    print(f"drift: report {out / 'drift.html'} (and drift.json)", flush=True)
    return report


def drift_lines(report: dict, *, prefix: str) -> str:
    """What a command prints of a comparison: rows, each alarm with its measures, data-quality findings."""
    lines = [f"{prefix}: {report['rows']:,} rows compared with the training data; "
             + (f"ALARM: {', '.join(report['alarms'])}" if report["alarms"] else "no measure over its threshold")]
    for entry in report["features"]:
        if entry["alarm"]:
            shown = ", ".join(f"{m} {entry['measures'][m]:.3g}" if m in entry["measures"] else m
                              for m in entry["alarms"])
            lines.append(f"{prefix}:   {entry['feature']} ({entry['kind']}): {shown}")
    for q in report["quality"]:
        lines.append(f"{prefix}: data quality: {q['feature']}: {q['detail']}")
    return "\n".join(lines)


def bundle_reference(bundle) -> dict | None:
    """The bundle's reference profile, None when it has none (a bundle from before drift references)."""
    try:
        return load_reference(bundle, "predict")
    except FlowtrainError:
        return None


def predict_drift_section(profile: dict, counts: dict, *, scores=None, thresholds: str = "") -> dict[str, Any]:
    """The drift section of ``flowtrain predict``'s summary: the rows' ``counts`` (``WriteDriftCounts`` in its
    pipeline, as JSON) and ``scores`` (the predictions it made) against the bundle's reference ``profile``."""
    counts = counts_from_json(counts)
    if scores is not None and profile.get("prediction") is not None:
        counts["prediction"] = score_counts(profile["prediction"], np.asarray(scores))
    report = compare(profile, counts, parse_thresholds(thresholds))
    return {"rows": report["rows"], "alarms": report["alarms"], "quality": report["quality"],
            "prediction_drift": report["prediction_drift"], "thresholds": report["thresholds"],
            "features": [{k: e[k] for k in ("feature", "kind", "measures", "alarms", "alarm")}
                         for e in report["features"]]}

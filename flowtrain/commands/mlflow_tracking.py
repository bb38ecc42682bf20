"""A run in MLflow (``--mlflow URI``): its parameters, per-step metrics, report and bundle, and a registered pyfunc model.

``log_batch_run`` logs a finished ``flowtrain batch`` run directory: every option of config.json as a parameter,
metrics.jsonl's training and validation lines as per-step metrics (``train_loss``, ``valid_auc``, ... at their
step), the test metrics (``test_<metric>``), the report, summary and figures as artifacts, the bundle under
``bundle/``, and the model as an MLflow pyfunc (``FlowtrainPyfunc``: the bundle inside, ``flowtrain.load`` at load
time) with a signature of the raw feature columns, registered as ``--mlflow-model`` (default: the experiment's
name). ``mlflow.pyfunc.load_model("models:/NAME/VERSION").predict(df)`` returns what
``flowtrain.load(bundle).predict(df)`` returns: the same DataFrame, the same numbers.

A trial of ``flowtrain tune`` is a nested run of the study's (``FLOWTRAIN_MLFLOW_PARENT`` in its environment) and
registers nothing; the study registers its best trial's model (``log_study``). ``log_stream_run`` logs the online
trainer's run. MLflow is imported here only (``flowtrain[mlflow]``).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import mlflow
import mlflow.pyfunc
import pandas as pd
import torch
from mlflow.entities import Metric
from mlflow.models import ModelSignature
from mlflow.tracking import MlflowClient
from mlflow.types import ColSpec, Schema

from flowtrain.commands.predict.predictor import load
from flowtrain.train.bundle import write_bundle
from flowtrain.train.loader import TabularDataset
from flowtrain.train.metrics import MetricsLog
from flowtrain.train.published import LoadPublishedVersion
from flowtrain.train.rundir.files import RunFiles
from flowtrain.version import __version__

#: The study's MLflow run id, in a trial's environment: the trial's run is its child.
PARENT_ENV = "FLOWTRAIN_MLFLOW_PARENT"
#: Files of a run directory logged as artifacts (the figures: every .png at its top).
ARTIFACTS = ("report.md", "report.html", "summary.json", "config.json", "training.json", "fit.json")


class FlowtrainPyfunc(mlflow.pyfunc.PythonModel):
    """A flowtrain bundle as an MLflow pyfunc: ``predict(DataFrame)`` is ``flowtrain.load(bundle).predict``."""

    def load_context(self, context) -> None:
        self.predictor = load(context.artifacts["bundle"])

    def predict(self, context, model_input: pd.DataFrame, params: dict | None = None) -> pd.DataFrame:
        return self.predictor.predict(model_input)


def signature_of(bundle: Path) -> tuple[ModelSignature, pd.DataFrame]:
    """The pyfunc's signature (the raw feature columns: numerics as doubles, optional ones not required,
    categoricals and ID columns as strings; the prediction columns out) and a two-row input example."""
    predictor = load(bundle)
    spec, stats = predictor.spec, predictor.stats
    example: dict[str, list] = {}
    cols = []
    for name in spec.numeric:
        cols.append(ColSpec("double", name))
    for name in spec.optional_numeric:
        cols.append(ColSpec("double", name, required=False))
    for name in [*spec.categorical, *spec.id_columns]:
        cols.append(ColSpec("string", name))
    numeric, vocab = stats.get("numeric") or {}, stats.get("vocab") or {}
    for c in cols:
        if c.type.name == "double":
            value = float((numeric.get(c.name) or {}).get("mean", 0.0))
            example[c.name] = [value, value]
        else:
            values = list(vocab.get(c.name) or ["unknown"])
            example[c.name] = [str(values[0]), str(values[-1])]
    frame = pd.DataFrame(example)
    out = predictor.predict(frame)
    outputs = Schema([ColSpec("double" if str(out[n].dtype).startswith("float") else "string", n, required=False)
                      for n in out.columns])
    return ModelSignature(inputs=Schema(cols), outputs=outputs), frame


def _params(config: dict) -> dict[str, str]:
    return {k: (",".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v))[:6000]
            for k, v in config.items() if v is not None and v != [] and v != ()}


def _metric_rows(history: list[dict]) -> list[tuple[str, float, int]]:
    rows = []
    for r in history:
        kind = r.get("kind")
        if kind not in ("train", "valid"):
            continue
        for k, v in r.items():
            if k in ("kind", "model", "step", "epoch") or not isinstance(v, (int, float)) or isinstance(v, bool):
                continue
            if v == v:  # NaN is not logged
                rows.append((f"{kind}_{k}", float(v), int(r.get("step", 0))))
    return rows


def _start(uri: str, experiment: str, name: str):
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment(experiment)
    parent = os.environ.get(PARENT_ENV)
    tags = {"mlflow.parentRunId": parent} if parent else {}
    return mlflow.start_run(run_name=name, tags=tags)


def log_model(bundle: Path, registered: str | None) -> Any:
    """The bundle as the run's pyfunc model (registered as ``registered`` when given)."""
    signature, example = signature_of(bundle)
    return mlflow.pyfunc.log_model(name="model", python_model=FlowtrainPyfunc(), artifacts={"bundle": str(bundle)},
                                   signature=signature, input_example=example, registered_model_name=registered,
                                   pip_requirements=[f"flowtrain=={__version__}"])


def log_batch_run(uri: str, run_dir: Path, *, experiment: str, model_name: str | None) -> str:
    """Log the finished batch run in ``run_dir``; returns the MLflow run id."""
    run_dir = Path(run_dir)
    summary = json.loads(RunFiles(run_dir).summary.read_text())
    config = json.loads(RunFiles(run_dir).config.read_text())
    nested = bool(os.environ.get(PARENT_ENV))
    with _start(uri, experiment, run_dir.name) as run:
        mlflow.log_params(_params(config))
        client = MlflowClient()
        rows = _metric_rows(MetricsLog(RunFiles(run_dir).metrics).read())
        for i in range(0, len(rows), 900):  # MLflow's log_batch takes at most 1,000 metrics
            client.log_batch(run.info.run_id, metrics=[Metric(k, v, 0, s) for k, v, s in rows[i:i + 900]])
        mlflow.log_metrics({f"test_{k}": float(v) for k, v in summary["test"]["model"].items()
                            if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v})
        choice = summary.get("model_choice") or {}
        mlflow.set_tags({"flowtrain.task": summary.get("task"), "flowtrain.kind": summary.get("kind"),
                         "flowtrain.chosen": choice.get("chosen", ""), "flowtrain.run_dir": str(run_dir)})
        for name in ARTIFACTS:
            if (run_dir / name).is_file():
                mlflow.log_artifact(str(run_dir / name))
        for png in sorted(run_dir.glob("*.png")):
            mlflow.log_artifact(str(png), artifact_path="figures")
        mlflow.log_artifacts(str(RunFiles(run_dir).bundle), artifact_path="bundle")
        log_model(RunFiles(run_dir).bundle, None if nested else (model_name or experiment))
        return run.info.run_id


def start_study(uri: str, experiment: str, name: str, params: dict) -> str:
    """The study's parent run (its id goes to every trial as ``FLOWTRAIN_MLFLOW_PARENT``)."""
    with _start(uri, experiment, name) as run:
        mlflow.log_params(_params(params))
        return run.info.run_id


def log_study(uri: str, run_id: str, out: Path, summary: dict, *, model_name: str | None, experiment: str) -> None:
    """The study's result on its run: the best value, the report and plots, the best trial's model registered."""
    mlflow.set_tracking_uri(uri)
    with mlflow.start_run(run_id=run_id):
        best = summary.get("best")
        if best:
            mlflow.log_metric(f"best_valid_{summary['metric']}", float(best["value"]))
            mlflow.log_params({f"best_{k}": str(v) for k, v in best["params"].items()})
        for name in ("tune_report.md", "best.json", "trials.json", *summary.get("figures", [])):
            if (out / name).is_file():
                mlflow.log_artifact(str(out / name))
        if best and Path(best["bundle"]).is_dir():
            log_model(Path(best["bundle"]), model_name or experiment)


def stream_bundle(out: Path, dataset: str | Path) -> Path | None:
    """The online trainer's newest published whole version (``<out>/published/ckpt-<version>.pt``) as a bundle in
    ``<out>/bundle``; None when it published none (a model with ID tables publishes deltas: no bundle here)."""
    out = Path(out)
    versions = sorted(out.glob("published/ckpt-*.pt"), key=lambda p: int(p.stem.split("-")[1]))
    if not versions:
        return None
    model, version = LoadPublishedVersion(dataset)(str(versions[-1]))
    arch = dict(torch.load(versions[-1], weights_only=True, map_location="cpu").get("architecture") or {})
    config = type("Shape", (), {"hidden": tuple(arch.get("hidden") or ()), "dropout": arch.get("dropout", 0.0)})()
    return write_bundle(RunFiles(out).bundle, model, TabularDataset(dataset), config, run=f"{out.name}@v{version}")


def log_stream_run(uri: str, out: Path, *, config: dict, dataset: str | Path, experiment: str,
                   model_name: str | None) -> str:
    """The online trainer's run: its options, its prequential metrics per published version (``stream_*`` at their
    step) and, when it published a whole version, that version as the bundle and the registered model."""
    out = Path(out)
    history = [r for r in MetricsLog(RunFiles(out).metrics).read() if r.get("kind") == "prequential"]
    with _start(uri, experiment, out.name) as run:
        mlflow.log_params(_params(config))
        client = MlflowClient()
        rows = [(f"stream_{k}", float(v), int(r.get("step", 0))) for r in history for k, v in r.items()
                if k not in ("kind", "step", "version") and isinstance(v, (int, float)) and not isinstance(v, bool)
                and v == v]
        for i in range(0, len(rows), 900):
            client.log_batch(run.info.run_id, metrics=[Metric(k, v, 0, s) for k, v, s in rows[i:i + 900]])
        bundle = stream_bundle(out, dataset)
        if bundle is not None:
            mlflow.log_artifacts(str(bundle), artifact_path="bundle")
            log_model(bundle, model_name or experiment)
        return run.info.run_id

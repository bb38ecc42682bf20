"""flowtrain: train PyTorch models straight from Apache Beam dataflows.

The Python API is the command line's jobs, with the same options (the fields of ``BatchJob``,
``PredictJob``, ``ExportJob``) and the same results::

    import flowtrain

    summary = flowtrain.batch(input=["train.csv"], label="y", numeric=["x1", "x2"], categorical=["c"],
                              out="runs/demo")
    flowtrain.predict(model="runs/demo", input=["new.csv"], out="predictions.parquet")
    predictor = flowtrain.load("runs/demo/bundle")
    table = predictor.predict([{"x1": 0.3, "x2": -1.2, "c": "a"}])

A user's error (bad option, input, bundle) raises ``flowtrain.FlowtrainError`` with a one-line message.
Everything is imported on first use: ``import flowtrain`` stays cheap.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flowtrain.errors import BundleError, FlowtrainError

__version__ = "0.1.0"
__all__ = ["batch", "predict", "load", "export", "BatchJob", "PredictJob", "ExportJob", "FlowtrainError",
           "BundleError", "__version__"]

if TYPE_CHECKING:
    from pathlib import Path

    from flowtrain.commands.batch import BatchJob
    from flowtrain.commands.predict import ExportJob, PredictJob, Predictor


def batch(job: BatchJob | None = None, /, **options: Any) -> dict:
    """Run the batch job (``flowtrain batch``): ETL -> dataset -> linear start -> training -> baselines ->
    report -> bundle. ``options`` are ``BatchJob``'s fields (``input``, ``label``, ``numeric``, ``epochs``,
    ``workers``, ``model``...), checked as the command line checks them. Returns the run's summary (as
    ``summary.json``). With ``dataset=DIR`` it trains on an existing dataset directory (no ETL).

    (There is no ``flowtrain.train(...)``: ``flowtrain.train`` is the engine's package.)"""
    from flowtrain.commands.batch import BatchJob, run_batch
    from flowtrain.fields import build, to_config

    if job is not None:
        options = {**to_config(job), **options}
    return run_batch(build(BatchJob, options))


def predict(model: str, input: Any, out: str, **options: Any) -> dict:  # noqa: A002 - the option's name
    """``flowtrain predict``: predict files with a run's (or a bundle's) model in a Beam pipeline; ``options``
    are ``PredictJob``'s fields (``id_column``, ``keep_columns``, ``runner``...). Returns counts and, where the
    files hold the label, the metrics."""
    from flowtrain.commands.predict import PredictJob, run_predict
    from flowtrain.fields import build

    inputs = [input] if isinstance(input, str) else list(input)
    return run_predict(build(PredictJob, options, model=str(model), input=inputs, out=str(out)))


def load(path: str) -> Predictor:
    """A bundle (``<run>/bundle`` or ``flowtrain export``'s directory), checked, as a predictor whose
    ``predict(rows)`` (a pyarrow Table, a pandas DataFrame or a list of dicts) equals ``flowtrain predict``."""
    from flowtrain.commands.predict import load as load_bundle

    return load_bundle(path)


def export(run: str, out: str, **options: Any) -> Path:
    """``flowtrain export``: write a run's bundle into ``out``."""
    from flowtrain.commands.predict import ExportJob, run_export
    from flowtrain.fields import build

    return run_export(build(ExportJob, options, run=str(run), out=str(out)))


def __getattr__(name: str) -> Any:
    if name == "BatchJob":
        from flowtrain.commands.batch import BatchJob

        return BatchJob
    if name in ("PredictJob", "ExportJob"):
        from flowtrain.commands import predict as _predict

        return getattr(_predict, name)
    raise AttributeError(f"module 'flowtrain' has no attribute {name!r}")

"""flowtrain: train PyTorch models straight from Apache Beam dataflows.

The Python API is the command line's jobs, with the same options (the fields of ``BatchJob``,
``PredictJob``, ``ExportJob``) and the same results::

    import flowtrain

    summary = flowtrain.batch(input=["train.csv"], label="y", numeric=["x1", "x2"], categorical=["c"],
                              out="runs/demo")
    flowtrain.predict(model="runs/demo", input=["new.csv"], out="predictions.parquet")
    predictor = flowtrain.load("runs/demo/bundle")
    rows = predictor.predict([{"x1": 0.3, "x2": -1.2, "c": "a"}])  # [{"pred_probability_1": ..., ...}]

The streaming jobs too (``ReplayJob``, ``StreamJob``: the options of ``flowtrain replay`` and ``flowtrain stream``)::

    flowtrain.replay(bootstrap="127.0.0.1:9092", input=["events.csv"], dataset="runs/demo/dataset")
    flowtrain.stream(dataset="runs/demo/dataset", out="runs/stream", idle_exit=30)  # until stopped or idle
    flowtrain.score(dataset="runs/demo/dataset", out="runs/stream")  # `flowtrain stream score`

A user's error (bad option, input, bundle) raises ``flowtrain.FlowtrainError`` with a one-line message.
Everything is imported on first use: ``import flowtrain`` stays cheap.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from connectors.fields import build as _build
from connectors.fields import to_config as _to_config
from flowtrain.commands.features.options import FeaturesJob
from flowtrain.errors import BundleError, FlowtrainError
from flowtrain.version import __version__

__all__ = ["batch", "predict", "load", "export", "replay", "stream", "score", "predictions", "features", "BatchJob",
           "PredictJob", "ExportJob", "ReplayJob", "StreamJob", "FeaturesJob", "FlowtrainError", "BundleError",
           "__version__"]

if TYPE_CHECKING:
    from flowtrain.commands.batch.options import BatchJob, ExportJob
    from flowtrain.commands.predict.options import PredictJob
    from flowtrain.commands.predict.predictor import Predictor
    from flowtrain.commands.stream.options import ReplayJob, StreamJob


def batch(job: BatchJob | None = None, /, **options: Any) -> dict:
    """Run the batch job (``flowtrain batch``): ETL -> dataset -> linear start -> training -> baselines ->
    report -> bundle. ``options`` are ``BatchJob``'s fields (``input``, ``label``, ``numeric``, ``epochs``,
    ``workers``, ``model``...), checked as the command line checks them. ``input`` may also be a pandas DataFrame
    or a pyarrow Table (written to a temporary Parquet file the ETL reads). Without ``numeric``/``categorical``
    the feature columns are inferred from the data (printed once). Returns the run's summary (as
    ``summary.json``). With ``dataset=DIR`` it trains on an existing dataset directory (no ETL).

    (There is no ``flowtrain.train(...)``: ``flowtrain.train`` is the engine's package.)"""
    from flowtrain.commands.batch.job import run_batch_options

    if job is not None:
        options = {**_to_config(job), **options}
    return run_batch_options(options)


def features(job: FeaturesJob | None = None, /, **options: Any) -> dict:
    """``flowtrain features``: every ``aggregations`` (``--aggregate KEY:COLUMN:AGGS:WINDOWS``) and ``joins``
    (``--join TABLE:KEY[:VALID_FROM]``) of every row of ``input`` over ``[t - w, t)`` in event time, written to
    ``out`` (one Parquet file, input order; docs/features.md). Returns the counts."""
    from flowtrain.commands.features.job import run_features

    if job is not None:
        options = {**_to_config(job), **options}
    return run_features(_build(FeaturesJob, options))


def predict(model: str, input: Any, out: str, **options: Any) -> dict:  # noqa: A002 - the option's name
    """``flowtrain predict``: predict files with a run's (or a bundle's) model in a Beam pipeline; ``options``
    are ``PredictJob``'s fields (``id_column``, ``keep_columns``, ``runner``...). Returns counts and, where the
    files hold the label, the metrics."""
    from flowtrain.commands.predict.job import run_predict_options

    return run_predict_options(model, [input] if isinstance(input, str) else list(input), out, options)


def load(path: str, *, trust_code: bool = False, bundle_key_file: str | None = None) -> Predictor:
    """A bundle (``<run>/bundle`` or ``flowtrain export``'s directory), checked, as a predictor whose
    ``predict(rows)`` (a pyarrow Table or RecordBatch, a pandas DataFrame or a list of dicts) returns one row per
    input row, in the type given, with the predictions of ``flowtrain predict`` (``pred_*`` columns; a row that
    cannot be predicted has nulls and its ``pred_reason``). Loading imports no Beam and runs no code: a bundle
    whose model is a user's ``--model MODULE:FACTORY`` is refused unless
    ``trust_code=True``; with ``bundle_key_file`` (or ``$FLOWTRAIN_BUNDLE_KEY``) its signature is verified."""
    from flowtrain.commands.predict.predictor import load as load_bundle

    return load_bundle(path, trust_code=trust_code, bundle_key_file=bundle_key_file)


def export(run: str, out: str, **options: Any) -> str:
    """``flowtrain export``: write a run's bundle into ``out``. Returns where the bundle is, always a ``str``: its
    absolute local path, or the object-store URL given as ``out`` (``flowtrain.load`` takes either)."""
    from flowtrain.commands.batch.export import run_export
    from flowtrain.commands.batch.options import ExportJob

    return run_export(_build(ExportJob, options, run=str(run), out=str(out)))


def _options(job: Any, options: dict) -> dict:
    """A job object's options updated by keyword options (the Python API takes either, or both)."""
    return options if job is None else {**_to_config(job), **options}


def replay(job: ReplayJob | None = None, /, **options: Any) -> dict:
    """``flowtrain replay``: a table's rows (``input``), the demo's events, or a generated click stream
    (``generate="clicks"``) as events into a Kafka topic, every one acknowledged. ``options`` are ``ReplayJob``'s
    fields. Returns the counts (events, unlabelled, each malformed kind) and the seconds it took."""
    from flowtrain.commands.stream.options import ReplayJob
    from flowtrain.commands.stream.replay import run_replay

    return run_replay(_build(ReplayJob, _options(job, options)))


def stream(job: StreamJob | None = None, /, *, half: str | None = None, beam_args: tuple[str, ...] = (),
           **options: Any) -> int:
    """``flowtrain stream``: the feature pipeline and the online trainer (with ``score=True`` the scorer too) as
    supervised child processes, or with ``half`` ("pipeline", "train", "score") that part in this process, until
    stopped (Ctrl-C, SIGTERM) or done (``idle_exit``). ``options`` are ``StreamJob``'s fields; ``beam_args`` Beam
    pipeline options. Returns the exit status (0: every part ended cleanly)."""
    from flowtrain.commands.stream.job import run_stream
    from flowtrain.commands.stream.options import StreamJob

    return run_stream(_build(StreamJob, _options(job, options)), beam_args, half=half)


def predictions(topic: str | None = None, **options: Any) -> Any:
    """``flowtrain predictions``: every prediction on a scorer's predictions topic now, as a pyarrow Table (the
    ``pred_*`` columns of ``flowtrain predict``, the event's id and label); ``options`` are ``PredictionsJob``'s
    (``bootstrap``, ``predictions_format``, ``schema_registry``, ``dataset`` (its scorer's topic by default),
    ``limit``...)."""
    from flowtrain.commands.stream.predictions_read import read_predictions

    return read_predictions(topic, **options)


def score(job: Any = None, /, *, beam_args: tuple[str, ...] = (), **options: Any) -> int:
    """``flowtrain stream score``: the scoring pipeline alone (``stream(..., half="score")``); ``options`` are
    ``StreamScoreJob``'s fields (any ``StreamJob`` field is taken)."""
    return stream(job, half="score", beam_args=beam_args, **options)


def __getattr__(name: str) -> Any:
    if name == "BatchJob":
        from flowtrain.commands.batch.options import BatchJob

        return BatchJob
    if name == "PredictJob":
        from flowtrain.commands.predict.options import PredictJob

        return PredictJob
    if name == "ExportJob":
        from flowtrain.commands.batch.options import ExportJob

        return ExportJob
    if name in ("ReplayJob", "StreamJob"):
        from flowtrain.commands.stream import options as _stream

        return getattr(_stream, name)
    raise AttributeError(f"module 'flowtrain' has no attribute {name!r}")

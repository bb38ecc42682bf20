"""MLflow tracking's options (``--mlflow URI``), one declaration for ``flowtrain batch``, ``tune`` and ``stream train``
(stdlib only: ``--help`` imports it; MLflow itself is imported only when a run tracks, ``flowtrain[mlflow]``)."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from connectors.fields import option
from flowtrain.errors import FlowtrainError

TRACKING = "tracking (MLflow)"


@dataclass
class TrackingOptions:
    """Where a run's parameters, metrics, report, bundle and model go (``flowtrain.commands.mlflow_tracking``); at
    the top level of a ``--config``, as the command's own options."""

    mlflow: str | None = option(None, "log the run to this MLflow tracking server or store (http://host:port, "
                                "file:DIR, sqlite:///FILE): parameters, per-step metrics, the report and bundle as "
                                "artifacts, and a registered pyfunc model with a signature (docs/mlflow.md; needs "
                                "pip install 'flowtrain[mlflow]')", group=TRACKING, metavar="URI")
    mlflow_experiment: str = option("flowtrain", "the MLflow experiment of the run", group=TRACKING, metavar="NAME")
    mlflow_model: str | None = option(None, "the registered model's name (default: the experiment's name)",
                                      group=TRACKING, metavar="NAME")


def check_tracking(job: TrackingOptions) -> None:
    """``--mlflow`` without MLflow installed: an error before any work, naming the extra to install."""
    if job.mlflow and importlib.util.find_spec("mlflow") is None:
        raise FlowtrainError(f"--mlflow {job.mlflow}: MLflow is not installed; pip install 'flowtrain[mlflow]' (or "
                             f"leave out --mlflow)")

"""Prequential evaluation (test, then train) of the online trainer: its metrics and their plot.

Each batch is scored by the current model before the model trains on it; the (outputs, labels)
since the last checkpoint give the task's metrics there (``prequential_metrics``, logged with each
checkpoint), and ``plot_prequential`` draws them by step into ``<run_dir>/prequential.png``.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from flowtrain.train.metrics import MetricsLog, metrics_of
from flowtrain.train.rundir.files import RunFiles


def prequential_metrics(window: list[tuple[np.ndarray, np.ndarray]], task: str, classes: Sequence | None, *,
                        shift: float, scale: float) -> dict:
    """The task's metrics (flowtrain.train.metrics) on predictions made before training on the rows; ``shift`` and
    ``scale`` bring a regression's outputs back to the label's units."""
    if not window:
        return {}
    outputs = torch.from_numpy(np.concatenate([s for s, _ in window]))
    labels = torch.from_numpy(np.concatenate([y for _, y in window]))
    if task == "regression":
        outputs = outputs * scale + shift  # in the label's units
    found = metrics_of(outputs, labels, task, classes)
    out = {k: float(v) for k, v in found.items()
           if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
    return {**out, "rows": int(labels.shape[0])}


def plot_prequential(log: MetricsLog, run_dir: Path, task: str = "classification") -> None:
    """``<run_dir>/prequential.png``: the prequential loss (and AUC, or RMSE) by step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in log.read() if r.get("kind") == "prequential" and "loss" in r]
    if not rows:
        return
    second = "rmse" if task == "regression" else "auc"
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], "o-", label="prequential loss")
    if any(second in r for r in rows):
        ax2 = ax.twinx()
        ax2.plot([r["step"] for r in rows if second in r], [r[second] for r in rows if second in r], "s--",
                 color="tab:orange", label=f"prequential {second.upper()}")
        ax2.set_ylabel(second.upper())
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("online training (evaluate, then train, per batch)")
    fig.tight_layout()
    png = RunFiles(run_dir).prequential_png
    tmp = png.with_name(png.name + ".tmp.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    tmp.replace(png)

"""The figures of a run, as PNG: the training and validation curves (``loss.png``, ``metric.png``), the confusion
matrix, and the evaluation's figures (ROC, precision-recall, calibration, residuals, predicted vs actual,
permutation importance). ``flowtrain.train.report`` writes the report that shows them."""
from __future__ import annotations

from pathlib import Path

import matplotlib

from connectors.atomic import atomic_file

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

#: Validation metrics that are shares of the rows (or of row pairs): one row of the validation
#: split moves them by about 1/rows, the finest change the split can show.
RATE_METRICS = frozenset({"accuracy", "auc", "macro_f1", "positive_rate", "f1", "precision", "recall",
                          "average_precision"})


def flat_within_one_row(values: list[float], metric: str, valid_rows: int | None) -> float | None:
    """1/``valid_rows`` when ``metric`` is a share of the rows and ``values`` span less than that (the
    curve moves by less than one validation row: a plot scaled to it shows noise as a trend), else None."""
    finite = [v for v in values if isinstance(v, (int, float)) and v == v and abs(v) != float("inf")]
    if metric not in RATE_METRICS or not valid_rows or len(finite) < 2:
        return None
    one_row = 1.0 / valid_rows
    return one_row if max(finite) - min(finite) < one_row else None


def plot_curves(history: list[dict], run_dir: Path, *, task: str, name: str = "model",
                metric: str | None = None, valid_rows: int | None = None) -> list[str]:
    """``loss.png`` (train and validation loss) and ``metric.png`` (the validation metric that
    selects the best model: ``metric``, else AUC or RMSE). A share-of-rows metric whose curve spans
    less than one validation row (``valid_rows``) is drawn on a y-axis widened to one row either
    side, and the figure says so."""
    train = [r for r in history if r.get("kind") == "train" and r.get("model") == name]
    valid = [r for r in history if r.get("kind") == "valid" and r.get("model") == name]
    files = []
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss", alpha=0.7)
    if valid:
        ax.plot([r["step"] for r in valid], [r["loss"] for r in valid], "o-", label="validation loss", markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("loss")
    ax.legend()
    fig.tight_layout()
    with atomic_file(run_dir / "loss.png") as fh:  # whole or not at all
        fig.savefig(fh, format="png", dpi=100)
    plt.close(fig)
    files.append("loss.png")
    key = metric or ("auc" if task == "classification" else "rmse")
    valid = [r for r in valid if key in r]
    if valid:
        fig, ax = plt.subplots(figsize=(7, 4))
        values = [r[key] for r in valid]
        ax.plot([r["step"] for r in valid], values, "o-", markersize=3)
        ax.set_xlabel("step")
        ax.set_ylabel(f"validation {key}")
        ax.set_title(f"validation {key}")
        one_row = flat_within_one_row(values, key, valid_rows)
        if one_row is not None:  # widen: a range under one row is noise drawn as a trend
            finite = [v for v in values if v == v]
            middle = (max(finite) + min(finite)) / 2
            low = min(max(middle - one_row, 0.0), 1.0 - 2 * one_row) if one_row < 0.5 else middle - one_row
            ax.set_ylim(low, low + 2 * one_row)
            ax.set_title(f"validation {key}: flat within one validation row")
            ax.text(0.01, 0.03, f"the curve moves by less than one row of the validation split (1/{valid_rows:,} = "
                    f"{one_row:.4g}):\nthe y-axis is widened to one row either side", transform=ax.transAxes,
                    fontsize=8, color="dimgrey")
        fig.tight_layout()
        with atomic_file(run_dir / "metric.png") as fh:
            fig.savefig(fh, format="png", dpi=100)
        plt.close(fig)
        files.append("metric.png")
    return files


def _plain(text) -> str:
    """A name from the data as a figure label: text, never matplotlib math (``$...$``)."""
    return str(text).replace("$", r"\$")


def plot_confusion(run_dir: Path, confusion: list[list[int]], classes: list[str], *,
                   name: str = "confusion.png", title: str = "test confusion matrix (model)") -> Path:
    """The confusion matrix as a PNG: rows the true class, columns the predicted one, counts in the cells."""
    k = len(classes)
    size = min(2.0 + 0.6 * k, 14)
    fig, ax = plt.subplots(figsize=(size + 1, size))
    image = ax.imshow(confusion, cmap="Blues")
    ax.set_xticks(range(k), labels=[_plain(c) for c in classes], rotation=45 if k > 4 else 0, ha="right" if k > 4 else "center")
    ax.set_yticks(range(k), labels=[_plain(c) for c in classes])
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    ax.set_title(title)
    top = max((max(row) for row in confusion), default=0)
    if k <= 30:
        for i, row in enumerate(confusion):
            for j, n in enumerate(row):
                ax.text(j, i, str(n), ha="center", va="center", color="white" if n > top / 2 else "black")
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    fig.tight_layout()
    path = run_dir / name
    with atomic_file(path) as fh:
        fig.savefig(fh, format="png", dpi=100)
    plt.close(fig)
    return path



# --- figures of the evaluation ---------------------------------------------------------------------
MODEL, LINEAR = "flowtrain model", "linear model"


def model_equals_linear(predictions: dict) -> bool:
    """The model's test predictions equal the linear baseline's (the model reported at step 0 is its
    linear part): drawn alone, its curves would lie hidden under the baseline's."""
    a, b = predictions.get(MODEL), predictions.get(LINEAR)
    return a is not None and b is not None and np.shape(a) == np.shape(b) and bool(
        np.allclose(a, b, rtol=0, atol=1e-6))


def plot_evaluation(run_dir: Path, evaluation) -> list[str]:
    """The figures of an ``flowtrain.train.evaluation.Evaluation``: binary ``roc.png``, ``pr.png``,
    ``calibration.png``; regression ``residuals.png``, ``predicted_vs_actual.png``; every task
    ``importance.png``. One curve (or panel) per model. Returns the file names."""
    from sklearn.metrics import precision_recall_curve, roc_curve

    run_dir = Path(run_dir)
    y, preds, kind, files = evaluation.y, evaluation.predictions, evaluation.kind, []
    same = model_equals_linear(preds)

    def label(name: str, text: str) -> str:
        return f"{name} ({text})\n= linear model: the same predictions,\nits line lies under the linear model's" \
            if same and name == MODEL else f"{name} ({text})"

    def style(name: str) -> dict:  # the model under an identical baseline: a wide pale band around its line
        return {"lw": 5, "alpha": 0.35} if same and name == MODEL else {}

    def save(fig, name: str) -> None:
        fig.tight_layout()
        with atomic_file(run_dir / name) as fh:
            fig.savefig(fh, format="png", dpi=100)
        plt.close(fig)
        files.append(name)

    if kind == "binary" and 0 < (y > 0.5).sum() < len(y):
        fig, ax = plt.subplots(figsize=(5.5, 5))
        for name, p in preds.items():
            fpr, tpr, _ = roc_curve(y > 0.5, p)
            auc = evaluation.summary["intervals"]["models"][name]["auc"]["value"]
            ax.plot(fpr, tpr, label=label(name, f"AUC {auc:.3f}"), **style(name))
        ax.plot([0, 1], [0, 1], ":", color="grey")
        ax.set(xlabel="false positive rate", ylabel="true positive rate", title="ROC curve (test)")
        ax.legend(loc="lower right", fontsize=8 if same else None)
        save(fig, "roc.png")
        fig, ax = plt.subplots(figsize=(5.5, 5))
        for name, p in preds.items():
            precision, recall, _ = precision_recall_curve(y > 0.5, p)
            ap = evaluation.summary["binary"][name]["average_precision"]
            ax.plot(recall, precision, label=label(name, f"AP {ap:.3f}"), **style(name))
        ax.axhline(float((y > 0.5).mean()), ls=":", color="grey", label="positive rate")
        ax.set(xlabel="recall", ylabel="precision", title="precision / recall (test)")
        ax.legend(loc="upper right", fontsize=8 if same else None)
        save(fig, "pr.png")
        fig, ax = plt.subplots(figsize=(5.5, 5))
        for name in preds:
            b = evaluation.summary["binary"][name]
            cal = b["calibration"]
            ax.plot(cal["mean_predicted"], cal["observed_rate"], "o-", markersize=3,
                    label=label(name, f"Brier {b['brier']:.4f}"), **style(name))
        ax.plot([0, 1], [0, 1], ":", color="grey", label="perfectly calibrated")
        ax.set(xlabel="mean predicted probability (decile of the test rows)", ylabel="observed positive rate",
               title="calibration (test)")
        ax.legend(loc="upper left", fontsize=8 if same else None)
        save(fig, "calibration.png")
    if kind == "regression" and len(y):
        k = len(preds)
        for name_file, title in (("predicted_vs_actual.png", "predicted vs actual"), ("residuals.png", "residuals")):
            fig, axes = plt.subplots(1, k, figsize=(4.2 * k, 4), squeeze=False)
            for ax, (name, p) in zip(axes[0], preds.items()):
                if name_file == "residuals.png":
                    ax.scatter(p, y - p, s=3, alpha=0.3)
                    ax.axhline(0, color="grey", ls=":")
                    ax.set(xlabel="predicted", ylabel="actual - predicted")
                else:
                    ax.scatter(y, p, s=3, alpha=0.3)
                    lo, hi = float(min(y.min(), p.min())), float(max(y.max(), p.max()))
                    ax.plot([lo, hi], [lo, hi], color="grey", ls=":")
                    ax.set(xlabel="actual", ylabel="predicted")
                ax.set_title(f"{title}: {name}" + (" (= linear model: the same predictions)"
                                                   if same and name == MODEL else ""), fontsize=9)
            save(fig, name_file)
    features = evaluation.summary["importance"]["features"][:15]
    if features:
        fig, ax = plt.subplots(figsize=(6.5, 0.35 * len(features) + 1.2))
        names = [_plain(f["feature"]) for f in features][::-1]
        mean = np.array([f["importance"] for f in features])[::-1]
        err = np.array([[f["importance"] - f["low"] for f in features],
                        [f["high"] - f["importance"] for f in features]])
        ax.barh(names, mean, xerr=np.nan_to_num(err[:, ::-1]), color="tab:blue", alpha=0.8)
        ax.axvline(0, color="grey", lw=0.8)
        metric = evaluation.summary["importance"]["metric"]
        ax.set(xlabel=f"drop of test {metric} when the feature is shuffled", title="permutation importance (model)")
        save(fig, "importance.png")
    return files

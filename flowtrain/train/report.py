"""What a run leaves for a person: curves and a confusion matrix as PNG, ``report.md`` and ``summary.json``."""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

#: Test metrics shown in the report per kind of task: (summary key, column title).
REPORT_METRICS = {"binary": [("auc", "AUC"), ("accuracy", "accuracy"), ("log_loss", "log loss")],
                  "multiclass": [("accuracy", "accuracy"), ("macro_f1", "macro-F1"), ("log_loss", "log loss")],
                  "regression": [("rmse", "RMSE"), ("mae", "MAE"), ("r2", "R²")]}


def plot_curves(history: list[dict], run_dir: Path, *, task: str, name: str = "model",
                metric: str | None = None) -> list[str]:
    """``loss.png`` (train and validation loss) and ``metric.png`` (the validation metric that
    selects the best model: ``metric``, else AUC or RMSE)."""
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
    fig.savefig(run_dir / "loss.png", dpi=100)
    plt.close(fig)
    files.append("loss.png")
    key = metric or ("auc" if task == "classification" else "rmse")
    valid = [r for r in valid if key in r]
    if valid:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot([r["step"] for r in valid], [r[key] for r in valid], "o-", markersize=3)
        ax.set_xlabel("step")
        ax.set_ylabel(f"validation {key}")
        ax.set_title(f"validation {key}")
        fig.tight_layout()
        fig.savefig(run_dir / "metric.png", dpi=100)
        plt.close(fig)
        files.append("metric.png")
    return files


def plot_confusion(run_dir: Path, confusion: list[list[int]], classes: list[str], *,
                   name: str = "confusion.png", title: str = "test confusion matrix (model)") -> Path:
    """The confusion matrix as a PNG: rows the true class, columns the predicted one, counts in the cells."""
    k = len(classes)
    size = min(2.0 + 0.6 * k, 14)
    fig, ax = plt.subplots(figsize=(size + 1, size))
    image = ax.imshow(confusion, cmap="Blues")
    ax.set_xticks(range(k), labels=classes, rotation=45 if k > 4 else 0, ha="right" if k > 4 else "center")
    ax.set_yticks(range(k), labels=classes)
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
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _fmt(v) -> str:
    return f"{v:.4f}" if isinstance(v, float) else str(v)


def write_report(run_dir: Path, summary: dict) -> Path:
    task = summary["task"]
    kind = summary.get("kind") or ("binary" if task == "classification" else "regression")
    keys = REPORT_METRICS[kind]
    rows = [("flowtrain model", summary["test"]["model"])] + [
        (f"baseline: {n}", m) for n, m in summary["test"]["baselines"].items()]
    counts = summary["counts"]
    training = summary["training"]
    plan = training.get("plan") or {}
    what = {"binary": "binary classification", "multiclass": f"{len(summary.get('classes') or [])}-class "
            f"classification", "regression": "regression"}[kind]
    lines = [
        f"# flowtrain run: {summary['title']}",
        "",
        f"Target: {summary['target']} ({what}). Test split: {summary['rows']['test']:,} rows.",
        *([f"Classes (from the training split): {', '.join(summary['classes'])}."] if summary.get("classes") else []),
        "",
        "| model | " + " | ".join(f"test {title}" for _, title in keys) + " |",
        "|---|" + "---|" * len(keys),
        *[f"| {n} | " + " | ".join(_fmt(m.get(k)) for k, _ in keys) + " |" for n, m in rows],
        "",
    ]
    if kind == "multiclass":
        model = summary["test"]["model"]
        lines += ["Per class (flowtrain model, test split):", "",
                  "| class | precision | recall | support |", "|---|---|---|---|",
                  *[f"| {c} | {v['precision']:.4f} | {v['recall']:.4f} | {v['support']:,} |"
                    for c, v in model.get("per_class", {}).items()],
                  "", "![confusion matrix](confusion.png)", ""]
    linear = summary.get("linear")
    lines += [
        "## Data",
        f"- rows in: {counts['in']:,}; rows out: {counts['out']:,}; dead letters: {counts['dead_letters']:,} "
        f"(`dead_letters.jsonl`)",
        *[f"  - {reason}: {n:,}" for reason, n in counts.get("dead_letters_by_reason", {}).items()],
        "- splits: " + ", ".join(f"{k} {v:,}" for k, v in summary["rows"].items()),
        f"- dataset: `{summary['dataset']}`",
        "",
        "## Training",
        *([f"- plan: batch size {plan['batch_size']}, {plan['steps']:,}-step budget ({plan['steps_per_epoch']} "
           f"steps per epoch), lr {plan['lr']:g} warmed up over {plan['warmup_steps']} steps then cosine decay "
           f"over {plan['horizon']:,}, validation every {plan['eval_every']} steps, patience {plan['patience']}"]
          if plan else []),
        f"- {training['steps']:,} steps ({training['epochs_run']} epochs), best validation "
        f"{summary.get('select_by') or 'loss'} at step {training.get('best_step', '?')}"
        f"{' (stopped early)' if training['stopped_early'] else ''}",
        f"- training time {training['seconds']:.1f} s; waiting on data "
        f"{100 * training['data_wait_fraction']:.2f}% of step time",
        *([f"- linear baseline: {linear['method']}, {linear['iterations']} iterations, final gradient norm "
           f"{linear['grad_norm']:.1e}, L2 {linear['l2']:.2e}; the model's linear part starts from it"]
          if linear else []),
        f"- wall time of the whole run {summary['wall_seconds']:.1f} s",
        "",
        "![loss](loss.png)",
        "",
        "![validation metric](metric.png)",
        "",
    ]
    path = run_dir / "report.md"
    path.write_text("\n".join(lines))
    return path


def write_summary(run_dir: Path, summary: dict) -> Path:
    path = run_dir / "summary.json"
    path.write_text(json.dumps(summary, indent=2, default=float))
    return path

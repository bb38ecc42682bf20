"""What a run leaves for a person: curves as PNG, ``report.md`` and ``summary.json``."""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_curves(history: list[dict], run_dir: Path, *, task: str, name: str = "model") -> list[str]:
    """``loss.png`` (train and validation loss) and ``metric.png`` (validation AUC or RMSE)."""
    train = [r for r in history if r.get("kind") == "train" and r.get("model") == name]
    valid = [r for r in history if r.get("kind") == "valid" and r.get("model") == name]
    files = []
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss", alpha=0.7)
    if valid:
        ax.plot([r["step"] for r in valid], [r["loss"] for r in valid], "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(run_dir / "loss.png", dpi=100)
    plt.close(fig)
    files.append("loss.png")
    key = "auc" if task == "classification" else "rmse"
    if valid:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot([r["epoch"] + 1 for r in valid], [r[key] for r in valid], "o-")
        ax.set_xlabel("epoch")
        ax.set_ylabel(f"validation {key}")
        ax.set_title(f"validation {key}")
        fig.tight_layout()
        fig.savefig(run_dir / "metric.png", dpi=100)
        plt.close(fig)
        files.append("metric.png")
    return files


def _fmt(v) -> str:
    return f"{v:.4f}" if isinstance(v, float) else str(v)


def write_report(run_dir: Path, summary: dict) -> Path:
    task = summary["task"]
    keys = ["auc", "accuracy", "loss"] if task == "classification" else ["rmse", "mae", "loss"]
    rows = [("flowtrain model", summary["test"]["model"])] + [
        (f"baseline: {n}", m) for n, m in summary["test"]["baselines"].items()]
    counts = summary["counts"]
    lines = [
        f"# flowtrain run: {summary['title']}",
        "",
        f"Target: {summary['target']} ({task}). Test split: {summary['rows']['test']:,} rows.",
        "",
        "| model | " + " | ".join(f"test {k}" for k in keys) + " |",
        "|---|" + "---|" * len(keys),
        *[f"| {n} | " + " | ".join(_fmt(m.get(k)) for k in keys) + " |" for n, m in rows],
        "",
        "## Data",
        f"- rows in: {counts['in']:,}; rows out: {counts['out']:,}; dead letters: {counts['dead_letters']:,} "
        f"(`dead_letters.jsonl`)",
        *[f"  - {reason}: {n:,}" for reason, n in counts.get("dead_letters_by_reason", {}).items()],
        "- splits: " + ", ".join(f"{k} {v:,}" for k, v in summary["rows"].items()),
        f"- dataset: `{summary['dataset']}`",
        "",
        "## Training",
        f"- {summary['training']['epochs_run']} epochs, {summary['training']['steps']:,} steps, best epoch "
        f"{summary['training']['best_epoch']}{' (stopped early)' if summary['training']['stopped_early'] else ''}",
        f"- training time {summary['training']['seconds']:.1f} s; waiting on data "
        f"{100 * summary['training']['data_wait_fraction']:.2f}% of step time",
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

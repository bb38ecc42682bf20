"""``flowtrain compare RUN RUN...``: batch runs side by side.

Reads each run directory's ``config.json``, ``summary.json`` and ``metrics.jsonl`` and writes, to
``--out``:

- ``compare.md``: the options that differ between the runs, then the test metrics of each run's
  model with their 95% bootstrap intervals (``value [low, high]``; runs written before the
  intervals existed show the point estimate), the model-minus-linear difference where present;
- ``compare.png``: the runs' validation curves overlaid (validation loss and the selection metric);
- ``compare.json``: the same numbers for machines.

The Markdown table is printed too.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from flowtrain.errors import FlowtrainError

#: Options that say where a run is, not how it trained: never shown as a difference.
NOT_OPTIONS = {"out", "resume", "no_progress", "print_config", "config"}


@dataclass
class Run:
    name: str
    path: Path
    options: dict
    summary: dict
    history: list[dict]


def load_run(path: str | Path) -> Run:
    """A finished batch run; anything else is a ``FlowtrainError`` naming the directory."""
    path = Path(path)
    if not path.is_dir():
        raise FlowtrainError(f"compare: {path}: no such run directory")
    summary_file = path / "summary.json"
    if not summary_file.is_file():
        raise FlowtrainError(f"compare: {path}: not a finished `flowtrain batch` run (no summary.json); give run "
                             f"directories of batch runs")
    try:
        summary = json.loads(summary_file.read_text())
        config = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    except json.JSONDecodeError as err:
        raise FlowtrainError(f"compare: {path}: unreadable summary.json or config.json ({err})") from None
    history = []
    if (path / "metrics.jsonl").is_file():
        history = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return Run(path.name, path, flatten_options(config), summary, history)


def flatten_options(config: dict) -> dict:
    """A run's options as one flat dict: ``config.json`` is the job's options (with older runs: its
    ``options`` and ``train`` sections)."""
    if "options" in config or "train" in config:
        flat = {**(config.get("train") or {}), **(config.get("options") or {})}
    else:
        flat = dict(config)
    return {k: v for k, v in flat.items() if k not in NOT_OPTIONS}


def _show(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return "nan" if value != value else f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value)) or "–"
    return str(value)


def _unique_names(runs: list[Run]) -> None:
    """Runs are named by their directory; two of the same name by their whole path."""
    names = [r.name for r in runs]
    for run in runs:
        if names.count(run.name) > 1:
            run.name = str(run.path)


def test_metrics(summary: dict) -> dict[str, dict]:
    """The model's test metrics: ``{metric: {"value", "low", "high"}}`` (no interval: low/high None)."""
    intervals = ((summary.get("evaluation") or {}).get("intervals") or {}).get("models", {}).get("flowtrain model")
    if intervals:
        return intervals
    model = (summary.get("test") or {}).get("model") or {}
    return {k: {"value": v, "low": None, "high": None} for k, v in model.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "loss"}


def _ci(m: dict | None) -> str:
    if not m:
        return "–"
    if m.get("low") is None:
        return _show(m["value"])
    return f"{m['value']:.4f} [{m['low']:.4f}, {m['high']:.4f}]"


def compare(paths: list[str | Path], out: str | Path) -> dict:
    """Load the runs, write ``compare.md``, ``compare.png`` and ``compare.json`` to ``out``; returns
    ``{"markdown", "files", "options", "metrics"}``."""
    if len(paths) < 2:
        raise FlowtrainError("compare: give at least two run directories")
    runs = [load_run(p) for p in paths]
    _unique_names(runs)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    keys = sorted({k for r in runs for k in r.options})
    differ = [k for k in keys if len({json.dumps(r.options.get(k), sort_keys=True, default=str) for r in runs}) > 1]
    metrics = [k for k in dict.fromkeys(m for r in runs for m in test_metrics(r.summary))]
    lines = [f"# flowtrain compare: {len(runs)} runs", "",
             "| run | directory | task | test rows |", "|---|---|---|---|",
             *[f"| {r.name} | `{r.path}` | {r.summary.get('kind') or r.summary.get('task')} | "
               f"{(r.summary.get('rows') or {}).get('test', '–'):,} |" for r in runs], ""]
    if differ:
        lines += ["## Options that differ", "", "| option | " + " | ".join(r.name for r in runs) + " |",
                  "|---|" + "---|" * len(runs),
                  *[f"| {k} | " + " | ".join(_show(r.options.get(k)) for r in runs) + " |" for k in differ], ""]
    else:
        lines += ["All runs have the same options.", ""]
    lines += ["## Test metrics (flowtrain model)", "",
              "Point estimate [95% bootstrap interval]; the intervals come from each run's own test split.", "",
              "| metric | " + " | ".join(r.name for r in runs) + " |", "|---|" + "---|" * len(runs),
              *[f"| {m} | " + " | ".join(_ci(test_metrics(r.summary).get(m)) for r in runs) + " |" for m in metrics],
              ""]
    diffs = [(r, ((r.summary.get("evaluation") or {}).get("intervals") or {}).get("difference")) for r in runs]
    if any(d for _, d in diffs):
        lines += ["Model minus its linear baseline (paired bootstrap):", "",
                  "| metric | " + " | ".join(r.name for r in runs) + " |", "|---|" + "---|" * len(runs),
                  *[f"| {m} | " + " | ".join(_ci((d or {}).get("metrics", {}).get(m)) for _, d in diffs) + " |"
                    for m in metrics if any((d or {}).get("metrics", {}).get(m) for _, d in diffs)], ""]
    png = plot_validation(runs, out / "compare.png")
    if png:
        lines += ["![validation curves](compare.png)", ""]
    markdown = "\n".join(lines)
    (out / "compare.md").write_text(markdown)
    data = {"runs": [str(r.path) for r in runs], "names": [r.name for r in runs],
            "options": {k: [r.options.get(k) for r in runs] for k in differ},
            "metrics": {r.name: test_metrics(r.summary) for r in runs}}
    (out / "compare.json").write_text(json.dumps(data, indent=1, default=str))
    files = [str(out / "compare.md"), str(out / "compare.json")] + ([str(png)] if png else [])
    return {"markdown": markdown, "files": files, "options": data["options"], "metrics": data["metrics"]}


def plot_validation(runs: list[Run], path: Path) -> Path | None:
    """Validation loss and each run's selection metric against the step, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    valid = {r.name: [h for h in r.history if h.get("kind") == "valid" and h.get("model", "model") == "model"]
             for r in runs}
    if not any(valid.values()):
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    for r in runs:
        rows = valid[r.name]
        if not rows:
            continue
        ax1.plot([h["step"] for h in rows], [h["loss"] for h in rows], "o-", markersize=3, label=r.name)
        metric = r.summary.get("select_by") or "loss"
        pts = [(h["step"], h[metric]) for h in rows if isinstance(h.get(metric), (int, float))
               and math.isfinite(h[metric])]
        if pts:
            ax2.plot(*zip(*pts), "o-", markersize=3, label=f"{r.name} ({metric})")
    ax1.set(xlabel="step", ylabel="validation loss", title="validation loss")
    ax2.set(xlabel="step", ylabel="validation metric", title="validation selection metric")
    ax1.legend(fontsize=8)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

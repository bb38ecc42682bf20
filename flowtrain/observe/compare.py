"""``flowtrain compare RUN RUN...``: batch runs side by side.

Reads each run directory's ``config.json``, ``summary.json`` and ``metrics.jsonl`` and writes, to
``--out``:

- ``compare.md``: the options that differ between the runs, then the test metrics of each run's
  model with their 95% bootstrap intervals (``value [low, high]``; runs written before the
  intervals existed show the point estimate), the model-minus-linear difference where present;
  which runs report their model at step 0 (the model then equals its linear part: two such runs
  differ only by their linear fits); each run minus the first on the same test rows: a paired
  bootstrap of the metric difference (the same resamples of the shared test rows for both runs'
  predictions; each run's bundle predicts its dataset's test split, and the splits must hold the same
  rows in the same order, else the table says why there is no paired interval);
- ``compare.png``: the runs' validation curves overlaid (validation loss and the selection metric);
- ``compare.json``: the same numbers for machines.

The Markdown table is printed too. Text from the runs (names, option values) is escaped: no HTML.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flowtrain.errors import FlowtrainError
from flowtrain.train.bundle import build_module, read_bundle
from flowtrain.train.evaluation import BOOTSTRAP, bootstrap, probabilities
from flowtrain.train.loader import TabularDataset, iter_batches, target_scale
from flowtrain.train.loop import predict
from flowtrain.train.report import md_text
from flowtrain.train.shards import open_split

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


def _md(text) -> str:
    """A table cell that stays text: no HTML, no link, no column break (as the report, ``md_text``)."""
    return md_text(text, cell=True)


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


def at_step_zero(runs: list[Run]) -> list[Run]:
    """The runs whose reported model is the one at step 0: the wide-and-deep model equal to its
    linear part (the fitted linear baseline), because no checkpoint beat it on validation."""
    return [r for r in runs if ((r.summary.get("training") or {}).get("best_step")) == 0]


def _step_zero_text(runs: list[Run]) -> str | None:
    zero = at_step_zero(runs)
    if not zero:
        return None
    names = ", ".join(r.name for r in zero)
    if len(zero) == len(runs):
        return (f"{'Both runs' if len(runs) == 2 else f'All {len(runs)} runs'} ({names}) report their model at step 0, "
                f"which equals its linear part (the fitted linear baseline): no checkpoint beat it on validation. "
                f"The reported models are their linear fits, and runs on the same data and features fit the same "
                f"linear model: the training options that differ changed nothing reported here.")
    return (f"{names} report{'s' if len(zero) == 1 else ''} the model at step 0, which equals its linear part (the "
            f"fitted linear baseline): no checkpoint beat it on validation.")


@dataclass
class TestPredictions:
    """A run's model on its dataset's test split: labels, ``probabilities`` and a digest of the rows
    (features and labels, in order): two runs with the same digest predicted the same test rows."""
    kind: str
    y: np.ndarray
    p: np.ndarray
    digest: str


def test_predictions(run: Run) -> TestPredictions:
    """Load the run's bundle and predict its dataset's test split; a ``FlowtrainError`` saying why not."""
    dataset = run.summary.get("dataset")
    if not dataset:
        raise FlowtrainError("its summary.json names no dataset")
    try:
        data = TabularDataset(dataset)
        test = open_split(data, "test")
        model = build_module(read_bundle(run.path))
    except Exception as err:  # noqa: BLE001 - any reason is reported in the table, never a crash of compare
        raise FlowtrainError(f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]) from None
    h = hashlib.sha256()
    for batch in iter_batches(test, batch_size=65_536, seed=0, epoch=0, shuffle=False):
        for t in (batch.x_num, batch.x_cat, batch.y):
            h.update(t.contiguous().numpy().tobytes())
    out = predict(model, test, scale=target_scale(data))
    return TestPredictions(data.kind, test.y.double().numpy(), probabilities(out.numpy(), data.kind), h.hexdigest())


def paired_differences(names: list[str], predictions: list[TestPredictions | str], *, seed: int = 0,
                       b: int | None = None) -> dict:
    """Each run minus the first on the same test rows (paired bootstrap of the metric difference);
    ``predictions``: per run, its ``TestPredictions`` or why there are none. Returns
    ``{"reference": name, "runs": {name: {"metrics": {metric: {value, low, high}}} or {"reason": text}}}``."""
    first, ref = names[0], predictions[0]
    out: dict = {"reference": first, "runs": {}}
    for name, pred in zip(names[1:], predictions[1:]):
        if isinstance(ref, str):
            out["runs"][name] = {"reason": f"{first}: {ref}"}
        elif isinstance(pred, str):
            out["runs"][name] = {"reason": f"{name}: {pred}"}
        elif pred.kind != ref.kind:
            out["runs"][name] = {"reason": f"{name} is a {pred.kind} run, {first} a {ref.kind} run"}
        elif pred.digest != ref.digest:
            out["runs"][name] = {"reason": f"{name} and {first} have different test rows ({len(pred.y):,} and "
                                           f"{len(ref.y):,} rows; not the same rows in the same order)"}
        else:
            a, c = f"run {name}", f"run {first}"
            result = bootstrap(ref.kind, ref.y, {a: pred.p, c: ref.p}, b=b or BOOTSTRAP, seed=seed, difference=(a, c))
            out["runs"][name] = {"metrics": result["difference"]["metrics"], "rows": int(len(ref.y)),
                                 "resamples": result["resamples"]}
    return out


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
             *[f"| {_md(r.name)} | `{_md(r.path)}` | {r.summary.get('kind') or r.summary.get('task')} | "
               f"{(r.summary.get('rows') or {}).get('test', '–'):,} |" for r in runs], ""]
    heads = " | ".join(_md(r.name) for r in runs)
    if differ:
        lines += ["## Options that differ", "", f"| option | {heads} |",
                  "|---|" + "---|" * len(runs),
                  *[f"| {_md(k)} | " + " | ".join(_md(_show(r.options.get(k))) for r in runs) + " |" for k in differ],
                  ""]
    else:
        lines += ["All runs have the same options.", ""]
    lines += ["## Test metrics (flowtrain model)", "",
              "Point estimate [95% bootstrap interval]; the intervals come from each run's own test split.", "",
              f"| metric | {heads} |", "|---|" + "---|" * len(runs),
              *[f"| {m} | " + " | ".join(_ci(test_metrics(r.summary).get(m)) for r in runs) + " |" for m in metrics],
              ""]
    zero = _step_zero_text(runs)
    if zero:
        lines += [zero, ""]
    diffs = [(r, ((r.summary.get("evaluation") or {}).get("intervals") or {}).get("difference")) for r in runs]
    if any(d for _, d in diffs):
        lines += ["Model minus its linear baseline (paired bootstrap):", "",
                  f"| metric | {heads} |", "|---|" + "---|" * len(runs),
                  *[f"| {m} | " + " | ".join(_ci((d or {}).get("metrics", {}).get(m)) for _, d in diffs) + " |"
                    for m in metrics if any((d or {}).get("metrics", {}).get(m) for _, d in diffs)], ""]
    preds: list[TestPredictions | str] = []
    for r in runs:
        try:
            preds.append(test_predictions(r))
        except FlowtrainError as err:
            preds.append(str(err))
    paired = paired_differences([r.name for r in runs], preds)
    first = _md(runs[0].name)
    lines += ["## Run minus run on the same test rows (paired bootstrap)", "",
              f"Each run's model minus {first}'s, on the test rows both predicted: point estimate [95% interval "
              f"of the difference over the same {BOOTSTRAP} resamples of those rows for both runs]. An interval "
              f"that excludes 0 is a difference the test split can tell.", ""]
    done = [(n, d) for n, d in paired["runs"].items() if "metrics" in d]
    if done:
        keys = list(dict.fromkeys(k for _, d in done for k in d["metrics"]))
        lines += ["| metric | " + " | ".join(f"{_md(n)} − {first}" for n, _ in done) + " |",
                  "|---|" + "---|" * len(done),
                  *[f"| {k} | " + " | ".join(_ci(d["metrics"].get(k)) for _, d in done) + " |" for k in keys], ""]
    lines += [f"No paired interval for {_md(n)}: {_md(d['reason'])}." for n, d in paired["runs"].items()
              if "reason" in d]
    lines += [""] if any("reason" in d for d in paired["runs"].values()) else []
    png = plot_validation(runs, out / "compare.png")
    if png:
        lines += ["![validation curves](compare.png)", ""]
    markdown = "\n".join(lines)
    (out / "compare.md").write_text(markdown)
    data = {"runs": [str(r.path) for r in runs], "names": [r.name for r in runs],
            "options": {k: [r.options.get(k) for r in runs] for k in differ},
            "metrics": {r.name: test_metrics(r.summary) for r in runs},
            "step_zero": [r.name for r in at_step_zero(runs)], "paired": paired}
    (out / "compare.json").write_text(json.dumps(data, indent=1, default=str))
    files = [str(out / "compare.md"), str(out / "compare.json")] + ([str(png)] if png else [])
    return {"markdown": markdown, "files": files, "options": data["options"], "metrics": data["metrics"],
            "paired": paired}


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

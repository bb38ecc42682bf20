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
  rows, else the table says why there is no paired interval). A row is known by its source: its file's
  name relative to the run's input folder and its line, so two runs on copies of the same file in two
  folders (or one local, one on a store) pair row by row, in whatever order their splits hold them;
- ``compare.png``: the runs' validation curves overlaid (validation loss and the selection metric);
- ``compare.json``: the same numbers for machines.

The Markdown table is printed too. Text from the runs (names, option values) is escaped: no HTML.
"""
from __future__ import annotations

import hashlib
import json
import math
import posixpath
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from connectors.dataset import read_shard, shard_paths
from flowtrain.errors import FlowtrainError
from flowtrain.train.bundle import build_module, read_bundle
from flowtrain.train.evaluation import BOOTSTRAP, bootstrap, probabilities
from flowtrain.train.loader import TabularDataset, iter_batches, target_scale
from flowtrain.train.loop import predict
from flowtrain.train.report import md_text
from flowtrain.train.rundir.files import RunFiles
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
    summary_file = RunFiles(path).summary
    if not summary_file.is_file():
        raise FlowtrainError(f"compare: {path}: not a finished `flowtrain batch` run (no summary.json); give run "
                             f"directories of batch runs")
    try:
        summary = json.loads(summary_file.read_text())
        config = json.loads(RunFiles(path).config.read_text()) if RunFiles(path).config.is_file() else {}
    except json.JSONDecodeError as err:
        raise FlowtrainError(f"compare: {path}: unreadable summary.json or config.json ({err})") from None
    history = []
    if RunFiles(path).metrics.is_file():
        history = [json.loads(line) for line in RunFiles(path).metrics.read_text().splitlines() if line.strip()]
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
    """A run's model on its dataset's test split: labels, ``probabilities``, each row's id (``row_ids``: its
    source relative to the run's input folder; None for a dataset without sources) and a digest of the rows
    (features and labels, in order)."""
    kind: str
    y: np.ndarray
    p: np.ndarray
    digest: str
    ids: np.ndarray | None = None


def row_ids(sources: list[str]) -> np.ndarray:
    """Each row's ``file:line`` source with the file named relative to the deepest folder holding all the
    files (``/data/a/t.csv:12`` -> ``t.csv:12``; a URL's scheme and bucket go too): the same row of the same file
    has the same id wherever the run's copy of the file sat."""
    files = [src.rpartition(":")[0] or src for src in sources]
    paths = {f: (f.split("://", 1)[1] if "://" in f else f) for f in dict.fromkeys(files)}
    parts = list(dict.fromkeys(paths.values()))
    root = posixpath.commonpath(parts) if len(parts) > 1 else posixpath.dirname(parts[0]) if parts else ""
    if root in parts:
        root = posixpath.dirname(root)
    rel = {f: posixpath.relpath(p, root) if root else p for f, p in paths.items()}
    return np.asarray([rel[f] + src[len(f):] for f, src in zip(files, sources)], dtype=object)


def _test_sources(data: TabularDataset) -> np.ndarray | None:
    """The test split's row ids in the order the split is read (its shards' ``source`` column), or None."""
    files = shard_paths(data.path, "test")
    try:
        sources = [s for f in files for s in read_shard(f, columns=["source"]).column("source").to_pylist()]
    except (KeyError, ValueError, OSError):  # a dataset without sources: rows by position only
        return None
    return row_ids([str(s) for s in sources])


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
    ids = _test_sources(data)
    return TestPredictions(data.kind, test.y.double().numpy(), probabilities(out.numpy(), data.kind), h.hexdigest(),
                           ids if ids is not None and len(ids) == len(test.y) else None)


def aligned(ref: TestPredictions, pred: TestPredictions) -> tuple[TestPredictions | None, str]:
    """``pred`` with its rows in ``ref``'s order when both predicted the same rows (by row id; by the digest of
    the rows where a dataset has no ids), else (None, why not)."""
    if ref.ids is None or pred.ids is None:
        if pred.digest == ref.digest:
            return pred, ""
        return None, (f"different test rows ({len(pred.y):,} and {len(ref.y):,} rows; not the same rows in the same "
                      f"order)")
    where = {rid: i for i, rid in enumerate(pred.ids)}
    order = [where.get(rid, -1) for rid in ref.ids]
    common = sum(i >= 0 for i in order)
    if len(where) != len(pred.ids) or len(set(ref.ids)) != len(ref.ids):
        return None, "a test split holds a row twice"
    if common != len(ref.ids) or len(pred.ids) != len(ref.ids):
        return None, (f"different test rows ({len(pred.y):,} and {len(ref.y):,} rows, {common:,} of them the same "
                      f"rows of the same files): the runs split differently (another --seed, --time-column, "
                      f"other files)")
    idx = np.asarray(order, dtype=np.int64)
    moved = TestPredictions(pred.kind, pred.y[idx], pred.p[idx], pred.digest, pred.ids[idx])
    if not np.array_equal(moved.y, ref.y):
        return None, "the same test rows with different labels (another label column, or other classes)"
    return moved, ""


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
        elif (pair := aligned(ref, pred))[0] is None:
            out["runs"][name] = {"reason": f"{name} and {first} have {pair[1]}"}
        else:
            pred = pair[0]
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

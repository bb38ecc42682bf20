"""What a run leaves for a person: curves and evaluation figures as PNG, ``report.md``, a self-contained
``report.html`` (the same, figures embedded) and ``summary.json``."""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib

from connectors.atomic import atomic_file, atomic_write

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

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
    with atomic_file(run_dir / "loss.png") as fh:  # whole or not at all
        fig.savefig(fh, format="png", dpi=100)
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
        with atomic_file(run_dir / "metric.png") as fh:
            fig.savefig(fh, format="png", dpi=100)
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
    with atomic_file(path) as fh:
        fig.savefig(fh, format="png", dpi=100)
    plt.close(fig)
    return path


def _fmt(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return "nan" if v != v else f"{v:.4f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def _ci(m: dict | None) -> str:
    """``value [low, high]`` of an interval entry."""
    if not m:
        return "–"
    return f"{_fmt(m['value'])} [{_fmt(m['low'])}, {_fmt(m['high'])}]"


# --- figures of the evaluation ---------------------------------------------------------------------
def plot_evaluation(run_dir: Path, evaluation) -> list[str]:
    """The figures of an ``flowtrain.train.evaluation.Evaluation``: binary ``roc.png``, ``pr.png``,
    ``calibration.png``; regression ``residuals.png``, ``predicted_vs_actual.png``; every task
    ``importance.png``. One curve (or panel) per model. Returns the file names."""
    from sklearn.metrics import precision_recall_curve, roc_curve

    run_dir = Path(run_dir)
    y, preds, kind, files = evaluation.y, evaluation.predictions, evaluation.kind, []

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
            ax.plot(fpr, tpr, label=f"{name} (AUC {auc:.3f})")
        ax.plot([0, 1], [0, 1], ":", color="grey")
        ax.set(xlabel="false positive rate", ylabel="true positive rate", title="ROC curve (test)")
        ax.legend(loc="lower right")
        save(fig, "roc.png")
        fig, ax = plt.subplots(figsize=(5.5, 5))
        for name, p in preds.items():
            precision, recall, _ = precision_recall_curve(y > 0.5, p)
            ap = evaluation.summary["binary"][name]["average_precision"]
            ax.plot(recall, precision, label=f"{name} (AP {ap:.3f})")
        ax.axhline(float((y > 0.5).mean()), ls=":", color="grey", label="positive rate")
        ax.set(xlabel="recall", ylabel="precision", title="precision / recall (test)")
        ax.legend(loc="upper right")
        save(fig, "pr.png")
        fig, ax = plt.subplots(figsize=(5.5, 5))
        for name in preds:
            b = evaluation.summary["binary"][name]
            cal = b["calibration"]
            ax.plot(cal["mean_predicted"], cal["observed_rate"], "o-", markersize=3,
                    label=f"{name} (Brier {b['brier']:.4f})")
        ax.plot([0, 1], [0, 1], ":", color="grey", label="perfectly calibrated")
        ax.set(xlabel="mean predicted probability (decile of the test rows)", ylabel="observed positive rate",
               title="calibration (test)")
        ax.legend(loc="upper left")
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
                ax.set_title(f"{title}: {name}", fontsize=9)
            save(fig, name_file)
    features = evaluation.summary["importance"]["features"][:15]
    if features:
        fig, ax = plt.subplots(figsize=(6.5, 0.35 * len(features) + 1.2))
        names = [f["feature"] for f in features][::-1]
        mean = np.array([f["importance"] for f in features])[::-1]
        err = np.array([[f["importance"] - f["low"] for f in features],
                        [f["high"] - f["importance"] for f in features]])
        ax.barh(names, mean, xerr=np.nan_to_num(err[:, ::-1]), color="tab:blue", alpha=0.8)
        ax.axvline(0, color="grey", lw=0.8)
        metric = evaluation.summary["importance"]["metric"]
        ax.set(xlabel=f"drop of test {metric} when the feature is shuffled", title="permutation importance (model)")
        save(fig, "importance.png")
    return files


# --- which model is reported, in words -------------------------------------------------------------
def which_model(summary: dict, history: list[dict] | None = None) -> str:
    """One sentence: which weights the report is about and why (the selection rule's outcome)."""
    training = summary.get("training") or {}
    metric = summary.get("select_by") or "loss"
    best = training.get("best_step")
    valid = [r for r in history or [] if r.get("kind") == "valid" and r.get("model", "model") == "model"]
    start = next((r for r in valid if r.get("step") == 0), None)
    chosen = summary.get("valid_best") or {}
    if best == 0:
        return (f"The reported model is the wide-and-deep model at step 0, which equals its linear part (the "
                f"fitted linear baseline): no checkpoint beat it on validation {metric} by one standard error"
                + (f" (its validation {metric}: {_fmt(start[metric])})." if start and metric in start else "."))
    if best is None:
        return f"The reported model has the best validation {metric} of the run."
    text = (f"The reported model is the checkpoint at step {best:,}, the best by validation {metric}"
            + (f" ({_fmt(chosen[metric])})" if metric in chosen else ""))
    if start and metric in start:
        text += (f"; it beat the initial model (its linear part, validation {metric} {_fmt(start[metric])}) by more "
                 f"than one standard error of the validation split")
    return text + "."


# --- the report: blocks rendered as Markdown and as self-contained HTML ---------------------------------
def _blocks(summary: dict, history: list[dict] | None, figures: list[str]) -> list[tuple]:
    task = summary["task"]
    kind = summary.get("kind") or ("binary" if task == "classification" else "regression")
    counts, training = summary["counts"], summary["training"]
    plan = training.get("plan") or {}
    ev = summary.get("evaluation") or {}
    what = {"binary": "binary classification", "multiclass": f"{len(summary.get('classes') or [])}-class "
            f"classification", "regression": "regression"}[kind]
    b: list[tuple] = [("h1", f"flowtrain run: {summary['title']}"),
                      ("p", f"Target: {summary['target']} ({what}). Test split: {summary['rows']['test']:,} rows.")]
    if summary.get("classes"):
        b.append(("p", f"Classes (from the training split): {', '.join(summary['classes'])}."))
    b.append(("p", which_model(summary, history)))
    models = [("flowtrain model", summary["test"]["model"])] + list(summary["test"]["baselines"].items())
    label = {"flowtrain model": "flowtrain model"}
    intervals = (ev.get("intervals") or {}).get("models") or {}
    if intervals:
        keys = list(next(iter(intervals.values())).keys())
        b += [("h2", "Test metrics"),
              ("p", f"Point estimate [95% bootstrap interval over {ev['intervals']['resamples']} resamples of the "
                    f"{ev['rows']:,} test rows]."),
              ("table", ["model"] + [f"test {k.replace('_', ' ')}" for k in keys],
               [[label.get(n, f"baseline: {n}")] + [_ci(intervals.get(n, {}).get(k)) for k in keys]
                for n, _ in models])]
        diff = ev["intervals"].get("difference")
        if diff:
            a, c = diff["of"]
            b.append(("p", f"{a} minus {c} (paired resamples): " + "; ".join(
                f"{k.replace('_', ' ')} {_ci(m)}" for k, m in diff["metrics"].items()) + "."))
    else:
        keys = REPORT_METRICS[kind]
        b += [("h2", "Test metrics"),
              ("table", ["model"] + [f"test {t}" for _, t in keys],
               [[label.get(n, f"baseline: {n}")] + [_fmt(m.get(k)) for k, _ in keys] for n, m in models])]
    if kind == "binary" and ev.get("binary"):
        rows = []
        for n, d in ev["binary"].items():
            for where, m in (("validation-chosen", d["at_chosen"]), ("0.5", d["at_half"])):
                rows.append([n, f"{where} ({m['threshold']:.3f})", _fmt(m["accuracy"]), _fmt(m["precision"]),
                             _fmt(m["recall"]), _fmt(m["f1"]), _fmt(m["predicted_positive"])])
        b += [("h2", "Thresholds"),
              ("p", "The chosen threshold has the best F1 on the validation split; the metrics are on the test split."),
              ("table", ["model", "threshold", "accuracy", "precision", "recall", "F1", "predicted positive"], rows)]
        main = ev["binary"].get("flowtrain model") or next(iter(ev["binary"].values()))
        b += [("p", "Threshold table (flowtrain model, test split):"),
              ("table", ["threshold", "accuracy", "precision", "recall", "F1", "predicted positive"],
               [[f"{m['threshold']:.1f}", _fmt(m["accuracy"]), _fmt(m["precision"]), _fmt(m["recall"]),
                 _fmt(m["f1"]), _fmt(m["predicted_positive"])] for m in main["table"]]),
              ("p", "Brier score (lower is better): " + "; ".join(
                  f"{n} {_fmt(d['brier'])}" for n, d in ev["binary"].items()) + ".")]
    if kind == "multiclass":
        model = summary["test"]["model"]
        auc = (ev.get("per_class_auc") or {}).get("flowtrain model") or {}
        b += [("h2", "Per class (flowtrain model, test split)"),
              ("table", ["class", "precision", "recall", "ROC AUC (one vs rest)", "support"],
               [[c, _fmt(v["precision"]), _fmt(v["recall"]), _fmt(auc.get(c)), f"{v['support']:,}"]
                for c, v in model.get("per_class", {}).items()])]
    for name, alt in (("roc.png", "ROC curve"), ("pr.png", "precision/recall curve"),
                      ("calibration.png", "calibration curve"), ("confusion.png", "confusion matrix"),
                      ("predicted_vs_actual.png", "predicted vs actual"), ("residuals.png", "residuals")):
        if name in figures:
            b.append(("img", name, alt))
    imp = ev.get("importance")
    if imp and imp["features"]:
        b += [("h2", "Permutation feature importance"),
              ("p", f"Drop of test {imp['metric']} when one feature is shuffled ({imp['repeats']} shuffles, "
                    f"{imp['rows']:,} test rows; 95% t-interval over the shuffles). Top features:"),
              ("table", ["feature", "kind", "importance", "95% interval"],
               [[f["feature"], f["kind"], _fmt(f["importance"]), f"[{_fmt(f['low'])}, {_fmt(f['high'])}]"]
                for f in imp["features"][:10]])]
        if "importance.png" in figures:
            b.append(("img", "importance.png", "permutation importance"))
    sl = ev.get("slices")
    if sl:
        names = [n for n, _ in models]
        b += [("h2", f"Slices by {sl['column']}"),
              ("p", f"Test {sl['metric']} per value of {sl['column']} (most frequent values first)."),
              ("table", ["value", "rows"] + names + (["positive rate"] if kind == "binary" else []),
               [[r["value"], f"{r['rows']:,}"] + [_fmt(r.get(n)) for n in names]
                + ([_fmt(r["positive_rate"])] if kind == "binary" else []) for r in sl["rows"]])]
    linear = summary.get("linear")
    b += [("h2", "Data"),
          ("ul", [f"rows in: {counts['in']:,}; rows out: {counts['out']:,}; dead letters: "
                  f"{counts['dead_letters']:,} (`dead_letters.jsonl`)",
                  *[f"dead letters, {reason}: {n:,}" for reason, n in counts.get("dead_letters_by_reason", {}).items()],
                  "splits: " + ", ".join(f"{k} {v:,}" for k, v in summary["rows"].items()),
                  f"dataset: `{summary['dataset']}`"]),
          ("h2", "Training"),
          ("ul", [*([f"plan: batch size {plan['batch_size']}, {plan['steps']:,}-step budget ({plan['steps_per_epoch']} "
                     f"steps per epoch), lr {plan['lr']:g} warmed up over {plan['warmup_steps']} steps then cosine "
                     f"decay over {plan['horizon']:,}, validation every {plan['eval_every']} steps, patience "
                     f"{plan['patience']}"] if plan else []),
                  f"{training['steps']:,} steps ({training['epochs_run']} epochs), best validation "
                  f"{summary.get('select_by') or 'loss'} at step {training.get('best_step', '?')}"
                  f"{' (stopped early)' if training['stopped_early'] else ''}",
                  f"training time {training['seconds']:.1f} s; waiting on data "
                  f"{100 * training['data_wait_fraction']:.2f}% of step time",
                  *([f"linear baseline: {linear['method']}, {linear['iterations']} iterations, final gradient norm "
                     f"{linear['grad_norm']:.1e}, L2 {linear['l2']:.2e}; the model's linear part starts from it"]
                    if linear else []),
                  f"wall time of the whole run {summary['wall_seconds']:.1f} s",
                  "TensorBoard: `tensorboard --logdir tensorboard` in the run directory"])]
    for name, alt in (("loss.png", "loss"), ("metric.png", "validation metric")):
        if name in figures:
            b.append(("img", name, alt))
    return b


def _markdown(blocks: list[tuple]) -> str:
    out = []
    for block in blocks:
        kind = block[0]
        if kind == "h1":
            out += [f"# {block[1]}", ""]
        elif kind == "h2":
            out += [f"## {block[1]}", ""]
        elif kind == "p":
            out += [block[1], ""]
        elif kind == "ul":
            out += [f"- {item}" for item in block[1]] + [""]
        elif kind == "table":
            header, rows = block[1], block[2]
            out += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
                    *["| " + " | ".join(str(c) for c in row) + " |" for row in rows], ""]
        elif kind == "img":
            out += [f"![{block[2]}]({block[1]})", ""]
    return "\n".join(out)


def _html(blocks: list[tuple], run_dir: Path) -> str:
    """One HTML file, the figures inside it (base64 PNG): it opens anywhere, offline, alone."""
    import base64
    import html
    import re

    def inline(text: str) -> str:
        return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))

    body = []
    for block in blocks:
        kind = block[0]
        if kind in ("h1", "h2"):
            body.append(f"<{kind}>{inline(block[1])}</{kind}>")
        elif kind == "p":
            body.append(f"<p>{inline(block[1])}</p>")
        elif kind == "ul":
            body.append("<ul>" + "".join(f"<li>{inline(i)}</li>" for i in block[1]) + "</ul>")
        elif kind == "table":
            head = "".join(f"<th>{inline(str(c))}</th>" for c in block[1])
            rows = "".join("<tr>" + "".join(f"<td>{inline(str(c))}</td>" for c in row) + "</tr>" for row in block[2])
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
        elif kind == "img":
            data = base64.b64encode((Path(run_dir) / block[1]).read_bytes()).decode("ascii")
            body.append(f'<figure><img alt="{html.escape(block[2])}" src="data:image/png;base64,{data}">'
                        f"<figcaption>{html.escape(block[2])}</figcaption></figure>")
    title = inline(blocks[0][1]) if blocks else "flowtrain report"
    style = ("body{font-family:system-ui,sans-serif;max-width:1000px;margin:2em auto;padding:0 1em;color:#222}"
             "table{border-collapse:collapse;margin:0.5em 0 1em}th,td{border:1px solid #ccc;padding:3px 8px;"
             "text-align:right}th:first-child,td:first-child{text-align:left}th{background:#f3f3f3}"
             "img{max-width:100%}figure{margin:1em 0}figcaption{color:#666;font-size:90%}code{background:#f3f3f3}")
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
            f"<style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


def _write_text(path: Path, text: str) -> Path:
    return atomic_write(path, text)  # tmp, fsync, rename: never a truncated report


def write_report(run_dir: Path, summary: dict, history: list[dict] | None = None) -> Path:
    """``report.md`` and ``report.html`` (the same content, figures embedded) for a batch run;
    ``history`` is the run's ``metrics.jsonl`` (for the sentence saying which model is reported)."""
    run_dir = Path(run_dir)
    figures = [p.name for p in run_dir.glob("*.png")]
    blocks = _blocks(summary, history, figures)
    _write_text(run_dir / "report.html", _html(blocks, run_dir))
    return _write_text(run_dir / "report.md", _markdown(blocks))


def write_summary(run_dir: Path, summary: dict) -> Path:
    return atomic_write(Path(run_dir) / "summary.json", json.dumps(summary, indent=2, default=float))

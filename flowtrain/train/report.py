"""What a run leaves for a person: ``report.md`` (the data, test metrics with intervals next to the baselines,
the figures of ``flowtrain.train.figures``), a self-contained ``report.html`` (the same, figures embedded) and
``summary.json``."""
from __future__ import annotations

import base64
import datetime as dt
import html
import json
import re
from pathlib import Path

from connectors.atomic import atomic_write
from flowtrain.train.figures import flat_within_one_row
from flowtrain.train.model_choice import choice_text
from flowtrain.train.rundir.files import RunFiles

#: Test metrics shown in the report per kind of task: (summary key, column title).
REPORT_METRICS = {"binary": [("auc", "AUC"), ("accuracy", "accuracy"), ("log_loss", "log loss")],
                  "multiclass": [("accuracy", "accuracy"), ("macro_f1", "macro-F1"), ("log_loss", "log loss")],
                  "regression": [("rmse", "RMSE"), ("mae", "MAE"), ("r2", "R²")]}



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



# --- the data a run trained on, as a person checks it -----------------------------------------------
def format_date(seconds: float | None) -> str:
    """Epoch seconds as an ISO 8601 date (midnight UTC) or date and time (``...Z``)."""

    if seconds is None:
        return "–"
    try:
        t = dt.datetime.fromtimestamp(float(seconds), dt.timezone.utc)
    except (OverflowError, OSError, ValueError):
        return f"{seconds:g}"
    if t.hour == t.minute == t.second == t.microsecond == 0:
        return t.date().isoformat()
    return t.replace(microsecond=0).isoformat().replace("+00:00", "Z")


def input_columns(path: str) -> list[str]:
    """The column names of an input file: a CSV header, a Parquet schema, the keys of the first
    JSON-lines objects. ``OSError``/``ValueError`` when it cannot be read."""
    from apache_beam.io.filesystems import FileSystems

    from connectors.files import avro_head, csv_header, file_format

    fmt = file_format(path)
    if fmt == "csv":
        return csv_header(path)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        with FileSystems.open(path) as fh:
            return list(pq.ParquetFile(fh).schema_arrow.names)
    if fmt == "avro":
        return list(avro_head(path, rows=1).schema.names)
    with FileSystems.open(path) as fh:
        head = fh.read(1 << 16)
    names: dict[str, None] = {}
    for line in head[: head.rfind(b"\n") + 1].splitlines()[:100]:
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            names.update(dict.fromkeys(obj))
    return list(names)


def describe_data(manifest: dict) -> dict:
    """What a data scientist checks first about a run's data, from its dataset's manifest: the label,
    the feature columns used, the input's columns left unused (neither feature, label nor time
    column), the time column's role and the split's boundaries as dates (the manifest keeps seconds)."""
    spec = manifest.get("spec") or {}
    features = {"numeric": list(spec.get("numeric") or []), "optional_numeric": list(spec.get("optional_numeric") or []),
                "categorical": list(spec.get("categorical") or []), "id": list(spec.get("id_columns") or [])}
    used = {spec.get("label"), spec.get("time_column"), spec.get("weight_column"),
            *(c for cols in features.values() for c in cols)}
    out: dict = {"label": spec.get("label"), "features": features}
    if spec.get("weight_column"):  # --weight-column: the sample weights (never a feature)
        stats = manifest.get("stats") or {}
        out["weight_column"] = {"column": spec["weight_column"], "mean": stats.get("weight_mean"),
                                "sum": stats.get("weight_sum")}
    if manifest.get("inferred"):  # no feature column declared: the ETL's choice (pipelines.tabular.infer)
        out["inferred"] = manifest["inferred"]
    inputs = manifest.get("inputs") or []
    if isinstance(inputs, dict):  # a preset's manifest (the demo's): {table name: file}
        inputs = list(inputs.values())
    if inputs:
        try:
            columns = input_columns(str(inputs[0]))
            out["input_columns"] = {"file": str(inputs[0]), "columns": columns,
                                    "unused": [c for c in columns if c not in used]}
        except (OSError, ValueError) as err:
            out["input_columns"] = {"file": str(inputs[0]), "error": f"{type(err).__name__}: {err}"[:200]}
    split = manifest.get("split") or {}
    time_column = spec.get("time_column")
    if time_column:
        is_feature = any(time_column in cols for cols in features.values())
        given = bool(spec.get("valid_from") and spec.get("test_from"))
        out["split"] = {
            "by": "time", "time_column": time_column,
            "role": "splits the rows by time and is a feature" if is_feature else
                    "splits the rows by time; not a feature",
            "cutoffs": "given (--valid-from, --test-from)" if given else
                       f"by fraction {'/'.join(f'{f:g}' for f in spec.get('fractions') or [])} of the time range",
            "first": format_date(split.get("min")), "last": format_date(split.get("max")),
            "valid_from": format_date(split.get("valid_from")), "test_from": format_date(split.get("test_from")),
            "seconds": {k: split.get(k) for k in ("min", "max", "valid_from", "test_from")}}
    else:
        out["split"] = {"by": "random", "fractions": list(spec.get("fractions") or []), "seed": spec.get("seed")}
    return out


def _data_lines(data: dict | None) -> list[str]:
    """The Data section's lines about columns and the split."""
    if not data:
        return []
    f = data.get("features") or {}
    kinds = [(f.get("numeric"), "numeric"), (f.get("optional_numeric"), "numeric, may be missing"),
             (f.get("categorical"), "categorical"), (f.get("id"), "ID (an embedding row per ID)")]
    lines = [f"label: `{data.get('label')}`; features used: " + "; ".join(
        f"{kind} {', '.join(f'`{c}`' for c in cols)}" for cols, kind in kinds if cols)]
    weights = data.get("weight_column")
    if weights:
        mean = weights.get("mean")
        lines.append(f"sample weights: column `{weights['column']}` (not a feature"
                     + (f"; training mean {mean:.4g}" if isinstance(mean, (int, float)) else "")
                     + "): they weigh the training loss and the weighted_* metrics; the others count rows")
    inferred = data.get("inferred")
    if inferred:
        left = "; ".join(f"`{c}` ({why})" for c, why in (inferred.get("left_out") or {}).items())
        lines.append(f"feature columns inferred from the first {inferred.get('rows', 0):,} rows (no --numeric or "
                     f"--categorical given)" + (f"; left out: {left}" if left else "")
                     + (f"; ID-like, for --id-columns: {', '.join(f'`{c}`' for c in inferred['id_suggested'])}"
                        if inferred.get("id_suggested") else ""))
    cols = data.get("input_columns") or {}
    if "unused" in cols:
        lines.append(f"columns of `{cols['file']}` not used (neither a feature, the label nor the time column): "
                     + (", ".join(f"`{c}`" for c in cols["unused"]) or "none"))
    elif cols:
        lines.append(f"columns of `{cols['file']}`: not read ({cols['error']})")
    split = data.get("split") or {}
    if split.get("by") == "time":
        lines.append(f"time column `{split['time_column']}`: {split['role']}; its values run from {split['first']} "
                     f"to {split['last']}")
        lines.append(f"split by time (cutoffs {split['cutoffs']}): train before {split['valid_from']}; validation "
                     f"from {split['valid_from']} to before {split['test_from']}; test from {split['test_from']}")
    elif split.get("by") == "random":
        lines.append(f"no time column: rows split at random, fractions "
                     f"{'/'.join(f'{x:g}' for x in split.get('fractions') or [])} by seed {split.get('seed')}")
    return lines


# --- which model is reported, in words -------------------------------------------------------------
def which_model(summary: dict, history: list[dict] | None = None) -> str:
    """Which weights the report is about and why (the selection rule's outcome): the network or its linear start,
    the architecture, the numbers (``flowtrain.train.model_choice``; a summary written before it: one sentence)."""
    if summary.get("model_choice"):
        return choice_text(summary["model_choice"])
    training = summary.get("training") or {}
    metric = summary.get("select_by") or "loss"
    best = training.get("best_step")
    valid = [r for r in history or [] if r.get("kind") == "valid" and r.get("model", "model") == "model"]
    start = next((r for r in valid if r.get("step") == 0), None)
    chosen = summary.get("valid_best") or {}
    if best == 0:
        return (f"The reported model is the wide-and-deep model at step 0, which equals its linear part (the "
                f"fitted linear baseline): no checkpoint beat it on validation {metric} by one standard error"
                + (f" (its validation {metric}: {_fmt(start[metric])})" if start and metric in start else "")
                + ". Its test predictions are the linear model's: in the figures its curves lie under the "
                  "linear model's, and their difference is 0.")
    if best is None:
        return f"The reported model has the best validation {metric} of the run."
    text = (f"The reported model is the checkpoint at step {best:,}, the best by validation {metric}"
            + (f" ({_fmt(chosen[metric])})" if metric in chosen else ""))
    if start and metric in start:
        text += (f"; it beat the initial model (its linear part, validation {metric} {_fmt(start[metric])}) by more "
                 f"than one standard error of the validation split")
    return text + "."


def _memory_line(memory: dict) -> str:
    """The memory plan per rank against what the ranks held (flowtrain.train.memory_plan)."""
    from flowtrain.train.memory_plan import gib  # torch: the report's other parts do without it

    plan, measured = memory["plan"], memory.get("measured") or []
    held = max((m.get("total", 0) for m in measured), default=0)
    rss = max((m.get("peak_rss", 0) for m in measured), default=0)
    return (f"memory per rank ({plan['layout']}): planned {gib(plan['state'])} of parameters, gradients and "
            f"optimizer state (+ ~{gib(plan['activations'])} activations); measured {gib(held)} on the busiest of "
            f"{len(measured)} rank(s), peak RSS {gib(rss)}")


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
        b.append(("p", f"Classes (from the training split): {', '.join(summary['classes'])}."
                  + (f" Positive class: {summary['positive_class']} (the probabilities, AUC and curves are of it)."
                     if summary.get("positive_class") else "")))
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
                  *_data_lines(summary.get("data")),
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
                  *([_memory_line(training["memory"])] if training.get("memory") else []),
                  *([f"linear baseline: {linear['method']}, {linear['iterations']} iterations, final gradient norm "
                     f"{linear['grad_norm']:.1e}, L2 {linear['l2']:.2e}; the model's linear part starts from it"]
                    if linear else []),
                  f"wall time of the whole run {summary['wall_seconds']:.1f} s",
                  "TensorBoard: `tensorboard --logdir tensorboard` in the run directory"])]
    metric = summary.get("select_by") or "loss"
    values = [r[metric] for r in history or [] if r.get("kind") == "valid" and r.get("model", "model") == "model"
              and isinstance(r.get(metric), (int, float))]
    one_row = flat_within_one_row(values, metric, (summary.get("rows") or {}).get("valid"))
    if one_row is not None:
        b.append(("p", f"The validation {metric} moved by {max(values) - min(values):.4g} over the run, less than "
                       f"one row of the validation split (1/{summary['rows']['valid']:,} = {one_row:.4g}): the curve "
                       f"is flat within what the split can show (the figure's y-axis is widened to one row either "
                       f"side); a larger validation split would resolve it."))
    for name, alt in (("loss.png", "loss"), ("metric.png", "validation metric")):
        if name in figures:
            b.append(("img", name, alt))
    return b


def md_text(text, *, cell: bool = False) -> str:
    """Text for Markdown that stays text, whatever the data holds (column, class and file names,
    values): no HTML (a ``<`` that could open a tag as ``&lt;``, an ``&`` that could start an entity as
    ``&amp;``), no link or image (``](``), no quote (a leading ``>``), one line; in a table cell no column
    break (``|``). What cannot make markup stays as it is, so the file reads as plain text too (``arr_delay >
    15``, ``AT&T``). The report's own Markdown is only backtick code spans, kept."""
    text = str(text).replace("\r", " ").replace("\n", " ")
    text = _ENTITY_START.sub("&amp;", text)
    text = _TAG_START.sub("&lt;", text).replace("](", "]\\(")
    text = "\\" + text if text.startswith(">") else text
    return text.replace("|", "\\|") if cell else text


#: What makes HTML inside Markdown: a ``<`` before a tag's name, ``/``, ``!`` or ``?``; an ``&`` of an entity.
_TAG_START = re.compile(r"<(?=[A-Za-z/!?])")
_ENTITY_START = re.compile(r"&(?=#?[A-Za-z0-9]+;)")


def _markdown(blocks: list[tuple]) -> str:
    out = []
    for block in blocks:
        kind = block[0]
        if kind == "h1":
            out += [f"# {md_text(block[1])}", ""]
        elif kind == "h2":
            out += [f"## {md_text(block[1])}", ""]
        elif kind == "p":
            out += [md_text(block[1]), ""]
        elif kind == "ul":
            out += [f"- {md_text(item)}" for item in block[1]] + [""]
        elif kind == "table":
            header, rows = block[1], block[2]
            out += ["| " + " | ".join(md_text(c, cell=True) for c in header) + " |", "|" + "---|" * len(header),
                    *["| " + " | ".join(md_text(c, cell=True) for c in row) + " |" for row in rows], ""]
        elif kind == "img":
            out += [f"![{md_text(block[2])}]({block[1]})", ""]
    return "\n".join(out)


def _html(blocks: list[tuple], run_dir: Path) -> str:
    """One HTML file, the figures inside it (base64 PNG): it opens anywhere, offline, alone."""

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
    title = html.escape(blocks[0][1]) if blocks else "flowtrain report"  # <title> is text: no <code>
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
    _write_text(RunFiles(run_dir).report_html, _html(blocks, run_dir))
    return _write_text(RunFiles(run_dir).report_md, _markdown(blocks))


def write_summary(run_dir: Path, summary: dict) -> Path:
    return atomic_write(RunFiles(run_dir).summary, json.dumps(summary, indent=2, default=float))

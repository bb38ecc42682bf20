"""What a ``flowtrain tune`` study leaves: ``trials.json`` (every trial), ``best.json`` and the ``best`` link (the
best trial's run directory, whose ``bundle/`` predicts), the plots (the optimization history, Optuna's parallel
coordinates and parameter importances, with matplotlib) and ``tune_report.md``."""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

from connectors.atomic import atomic_write
from flowtrain.commands.tune.space import Dimension

PLOTS = {"history.png": "plot_optimization_history", "parallel_coordinate.png": "plot_parallel_coordinate",
         "importances.png": "plot_param_importances"}


def _trial_row(t) -> dict:
    return {"number": t.number, "state": t.state.name.lower(), "value": t.value, "params": t.params,
            "test": t.user_attrs.get("test"), "chosen": t.user_attrs.get("chosen"),
            "seconds": t.user_attrs.get("seconds"), "run_dir": t.user_attrs.get("run_dir"),
            "retry_of": t.system_attrs.get("failed_trial"), "last_step": t.last_step}


def _importances(study) -> dict[str, float]:
    import optuna

    try:
        return {k: float(v) for k, v in optuna.importance.get_param_importances(study).items()}
    except (RuntimeError, ValueError, ZeroDivisionError):  # too few complete trials, or no variation
        return {}


def _plots(study, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as optuna_plots

    made = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Optuna's matplotlib plots are marked experimental
        for name, fn in PLOTS.items():
            try:
                ax = getattr(optuna_plots, fn)(study)
            except (RuntimeError, ValueError, ZeroDivisionError):
                continue
            fig = (ax if hasattr(ax, "savefig") else (ax.flat[0] if hasattr(ax, "flat") else ax).figure)
            fig.set_size_inches(10, 5)
            fig.tight_layout()
            fig.savefig(out / name, dpi=90)
            plt.close(fig)
            made.append(name)
    return made


def _f(x) -> str:
    return "" if x is None else f"{x:.4f}" if isinstance(x, float) else str(x)


def write_tune_report(study, out: Path, *, space: list[Dimension], metric: str, config: dict) -> dict:
    """The study's files under ``out``; returns the summary ``best.json`` holds."""
    from optuna.trial import TrialState

    trials = [_trial_row(t) for t in study.get_trials(deepcopy=False)]
    atomic_write(out / "trials.json", json.dumps(trials, indent=1, default=str))
    complete = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))]
    best = study.best_trial if complete else None
    summary = {"study": study.study_name, "metric": metric, "direction": study.direction.name.lower(),
               "trials": {s: sum(t["state"] == s for t in trials) for s in ("complete", "pruned", "fail", "running")},
               "space": {d.name: d.text() for d in space}, "importances": _importances(study) if len(complete) > 1
               else {}, "best": None}
    if best is not None:
        summary["best"] = {"number": best.number, "value": best.value, "params": best.params,
                           "test": best.user_attrs.get("test"), "run_dir": best.user_attrs.get("run_dir"),
                           "bundle": str(Path(best.user_attrs.get("run_dir", "")) / "bundle")}
        link = out / "best"
        if link.is_symlink() or not link.exists():
            tmp = out / f".best.tmp-{os.getpid()}"
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(os.path.relpath(best.user_attrs["run_dir"], out))
            os.replace(tmp, link)
    atomic_write(out / "best.json", json.dumps(summary, indent=1, default=str))
    figures = _plots(study, out) if complete else []
    lines = [f"# flowtrain tune: study {study.study_name}", "",
             f"Objective: validation {metric} ({summary['direction']}); trials: "
             + ", ".join(f"{n} {s}" for s, n in summary["trials"].items() if n) + ".", "",
             "Search space: " + ", ".join(f"`{k}={v}`" for k, v in summary["space"].items()) + ".", ""]
    if best is not None:
        b = summary["best"]
        lines += ["## Best trial", "",
                  f"Trial {b['number']}: validation {metric} {_f(b['value'])}"
                  + (f", test {metric} {_f(b['test'])}" if b["test"] is not None else "") + ".", "",
                  "| parameter | value |", "|---|---|", *[f"| {k} | {_f(v)} |" for k, v in b["params"].items()], "",
                  f"Run directory: `{b['run_dir']}` (also `best/` here); its bundle: `{b['bundle']}`.", ""]
    if summary["importances"]:
        lines += ["## Parameter importances (Optuna's get_param_importances)", "", "| parameter | importance |", "|---|---|",
                  *[f"| {k} | {v:.3f} |" for k, v in summary["importances"].items()], ""]
    names = [d.name for d in space]
    lines += ["## Trials", "", "| trial | state | " + " | ".join(names) + f" | valid {metric} | test {metric} | "
              "model | seconds |", "|" + "---|" * (len(names) + 6)]
    for t in trials:
        state = t["state"] + (f" (retry of {t['retry_of']})" if t["retry_of"] is not None else "")
        seconds = "" if t["seconds"] is None else f"{t['seconds']:.0f}"
        lines.append(f"| {t['number']} | {state} | " + " | ".join(_f(t["params"].get(n)) for n in names)
                     + f" | {_f(t['value'])} | {_f(t['test'])} | {t['chosen'] or ''} | {seconds} |")
    lines.append("")
    lines += [f"![{name}]({name})" for name in figures]
    atomic_write(out / "tune_report.md", "\n".join(lines) + "\n")
    summary["figures"] = figures
    summary["config"] = config
    return summary

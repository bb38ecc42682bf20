"""Which model a batch run reports, and why, in numbers and in words.

A run trains its network from its linear start (the fitted linear model is the network's linear part, its other
outputs start at zero) and keeps the network only when a checkpoint beats the start on the validation metric by
more than one standard error of that metric on the validation split (the one-standard-error rule,
``flowtrain.train.metrics.clears``); otherwise the reported model *is* the linear start. ``model_choice`` reads
the run's validation history and test metrics and says which won, by how much on validation and on test, and names
the architecture; ``choice_text`` is the report's paragraph (``flowtrain.train.report``).
"""
from __future__ import annotations

from collections.abc import Callable

NETWORK, LINEAR = "network", "linear start"


def _relative(a: float, b: float, higher_is_better: bool) -> float | None:
    if b == 0 or a != a or b != b:
        return None
    return (a - b) / abs(b) if higher_is_better else (b - a) / abs(b)


def model_choice(*, metric: str, higher: bool, standard_error: Callable[[dict, str, int], float],
                 best_step: int | None, history: list[dict], valid_rows: int, test_model: dict, test_linear: dict,
                 architecture: str, parameters: int) -> dict:
    """The summary's ``model_choice``: ``chosen`` (network or linear start), the architecture, the validation
    numbers the rule compared (the start's, the network's best checkpoint's, the standard error: ``standard_error``
    is ``flowtrain.train.metrics.standard_error``) and the test metric of the reported model and of the linear
    start. ``higher``: whether a higher ``metric`` is better. Stdlib only (the report imports this module)."""
    valid = [r for r in history if r.get("kind") == "valid" and r.get("model", "model") == "model"
             and isinstance(r.get(metric), (int, float))]
    start = next((r for r in valid if r.get("step") == 0), None)
    later = [r for r in valid if r.get("step", 0) > 0]
    best = (max if higher else min)(later, key=lambda r: r[metric]) if later else None
    chosen = NETWORK if best_step else LINEAR
    se = standard_error(start, metric, valid_rows) if start is not None else None
    test_metric = test_model.get(metric) if isinstance(test_model.get(metric), (int, float)) else None
    test_start = test_linear.get(metric) if isinstance(test_linear.get(metric), (int, float)) else None
    return {
        "chosen": chosen, "architecture": architecture, "parameters": int(parameters), "metric": metric,
        "higher_is_better": higher,
        "valid": {"linear_start": start[metric] if start else None,
                  "network_best": best[metric] if best else None, "network_best_step": best["step"] if best else None,
                  "reported_step": best_step, "standard_error": se, "rows": valid_rows},
        "test": {"reported": test_metric, "linear_start": test_start,
                 "difference": None if test_metric is None or test_start is None else test_metric - test_start,
                 "relative": None if test_metric is None or test_start is None
                 else _relative(test_metric, test_start, higher)},
    }


def _f(x) -> str:
    return "n/a" if x is None else f"{x:.4f}" if abs(x) < 100 else f"{x:,.1f}"


def choice_text(choice: dict) -> str:
    """The report's paragraph: which model it reports, the architecture, and the numbers behind the choice."""
    metric, v, t = choice["metric"], choice["valid"], choice["test"]
    what = f"{choice['architecture']}; {choice['parameters']:,} parameters"
    se = f"one standard error of validation {metric} on its {v['rows']:,} rows is {_f(v['standard_error'])}"
    if choice["chosen"] == NETWORK:
        margin = None if v["linear_start"] is None else \
            (v["network_best"] - v["linear_start"]) if v["network_best"] is not None else None
        text = (f"The reported model is the network ({what}), its checkpoint at step {v['reported_step']:,}: "
                f"validation {metric} {_f(v['network_best'])} against its linear start's {_f(v['linear_start'])} "
                f"({'+' if (margin or 0) >= 0 else ''}{_f(margin)}; {se}, the margin it had to clear).")
        if t["reported"] is not None:
            rel = t["relative"]
            text += (f" On the test split: {metric} {_f(t['reported'])} against the linear start's "
                     f"{_f(t['linear_start'])}" + (f" ({'better' if rel >= 0 else 'worse'} by {abs(rel):.1%})"
                                                    if rel is not None else "") + ".")
        return text
    text = (f"The reported model is the linear start: the network ({what}) at step 0, which equals its linear part "
            f"(the fitted linear baseline): no checkpoint beat it on validation {metric} by one standard error (the "
            f"one-standard-error rule keeps the simpler model when validation cannot tell them apart)")
    if v["network_best"] is not None and v["linear_start"] is not None:
        diff = v["network_best"] - v["linear_start"]
        improved = diff > 0 if choice["higher_is_better"] else diff < 0
        text += (f": the network's best, {_f(v['network_best'])} at step {v['network_best_step']:,}, against the "
                 f"linear start's {_f(v['linear_start'])} ({'+' if diff >= 0 else ''}{_f(diff)}; {se})"
                 + ("" if improved else "; the network never did better on validation"))
    return text + (". Its test predictions are the linear model's: in the figures its curves lie under the linear "
                   "model's, and their difference is 0.")

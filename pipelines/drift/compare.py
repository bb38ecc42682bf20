"""Comparing a window's counts with the training reference (``pipelines.drift.profile``): per feature, the label
and the predictions, the measures of ``pipelines.drift.measures`` (PSI, Jensen-Shannon, L-infinity) against their
thresholds, each entry with its buckets' shares; too few rows is no verdict (``min_rows``)."""
from __future__ import annotations

import math

import numpy as np

from pipelines.drift.measures import DEFAULT_THRESHOLDS, MIN_ROWS, RANGE_MARGIN, js, linf, psi
from pipelines.drift.profile import ERROR, OTHER, PREDICTION, UNSEEN


def _bucket_names_numeric(edges: list[float]) -> list[str]:
    if not edges:
        return ["all"]
    f = lambda v: f"{v:.4g}"  # noqa: E731
    return [f"< {f(edges[0])}", *(f"{f(a)} to {f(b)}" for a, b in zip(edges, edges[1:])), f">= {f(edges[-1])}"]


def _entry(feature: str, kind: str, measures: dict, thresholds: dict, ref_counts, cur_counts, buckets,
           rows: int, min_rows: int, limits: dict | None = None, extra: dict | None = None) -> dict:
    limits = limits or {m: thresholds[m] for m in measures if m in thresholds}
    judged = rows >= min_rows
    alarms = [m for m, v in measures.items() if judged and m in limits and v is not None and v > limits[m]]
    score = max([v / limits[m] for m, v in measures.items() if m in limits and v is not None and limits[m] > 0],
                default=0.0)
    ref = np.asarray(ref_counts, np.float64)
    cur = np.asarray(cur_counts, np.float64)
    return {"feature": feature, "kind": kind, "rows": rows, "measures": measures, "alarms": alarms,
            "alarm": bool(alarms), "score": score, "buckets": buckets,
            "reference": (ref / max(ref.sum(), 1)).tolist(), "current": (cur / max(cur.sum(), 1)).tolist(),
            **(extra or {})}


def compare(profile: dict, counts: dict, thresholds: dict | None = None, *, min_rows: int = MIN_ROWS,
            adwin: dict | None = None) -> dict:
    """Every feature's measures against ``thresholds`` (``DEFAULT_THRESHOLDS`` for those not given), its
    alarms (none below ``min_rows`` rows) and histograms, ranked by drift (the largest measure/threshold
    first); the label's and the prediction's; data-quality findings. ``adwin``: the prequential error's
    detector state ({"changes", "detected", "width", "mean"}), listed as the pseudo-feature ``ERROR``."""
    th = {**DEFAULT_THRESHOLDS, **(thresholds or {})}
    rows = int(counts["rows"])
    features, quality = [], []
    for col, ref in profile["numeric"].items():
        c = counts["numeric"][col]
        n = int(np.sum(c["bins"]))
        measures = {"psi": psi(ref["counts"], c["bins"]), "js": js(ref["counts"], c["bins"]),
                    "out_of_range": (c["below"] + c["above"]) / n if n else 0.0}
        if ref["optional"]:
            measures["missing"] = max(0.0, (c["missing"] / n if n else 0.0) - ref["missing"])
        constant = n >= min_rows and c["max"] <= c["min"] and ref["z_max"] > ref["z_min"]
        lo = c["min"] * ref["std"] + ref["mean"] if math.isfinite(c["min"]) else None
        hi = c["max"] * ref["std"] + ref["mean"] if math.isfinite(c["max"]) else None
        entry = _entry(col, "numeric", measures, th, ref["counts"], c["bins"], _bucket_names_numeric(ref["edges"]),
                       n, min_rows, extra={"range": [ref["min"], ref["max"]], "current_range": [lo, hi],
                                           "below": int(c["below"]), "above": int(c["above"]),
                                           "missing_count": int(c["missing"]), "constant": bool(constant)})
        if constant:
            entry["alarms"].append("constant")
            entry["alarm"] = True
            entry["score"] = max(entry["score"], 1.0)
        if c["below"] or c["above"]:
            quality.append({"feature": col, "issue": "out_of_range", "rows": int(c["below"] + c["above"]),
                            "detail": f"{c['below'] + c['above']} value(s) outside the training range "
                                      f"[{ref['min']:.4g}, {ref['max']:.4g}] by more than {RANGE_MARGIN:.0%} of it"})
        if constant:
            quality.append({"feature": col, "issue": "constant", "rows": n,
                            "detail": f"every value is {lo:.4g} (training: {ref['min']:.4g} to {ref['max']:.4g})"})
        if "missing" in entry["alarms"]:
            quality.append({"feature": col, "issue": "missing_spike", "rows": int(c["missing"]),
                            "detail": f"missing rate {c['missing'] / n:.1%} (training {ref['missing']:.1%})"})
        features.append(entry)
    for col, ref in profile["categorical"].items():
        bins = counts["categorical"][col]["bins"]
        n = int(np.sum(bins))
        unseen_now = float(bins[-1] / n) if n else 0.0
        measures = {"linf": linf(ref["counts"], bins), "unseen": max(0.0, unseen_now - ref["unseen"])}
        constant = n >= min_rows and int(np.count_nonzero(bins)) == 1 and int(np.count_nonzero(ref["counts"])) > 1
        entry = _entry(col, "categorical", measures, th, ref["counts"], bins, [*ref["values"], OTHER, UNSEEN], n,
                       min_rows, extra={"unseen_rate": unseen_now, "reference_unseen_rate": ref["unseen"],
                                        "constant": bool(constant)})
        if constant:
            entry["alarms"].append("constant")
            entry["alarm"] = True
            entry["score"] = max(entry["score"], 1.0)
            quality.append({"feature": col, "issue": "constant", "rows": n, "detail": "a single value in the window"})
        if "unseen" in entry["alarms"]:
            quality.append({"feature": col, "issue": "unseen_spike", "rows": int(bins[-1]),
                            "detail": f"unseen or missing rate {unseen_now:.1%} (training {ref['unseen']:.1%})"})
        features.append(entry)
    label = profile.get("label")
    if label is not None and "label" in counts:
        c = counts["label"]
        features.append(_target(label["name"], "label", label, c, th, min_rows))
    prediction = None
    if profile.get("prediction") is not None and "prediction" in counts:
        prediction = _target(PREDICTION, "prediction", profile["prediction"], counts["prediction"], th, min_rows,
                             limit="prediction")
        features.append(prediction)
    if adwin is not None:
        features.append({"feature": ERROR, "kind": "error", "rows": int(adwin.get("width", 0)),
                         "measures": {"adwin_changes": adwin.get("changes", 0), "error_rate": adwin.get("mean")},
                         "alarms": ["adwin"] if adwin.get("detected") else [], "alarm": bool(adwin.get("detected")),
                         "score": 1.0 if adwin.get("detected") else 0.0, "buckets": [], "reference": [],
                         "current": []})
    features.sort(key=lambda e: -e["score"])
    return {"rows": rows, "thresholds": th, "min_rows": min_rows, "features": features,
            "alarms": [e["feature"] for e in features if e["alarm"]], "quality": quality,
            "prediction_drift": None if prediction is None else prediction["measures"]["drift"]}


def _target(name: str, kind: str, ref: dict, c: dict, th: dict, min_rows: int, limit: str | None = None) -> dict:
    rows = int(c["rows"])
    if ref["kind"] == "classes":
        value, measure = linf(ref["counts"], c["bins"]), "linf"
        buckets = list(ref["values"])
    else:
        value, measure = psi(ref["counts"], c["bins"]), "psi"
        buckets = _bucket_names_numeric(ref["edges"])
    measures = {measure: value, **({"drift": value} if limit else {})}
    limits = {measure: th[limit or measure]}
    return _entry(name, kind, measures, th, ref["counts"], c["bins"], buckets, rows, min_rows, limits=limits)

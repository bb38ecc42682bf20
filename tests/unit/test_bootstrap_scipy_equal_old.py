"""Issue 30 item 7: the test metrics' percentile intervals come from ``scipy.stats.bootstrap`` and equal the
hand-written bootstrap they replaced (kept here as the oracle) on the same resamples: per model, the paired
difference, resamples drawn in batches, and resamples whose metric is undefined left out."""
from __future__ import annotations

import math

import numpy as np
import pytest

from flowtrain.train import evaluation
from flowtrain.train.evaluation import INTERVAL_METRICS, bootstrap, prepare, weighted_metrics


def _old_interval(values):
    v = np.asarray([x for x in values if x == x], dtype=np.float64)
    if not len(v):
        return {"low": float("nan"), "high": float("nan")}
    low, high = np.percentile(v, [2.5, 97.5])
    return {"low": float(low), "high": float(high)}


def _widened(out):
    """An interval that misses its estimate widened to it (the new rule: the report never shows an estimate outside
    its interval), on every interval of an ``_old_bootstrap`` result."""
    groups = [*out["models"].values(), *([out["difference"]["metrics"]] if "difference" in out else [])]
    for m in (m for g in groups for m in g.values()):
        if not any(math.isnan(m[k]) for k in ("value", "low", "high")):
            m["low"], m["high"] = min(m["low"], m["value"]), max(m["high"], m["value"])
    return out


def _old_bootstrap(kind, y, preds, rows, difference=None, *, widen=True):
    """The old loop and percentiles, over given resamples (``rows``: [b, n] drawn row indices); with ``widen`` an
    interval that misses its estimate is widened to it."""
    n = len(y)
    draws = {name: [] for name in preds}
    prepared = {name: prepare(kind, y, p) for name, p in preds.items()}
    for r in rows:
        w = np.bincount(r, minlength=n).astype(np.float64)
        for name, p in preds.items():
            draws[name].append(weighted_metrics(kind, y, p, w, prepared[name]))
    out = {"resamples": len(rows), "models": {}}
    for name, p in preds.items():
        point = weighted_metrics(kind, y, p, np.ones(n), prepared[name])
        out["models"][name] = {k: {"value": v, **_old_interval([d[k] for d in draws[name]])} for k, v in point.items()}
    if difference:
        a, c = difference
        out["difference"] = {"of": [a, c], "metrics": {}}
        for k in INTERVAL_METRICS[kind]:
            value = out["models"][a][k]["value"] - out["models"][c][k]["value"]
            out["difference"]["metrics"][k] = {"value": value, **_old_interval(
                [da[k] - dc[k] for da, dc in zip(draws[a], draws[c])])}
    return _widened(out) if widen else out


def _rows(n, b, seed, batch):
    """The resamples scipy draws: ``default_rng(seed).integers(0, n, (batch, n))`` batch after batch."""
    rng = np.random.default_rng(seed)
    return np.concatenate([rng.integers(0, n, (min(batch, b - k), n)) for k in range(0, b, batch)])


def _same(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _same(a[key], b[key])
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b)
    elif isinstance(a, float):
        assert a == pytest.approx(b, rel=1e-12, abs=1e-15)
    else:
        assert a == b


def _data(kind, n, rng):
    if kind == "binary":
        y = (rng.random(n) < 0.3).astype(float)
        good = np.round(np.clip(0.3 + 0.4 * (y - 0.3) + rng.normal(scale=0.15, size=n), 0.001, 0.999), 2)
        return y, {"good": good, "bad": np.full(n, 0.3)}
    if kind == "multiclass":
        y = rng.integers(0, 3, n).astype(float)
        return y, {"good": rng.dirichlet(np.ones(3), n), "bad": np.full((n, 3), 1 / 3)}
    y = rng.normal(size=n)
    return y, {"good": y + rng.normal(scale=0.5, size=n), "bad": np.zeros(n)}


@pytest.mark.parametrize("kind", ["binary", "multiclass", "regression"])
def test_bootstrap_is_scipys_percentile_interval_and_equals_the_old_loop(kind):
    y, preds = _data(kind, 1500, np.random.default_rng(1))
    new = bootstrap(kind, y, preds, b=60, seed=7, difference=("good", "bad"))
    _same(new, _old_bootstrap(kind, y, preds, _rows(1500, 60, 7, 60), difference=("good", "bad")))
    assert new["models"]["good"][next(iter(INTERVAL_METRICS[kind]))]["low"] < \
        new["models"]["good"][next(iter(INTERVAL_METRICS[kind]))]["high"]


def test_bootstrap_in_batches_and_with_undefined_resamples_equals_the_old_loop(monkeypatch):
    monkeypatch.setattr(evaluation, "BOOTSTRAP_BATCH_ROWS", 7 * 40)  # 7 resamples of 40 rows per batch
    y = np.zeros(40)
    y[:2] = 1.0  # two positives in 40 rows: some resamples have none (AUC undefined there)
    p = np.linspace(0.05, 0.95, 40)
    new = bootstrap("binary", y, {"m": p}, b=50, seed=3)
    old = _old_bootstrap("binary", y, {"m": p}, _rows(40, 50, 3, 7))
    _same(new, old)
    assert not math.isnan(new["models"]["m"]["auc"]["low"])


def test_bootstrap_of_one_row_or_none():
    one = bootstrap("regression", np.array([1.0]), {"m": np.array([3.0])}, b=10)
    assert one["models"]["m"]["mae"] == {"value": 2.0, "low": 2.0, "high": 2.0}
    none = bootstrap("regression", np.zeros(0), {"m": np.zeros(0)}, b=10)
    assert math.isnan(none["models"]["m"]["mae"]["low"])


def test_an_interval_that_misses_its_estimate_is_widened_to_it():
    """The R^2 of a constant prediction is at most 0, reached when it is the test set's own mean: then every
    resample's R^2 is below the test set's and the percentile interval ends below its estimate. The report widens
    such an interval to the estimate (never narrows one)."""
    y = np.random.default_rng(0).normal(size=400)
    preds = {"mean": np.full(400, y.mean()), "good": y + np.random.default_rng(1).normal(scale=0.5, size=400)}
    raw = _old_bootstrap("regression", y, preds, _rows(400, 200, 0, 200), widen=False)["models"]["mean"]["r2"]
    assert raw["value"] == pytest.approx(0.0, abs=1e-12) and raw["high"] < raw["value"]  # the percentiles miss it
    got = bootstrap("regression", y, preds, b=200, seed=0)
    _same(got["models"]["mean"]["r2"], {"value": raw["value"], "low": raw["low"], "high": raw["value"]})
    for name, metrics in got["models"].items():  # every interval holds its estimate; the rest are the percentiles
        for key, m in metrics.items():
            assert m["low"] <= m["value"] <= m["high"], (name, key, m)
    _same(got["models"]["good"], _old_bootstrap("regression", y, preds, _rows(400, 200, 0, 200),
                                                widen=False)["models"]["good"])

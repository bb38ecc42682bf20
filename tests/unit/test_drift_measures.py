"""Issue 34 items 1-2: drift measures (PSI, Jensen-Shannon, L-infinity), thresholds, ADWIN, and the reference
profile / window counts / comparison on featurized columns (pure numpy, no runner)."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from connectors.dataset_spec import FeatureSpec
from pipelines.drift.compare import compare
from pipelines.drift.measures import DEFAULT_THRESHOLDS, Adwin, js, linf, parse_thresholds, psi
from pipelines.drift.profile import (
    PREDICTION,
    Counter,
    counts_from_json,
    counts_to_json,
    merge,
    reference_profile,
)


def test_measures_are_zero_for_equal_histograms_and_grow_with_the_shift():
    ref = [100, 200, 300, 400]
    assert psi(ref, ref) == pytest.approx(0.0) and js(ref, ref) == pytest.approx(0.0) and linf(ref, ref) == 0.0
    assert psi(ref, [10, 20, 30, 40]) == pytest.approx(0.0, abs=1e-3)  # shares, not counts
    assert js([1000, 0], [0, 1000]) == pytest.approx(1.0, abs=0.01)  # disjoint: ~1 bit
    assert js(ref, [400, 300, 200, 100]) == pytest.approx(js([400, 300, 200, 100], ref))  # symmetric
    assert linf(ref, [400, 300, 200, 100]) == pytest.approx(0.3)
    small, large = psi(ref, [120, 200, 300, 380]), psi(ref, [400, 300, 200, 100])
    assert 0 < small < large and np.isfinite(psi([0, 10], [10, 0]))  # empty buckets are smoothed


def test_drift_thresholds_parse_with_documented_defaults_and_clear_errors():
    assert parse_thresholds(None) == DEFAULT_THRESHOLDS
    assert parse_thresholds("psi=0.3, linf=0.05")["psi"] == 0.3
    assert parse_thresholds("psi=0.3")["js"] == DEFAULT_THRESHOLDS["js"]
    with pytest.raises(ValueError, match="MEASURE one of psi"):
        parse_thresholds("ks=0.1")
    with pytest.raises(ValueError, match="positive number"):
        parse_thresholds("psi=-1")


def test_adwin_no_false_alarm_on_a_stationary_error_and_detects_a_doubled_error_rate():
    rng = np.random.default_rng(1)
    quiet = Adwin(delta=0.002)
    for chunk in np.split((rng.random(100_000) < 0.2).astype(float), 200):
        quiet.update(chunk)
    assert quiet.changes == 0 and quiet.mean == pytest.approx(0.2, abs=0.01)
    detector = Adwin(delta=0.002)
    detector.update(rng.random(5000) < 0.2)
    seen = None
    for i, chunk in enumerate(np.split((rng.random(5000) < 0.4).astype(float), 50)):
        if detector.update(chunk):
            seen = (i + 1) * 100
            break
    assert seen is not None and seen <= 1500, seen
    assert detector.mean > 0.3  # the old part was dropped


def _spec_stats():
    spec = FeatureSpec(label="y", task="classification", numeric=["a", "b"], categorical=["c", "d"],
                       optional_numeric=["e"])
    stats = {"numeric": {"a": {"mean": 10.0, "std": 2.0}, "b": {"mean": 0.0, "std": 1.0},
                         "e": {"mean": 5.0, "std": 1.0}},
             "vocab": {"c": ["x", "y", "z"], "d": ["p", "q"]}}
    return spec, stats


def _features(rng, n, *, shift_a=0.0, new_c=0.0, positive=0.25, missing_e=0.05):
    a = rng.normal(size=n) + shift_a  # standardized: +1 = one training s.d.
    c = rng.choice([1, 2, 3], size=n, p=[0.5, 0.3, 0.2])
    c[rng.random(n) < new_c] = 0  # a value training never saw: code 0
    e = rng.normal(size=n)
    e[rng.random(n) < missing_e] = 0.0  # a missing optional numeric is featurized as the mean
    batch = pa.RecordBatch.from_arrays(
        [pa.array(a.astype(np.float32)), pa.array(rng.normal(size=n).astype(np.float32)),
         pa.array(e.astype(np.float32)), pa.array(c.astype(np.int32)),
         pa.array(rng.choice([1, 2], size=n).astype(np.int32)),
         pa.array((rng.random(n) < positive).astype(np.float32))],
        names=["num__a", "num__b", "num__e", "cat__c", "cat__d", "label"])
    return batch


def test_reference_profile_and_window_counts_alarm_only_for_the_shifted_features():
    spec, stats = _spec_stats()
    rng = np.random.default_rng(0)
    train = _features(rng, 20_000)
    scores = rng.random(5000)
    profile = reference_profile(train, spec, stats, classes=["no", "yes"], scores=scores)
    assert len(profile["numeric"]["a"]["counts"]) == 10 and profile["numeric"]["a"]["min"] < 10 - 4
    assert profile["categorical"]["c"]["values"] == ["x", "y", "z"] and profile["label"]["values"] == ["no", "yes"]
    assert profile["numeric"]["e"]["missing"] == pytest.approx(0.05, abs=0.01)
    counter = Counter(profile)

    def window(batch, s):
        total = counter.empty()
        for part in batch.to_batches(max_chunksize=250) if isinstance(batch, pa.Table) else [batch]:
            total = merge(total, counter.count(part, part.column("label").to_numpy(), s))
        return total

    quiet = compare(profile, window(_features(rng, 2000), rng.random(2000)))
    assert quiet["alarms"] == [], [(e["feature"], e["measures"]) for e in quiet["features"] if e["alarm"]]
    shifted = _features(rng, 2000, shift_a=1.0, new_c=0.3, positive=0.5, missing_e=0.4)
    report = compare(profile, window(shifted, rng.random(2000) ** 0.3))
    assert set(report["alarms"]) == {"a", "c", "y", "e", PREDICTION}, report["alarms"]
    by = {e["feature"]: e for e in report["features"]}
    assert "psi" in by["a"]["alarms"] and "unseen" in by["c"]["alarms"] and "missing" in by["e"]["alarms"]
    assert by["y"]["kind"] == "label" and report["prediction_drift"] > 0.2
    assert {q["issue"] for q in report["quality"]} >= {"unseen_spike", "missing_spike"}
    assert report["features"][0]["score"] >= report["features"][-1]["score"]  # ranked by drift
    # counts survive JSON (status files, drift records)
    again = counts_from_json(counts_to_json(window(shifted, None)))
    assert compare(profile, again)["rows"] == 2000


def test_data_quality_out_of_range_and_constant_features():
    spec, stats = _spec_stats()
    rng = np.random.default_rng(2)
    profile = reference_profile(_features(rng, 5000), spec, stats, classes=["no", "yes"])
    batch = _features(rng, 500)
    cols = {n: batch.column(n) for n in batch.schema.names}
    cols["num__a"] = pa.array(np.where(np.arange(500) < 50, 40.0, batch.column("num__a").to_numpy()).astype(np.float32))
    cols["num__b"] = pa.array(np.full(500, 0.7, np.float32))  # stuck
    report = compare(profile, Counter(profile).count(pa.RecordBatch.from_arrays(list(cols.values()),
                                                                                 names=list(cols))))
    issues = {(q["feature"], q["issue"]) for q in report["quality"]}
    assert ("a", "out_of_range") in issues and ("b", "constant") in issues
    by = {e["feature"]: e for e in report["features"]}
    assert by["a"]["measures"]["out_of_range"] == pytest.approx(0.1) and "constant" in by["b"]["alarms"]
    # too few rows: measured, never an alarm
    few = compare(profile, Counter(profile).count(_features(rng, 20, shift_a=3.0)))
    assert few["alarms"] == [] and {e["feature"]: e for e in few["features"]}["a"]["measures"]["psi"] > 1


def test_regression_label_and_k_class_scores_are_profiled_and_compared():
    spec = FeatureSpec(label="price", task="regression", numeric=["a"])
    stats = {"numeric": {"a": {"mean": 0.0, "std": 1.0}}, "vocab": {}}
    rng = np.random.default_rng(3)

    def batch(n, shift=0.0):
        return pa.RecordBatch.from_arrays([pa.array(rng.normal(size=n).astype(np.float32)),
                                           pa.array((rng.normal(100, 10, n) + shift).astype(np.float32))],
                                          names=["num__a", "label"])

    profile = reference_profile(batch(10_000), spec, stats, scores=rng.normal(100, 10, 3000))
    assert profile["label"]["kind"] == "numeric" and profile["prediction"]["kind"] == "numeric"
    counter = Counter(profile)
    same, moved = batch(2000), batch(2000, shift=10.0)
    assert compare(profile, counter.count(same, same.column("label").to_numpy(), rng.normal(100, 10, 2000)))[
        "alarms"] == []
    report = compare(profile, counter.count(moved, moved.column("label").to_numpy(), rng.normal(110, 10, 2000)))
    assert set(report["alarms"]) == {"price", PREDICTION}
    # K classes: the predicted class's counts (scores are (rows, K) probabilities)
    k = reference_profile(batch(1000), FeatureSpec(label="c", task="classification", numeric=["a"]), stats,
                          classes=["x", "y", "z"], scores=rng.dirichlet([1, 1, 1], 1000))
    assert k["prediction"]["kind"] == "classes" and k["prediction"]["values"] == ["x", "y", "z"]
    skewed = np.tile([0.9, 0.05, 0.05], (500, 1))
    assert compare(k, Counter(k).count(batch(500), None, skewed))["prediction_drift"] > 0.5

"""Issue 34 item 2 (drift in the scorer), without a broker: the scorer's sliding window (DriftMonitor) over
micro-batches, its status files added across instances (window_report), and the gauges on /metrics."""
from __future__ import annotations

import json
import urllib.request

import numpy as np
import pyarrow as pa

from pipelines.drift.measures import DEFAULT_THRESHOLDS
from pipelines.drift.profile import reference_profile
from pipelines.serving.drift import DriftConfig, DriftMonitor, window_report
from pipelines.stream.status import write_status
from tests.unit.test_drift_measures import _features, _spec_stats


def test_scorer_drift_window_slides_and_serves_feature_drift_gauges(tmp_path):
    from flowtrain.observe.server import StatusServer

    spec, stats = _spec_stats()
    rng = np.random.default_rng(5)
    profile = reference_profile(_features(rng, 20_000), spec, stats, classes=["no", "yes"])
    assert "prediction" not in profile  # made from the dataset: the scores' reference is the first window
    cfg = DriftConfig(profile=profile, window=1000, every_s=0.0)
    prefix = str(tmp_path / "score-status.json")
    (tmp_path / "ref.json").write_text(json.dumps({"profile": profile, "thresholds": DEFAULT_THRESHOLDS,
                                                   "window": 1000}))
    monitors = [DriftMonitor(cfg, classification=True) for _ in range(2)]  # two scorer instances

    def feed(batch: pa.RecordBatch, scores):
        for i, m in enumerate(monitors):
            part = batch.slice(i * batch.num_rows // 2, batch.num_rows // 2)
            label = part.column("label").to_numpy()
            m.add(part, label, scores[: part.num_rows], (rng.random(part.num_rows) < 0.2).astype(float))
            write_status(prefix, m, m.status(), kind="drift")

    for _ in range(8):  # unshifted: the first window's scores become the reference, then no alarm
        feed(_features(rng, 500), rng.random(250))
    quiet = window_report(prefix, str(tmp_path / "ref.json"))
    assert quiet["instances"] == 2 and 2000 <= quiet["rows"] <= 2500 and quiet["alarms"] == [], quiet["alarms"]
    for _ in range(8):  # shifted: the window slides onto the new data
        feed(_features(rng, 500, shift_a=1.0, new_c=0.3, positive=0.5), rng.random(250) ** 0.3)
    report = window_report(prefix, str(tmp_path / "ref.json"))
    assert set(report["alarms"]) == {"a", "c", "y", "(prediction)"}, report["alarms"]
    assert report["rows"] <= 2500  # only the newest micro-batches: the unshifted ones left the window

    server = StatusServer(0, lambda: {"state": "running", "drift": report}).start()
    try:
        text = urllib.request.urlopen(f"{server.url}metrics", timeout=10).read().decode()
    finally:
        server.stop()
    assert 'flowtrain_feature_drift{feature="a",measure="psi"}' in text
    assert 'flowtrain_drift_alarm{feature="a"} 1.0' in text and 'flowtrain_drift_alarm{feature="b"} 0.0' in text
    assert 'flowtrain_drift_alarm{feature="c"} 1.0' in text and 'flowtrain_drift_alarm{feature="y"} 1.0' in text
    assert "flowtrain_prediction_drift " in text


def test_scorer_drift_window_of_seconds_drops_old_micro_batches(monkeypatch):
    import pipelines.serving.drift as drift

    spec, stats = _spec_stats()
    rng = np.random.default_rng(6)
    profile = reference_profile(_features(rng, 5000), spec, stats, classes=["no", "yes"], scores=rng.random(1000))
    clock = [1000.0]
    monkeypatch.setattr(drift.time, "monotonic", lambda: clock[0])
    m = DriftMonitor(DriftConfig(profile=profile, window=100_000, window_s=30.0), classification=True)
    for _ in range(4):  # 4 micro-batches, 10 s apart: with 30 s, the oldest has left the window
        m.add(_features(rng, 200), None, None)
        clock[0] += 10.0
    m.add(_features(rng, 200), None, None)
    assert m.counts()["rows"] == 4 * 200  # events alone (100,000) would keep all 5

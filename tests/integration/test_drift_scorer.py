"""Issue 34, done when (the scorer): a stream whose second half is shifted (temp's mean +1 s.d., the site
gaining a new frequent value, the label's "fail" rate about doubled) is scored by `flowtrain stream score`
on the real broker and Prism: with a drift window of the documented size, no alarm while the unshifted
first half fills it; then alarms for temp, site and the label, not for pressure, humidity or machine, on
/metrics, on the status page (headless Chromium) and as records on --drift-topic."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

from flowtrain.local.tools import free_port
from tests.procs import stop_group as _stop
from tests.scoring_helpers import (
    apply_marks,
    batch_model,
    events,
    make_sensor,
    produce,
    publish,
    publisher,
    read_topic,
    scorer,
    topic_names,
    wait_covered,
)

WINDOW = 1000  # --drift-window: the shifted half is twice as long, so the window ends all shifted
HALF = 2000
SHIFTED = {"temp", "site", "state"}
UNSHIFTED = {"pressure", "humidity", "machine"}


@pytest.fixture(scope="module")
def drift_sensor(shared_data, tmp_path_factory) -> dict:
    return make_sensor(shared_data, tmp_path_factory.mktemp("driftsensor"))


def _shifted(rows: list[dict], seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for row in rows:
        row = dict(row)
        row["temp"] = row["temp"] + 10.0  # one training standard deviation (sensor_rows: N(60, 10))
        if rng.random() < 0.3:
            row["site"] = "west"  # never seen in training
        if "state" in row and row["state"] != "fail" and rng.random() < 0.3:
            row["state"] = "fail"
        out.append(row)
    return out


def _alarms(port: int) -> dict[str, float]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "flowtrain_drift_alarm":
                out[s.labels["feature"]] = s.value
            elif s.name == "flowtrain_drift_window_rows":
                out["(rows)"] = s.value
            elif s.name == "flowtrain_prediction_drift":
                out["(prediction drift)"] = s.value
    return out


def _wait_for(condition, proc, log, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = condition()
        if last:
            return last
        assert proc.poll() is None, log.read_text()[-3000:]
        time.sleep(1.0)
    pytest.fail(f"timed out waiting for {what}\n{log.read_text()[-3000:]}")


@apply_marks([pytest.mark.kafka, pytest.mark.streaming, pytest.mark.timeout(900)])
def test_scorer_drift_alarms_fire_for_the_shifted_features_only_on_metrics_page_and_topic(
        bootstrap, drift_sensor, tmp_path, say):
    from connectors.kafka import ensure_topic
    from tests.integration.test_observe_stream import _chrome

    driver = _chrome()  # first: no browser, no run
    names = topic_names()
    drift_topic = f"sdrift-{names['group']}"
    ensure_topic(bootstrap, names["raw"], partitions=1)
    ensure_topic(bootstrap, names["updates"])
    arch, trained = batch_model(drift_sensor)
    publish(bootstrap, names, publisher(drift_sensor, tmp_path / "trainer"), 1, arch, trained)
    rows = events(2 * HALF, seed=34, unlabelled_every=0)
    first, second = rows[:HALF], _shifted(rows[HALF:], seed=34)
    n = produce(bootstrap, names["raw"], first)
    port = free_port()
    proc = scorer(bootstrap, names, drift_sensor["dataset"], tmp_path / "run", "--update-key-file",
                  drift_sensor["key_file"], "--metrics-port", str(port), "--drift-window", str(WINDOW),
                  "--drift-reference", str(drift_sensor["run"]), "--drift-topic", drift_topic)
    log = tmp_path / "run" / "scorer.log"
    try:
        wait_covered(bootstrap, names, n, proc, log)
        quiet = _wait_for(lambda: (lambda a: a if a.get("(rows)", 0) >= WINDOW and "temp" in a else None)(
            _alarms(port)), proc, log, 60, "a full drift window of the first half on /metrics")
        raised = {f for f, v in quiet.items() if not f.startswith("(") and v}
        assert raised == set(), f"false alarms on the unshifted half: {quiet}"
        say(f"\ndrift: unshifted window of {quiet['(rows)']:.0f} events, no alarm")

        n += produce(bootstrap, names["raw"], second)
        wait_covered(bootstrap, names, n, proc, log)
        shifted = _wait_for(lambda: (lambda a: a if all(a.get(f) == 1.0 for f in SHIFTED) else None)(
            _alarms(port)), proc, log, 60, "the shifted features' alarms on /metrics")
        assert all(shifted[f] == 0.0 for f in UNSHIFTED), shifted
        assert shifted["(prediction drift)"] > 0
        say(f"drift: shifted window alarms {sorted(f for f, v in shifted.items() if v == 1.0 and f[0] != '(')}")

        # the status page: the drift panel ranks features by drift, each with its reference and current histograms
        driver.get(f"http://127.0.0.1:{port}/")

        def panel():
            found = driver.execute_script(
                "return [...document.querySelectorAll('#drift tbody tr[data-feature]')].map(r => "
                "[r.dataset.feature, r.dataset.alarm, r.querySelectorAll('svg rect').length])")
            return found if found and {f for f, a, _ in found if a == "1"} >= SHIFTED else None

        shown = _wait_for(panel, proc, log, 30, "the drift panel in the browser")
        alarm = {f for f, a, _ in shown if a == "1"}
        assert alarm & UNSHIFTED == set() and alarm >= SHIFTED, shown
        order = [f for f, _, _ in shown]
        assert max(order.index(f) for f in SHIFTED) < min(order.index(f) for f in UNSHIFTED), order  # ranked
        assert all(bars > 0 for f, _, bars in shown if f in SHIFTED | UNSHIFTED), shown
        driver.save_screenshot(str(tmp_path / "drift-panel.png"))
    finally:
        driver.quit()
        _stop(proc)
    records = [json.loads(m.value) for m in read_topic(bootstrap, drift_topic)]
    assert records and set(records[-1]["alarms"]) >= SHIFTED, records[-1:]
    assert not set(records[-1]["alarms"]) & UNSHIFTED

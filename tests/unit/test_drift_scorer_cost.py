"""Issue 34 (drift monitoring costs <= 10% of the scorer's throughput): the scorer's window keeps a running total
(a micro-batch added when it comes, subtracted when it leaves) that must equal a fresh merge of the window's
micro-batches, and the window is published (status file, drift records) by the reporter's thread at most once
per ``flush_s``, at the latest ``flush_s`` after the newest micro-batch, and at once on close."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

from pipelines.drift.compare import compare
from pipelines.drift.profile import Counter, merge, reference_profile
from pipelines.serving.drift import DriftConfig, DriftMonitor, DriftReporter
from pipelines.stream.status import read_status
from tests.unit.test_drift_measures import _features, _spec_stats


def _same(a, b, path="counts"):
    if isinstance(a, dict):
        assert set(a) == set(b), path
        for key in a:
            _same(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        assert np.array_equal(a, b), (path, a, b)
    else:
        assert a == b and type(a) is type(b), (path, a, b)


@pytest.mark.parametrize("with_scores_reference", [True, False])
def test_drift_running_window_total_equals_a_fresh_merge_after_many_windows_with_expiry(
        monkeypatch, with_scores_reference):
    import pipelines.serving.drift as drift

    spec, stats = _spec_stats()
    rng = np.random.default_rng(11)
    profile = reference_profile(_features(rng, 5000), spec, stats, classes=["no", "yes"],
                                scores=rng.random(2000) if with_scores_reference else None)
    clock = [100.0]
    monkeypatch.setattr(drift.time, "monotonic", lambda: clock[0])
    m = DriftMonitor(DriftConfig(profile=profile, window=1500, window_s=20.0), classification=True)
    fed = []  # (batch, label, scores, when) since the window's counter was made
    for step in range(250):
        n = int(rng.integers(0, 400))
        batch = _features(rng, n, shift_a=float(rng.normal()), new_c=float(rng.random()) * 0.3)
        label = batch.column("label").to_numpy().astype(np.float64)
        label[rng.random(n) < 0.1] = np.nan
        scores = rng.random(n)
        switching = m.pending_scores is not None and sum(map(len, m.pending_scores)) + n >= m.cfg.window
        m.add(batch, label, scores, (rng.random(n) < 0.2).astype(float))
        if switching:  # the first full window's scores became the reference: a new, empty window
            assert m.pending_scores is None and "prediction" in m.profile
            fed = []
        else:
            fed.append((batch, label, scores if m.pending_scores is None else None, clock[0]))
        # the window, chosen as the monitor's rule says: the newest micro-batches holding at least `window`
        # events, none older than window_s
        rows = sum(b.num_rows for b, *_ in fed)
        while fed and (rows - fed[0][0].num_rows >= 1500 or clock[0] - fed[0][3] > 20.0):
            rows -= fed.pop(0)[0].num_rows
        counter = Counter(m.profile)
        expected = counter.empty()
        for batch, label, scores, _ in fed:
            expected = merge(expected, counter.count(batch, label, scores))
        got = m.counts()
        _same(got, expected)
        if step % 25 == 0:
            assert compare(m.profile, got) == compare(m.profile, expected)
        clock[0] += float(rng.choice([0.1, 1.0, 7.0]))
    assert m.seen > 20 * 1500  # many windows went by


def _reporter(tmp_path, flush_s: float, **kw):
    spec, stats = _spec_stats()
    rng = np.random.default_rng(12)
    profile = reference_profile(_features(rng, 5000), spec, stats, classes=["no", "yes"], scores=rng.random(2000))
    prefix = str(tmp_path / "score-status.json")
    return DriftReporter(DriftConfig(profile=profile, window=1000, flush_s=flush_s, **kw.pop("cfg", {})),
                         classification=True, status_path=prefix, **kw), prefix, rng


def _feed(reporter, rng, n: int, **shift):
    batch = _features(rng, n, **shift)
    reporter.add(batch, batch.column("label").to_numpy().astype(np.float64), rng.random(n) ** (0.3 if shift else 1),
                 (rng.random(n) < 0.2).astype(float))


def _wait(condition, what: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


def test_drift_status_written_at_most_once_per_flush_interval_and_the_last_window_at_close(tmp_path):
    reporter, prefix, rng = _reporter(tmp_path, flush_s=3600.0)
    try:
        _feed(reporter, rng, 200)
        _wait(lambda: reporter.writes >= 1, "the first window's status file")  # the first one at once
        for _ in range(60):  # the old scorer wrote the window after each of them
            _feed(reporter, rng, 200)
        assert reporter.writes == 1
        [first] = read_status(prefix, "drift")
        assert first["counts"]["rows"] == 200
    finally:
        reporter.close()
    assert reporter.writes == 2  # close publishes the newest window
    [last] = read_status(prefix, "drift")
    final = reporter.monitor.counts()
    assert last["counts"]["rows"] == final["rows"] >= 1000
    assert last["counts"]["numeric"]["a"]["bins"] == final["numeric"]["a"]["bins"].tolist()


def test_drift_status_and_alarm_records_published_when_the_stream_goes_idle(tmp_path):
    records = []
    reporter, prefix, rng = _reporter(tmp_path, flush_s=0.2, send=records.append)
    try:
        for _ in range(10):
            _feed(reporter, rng, 250)
        for _ in range(8):  # the window slides onto shifted data; then the stream goes idle
            _feed(reporter, rng, 250, shift_a=1.0, new_c=0.3, positive=0.5)
        final = reporter.monitor.counts()
        # no micro-batch comes any more: within flush_s the thread publishes the last window and its alarms
        _wait(lambda: (lambda s: s and s[0]["counts"]["rows"] == final["rows"] and
                       s[0]["counts"]["categorical"]["c"]["bins"] == final["categorical"]["c"]["bins"].tolist())(
            read_status(prefix, "drift")), "the idle stream's last window in the status file")
        _wait(lambda: records and {"a", "c", "y"} <= set(json.loads(records[-1])["alarms"]),
              "a drift record with the shifted window's alarms")
        assert len(records) <= reporter.writes  # a record only with a published window, never per micro-batch
    finally:
        reporter.close()


def test_drift_record_that_cannot_be_sent_fails_the_next_micro_batch(tmp_path):
    def send(value: bytes):
        raise RuntimeError("drift topic: the broker refused the record")

    reporter, _, rng = _reporter(tmp_path, flush_s=0.05, send=send)

    def raised():
        try:
            _feed(reporter, rng, 100)
        except RuntimeError as err:
            return str(err)
        return None

    assert "broker refused" in _wait(raised, "the send failure on the scoring thread")
    reporter.close()

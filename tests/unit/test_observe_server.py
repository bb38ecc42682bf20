"""flowtrain.observe.server on its own: /metrics parsed with prometheus_client's parser, /status.json,
the self-contained page, --metrics-port errors. (Against a running stream job, with a real browser:
tests/integration/test_observe_stream.py.)"""
from __future__ import annotations

import json
import re
import socket
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families


def _snapshot(i: int) -> dict:
    return {"state": "running", "halves": {"pipeline": "running", "trainer": "stopped"},
            "counters": {"events": 100 * i, "rows": 90 * i, "dead_letters": 3},
            "dead_letters_by_reason": {'bad "json"\nline': 2, "missing field dep_delay": 1},
            "lag": {"1": 7, "0": 5}, "trainer_step": i, "train_loss": 0.25, "prequential": {"auc": 0.75},
            "published_version": 4, "serving_version": 3, "freshness_s": 1.5, "latency": {"count": 10, "sum_s": 2.5,
                                                                                          "buckets": [[0.5, 4], [1.0, 9]]},
            "dead_letters": [{"time": 1.0, "reason": "bad json", "source": "raw/0@5", "payload": "{x"}],
            "versions": [{"version": 4, "state": "published"}, {"version": 2, "state": "rejected",
                                                                 "reason": "bad signature"}]}


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read()


def _samples(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_status_and_page_serve_the_newest_snapshot():
    from flowtrain.observe.server import StatusServer

    calls = {"n": 0}

    def sample():
        calls["n"] += 1
        return _snapshot(calls["n"])

    server = StatusServer(0, sample, interval_s=0.1).start()
    try:
        assert server.host == "127.0.0.1"
        deadline = time.monotonic() + 30
        while calls["n"] < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        samples = _samples(_get(server.url + "metrics").decode())
        i = int(samples[("flowtrain_sample_number", ())])
        assert i >= 3
        assert samples[("flowtrain_events_total", ())] == 100 * i  # the same snapshot throughout the scrape
        assert samples[("flowtrain_trainer_step", ())] == i
        assert samples[("flowtrain_rows_total", ())] == 90 * i
        assert samples[("flowtrain_dead_letters_by_reason_total", (("reason", 'bad "json"\nline'),))] == 2
        assert samples[("flowtrain_consumer_lag", (("partition", "0"),))] == 5
        assert samples[("flowtrain_consumer_lag", (("partition", "1"),))] == 7
        assert samples[("flowtrain_prequential", (("metric", "auc"),))] == 0.75
        assert samples[("flowtrain_half_up", (("half", "pipeline"),))] == 1
        assert samples[("flowtrain_half_up", (("half", "trainer"),))] == 0
        assert samples[("flowtrain_published_version", ())] == 4 and samples[("flowtrain_serving_version", ())] == 3
        assert samples[("flowtrain_prediction_latency_seconds_count", ())] == 10
        assert samples[("flowtrain_prediction_latency_seconds_sum", ())] == 2.5
        assert samples[("flowtrain_prediction_latency_seconds_bucket", (("le", "0.5"),))] == 4
        assert samples[("flowtrain_prediction_latency_seconds_bucket", (("le", "1.0"),))] == 9
        assert samples[("flowtrain_prediction_latency_seconds_bucket", (("le", "+Inf"),))] == 10
        assert samples[("flowtrain_model_freshness_seconds", ())] == 1.5
        status = json.loads(_get(server.url + "status.json"))
        assert status["versions"][1] == {"version": 2, "state": "rejected", "reason": "bad signature"}
        assert status["sample_number"] >= i
        page = _get(server.url).decode()
        assert "<canvas" in page and "fetch(\"/metrics\"" in page
        assert not re.search(r"""(src|href)=["']?(https?:)?//""", page)  # nothing from outside: offline works
        with pytest.raises(urllib.error.HTTPError):
            _get(server.url + "nothing")
    finally:
        server.stop()


def test_a_failing_sample_keeps_the_last_snapshot_and_says_why():
    from flowtrain.observe.server import StatusServer

    state = {"fail": False}

    def sample():
        if state["fail"]:
            raise ConnectionError("broker away")
        return _snapshot(1)

    server = StatusServer(0, sample, interval_s=0.05).start()
    try:
        state["fail"] = True
        deadline = time.monotonic() + 30
        while server.errors == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        status = json.loads(_get(server.url + "status.json"))
        assert status["sample_error"] == "ConnectionError: broker away"
        assert _samples(_get(server.url + "metrics").decode())[("flowtrain_events_total", ())] == 100
    finally:
        server.stop()


def test_metrics_port_zero_is_off_and_a_used_port_is_named():
    from flowtrain.errors import FlowtrainError
    from flowtrain.observe.server import start_status_server

    assert start_status_server(0, lambda: {}) is None
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(FlowtrainError, match=rf"--metrics-port {port}: cannot listen on 127.0.0.1:{port}"):
            start_status_server(port, lambda: {})

"""Issue 30 item 7: ``/metrics`` of the status server is ``prometheus_client``'s WSGI app (OpenMetrics when
asked, gzip when accepted, ``name[]`` to pick families) behind the server's own checks: the ``Host`` header,
loopback binding, ``Cache-Control: no-store``, the other routes as before."""
from __future__ import annotations

import gzip
import http.client

import pytest

from flowtrain.observe.server import StatusServer


def _get(port: int, path: str, headers: dict | None = None, *, method: str = "GET", host: str | None = "default"):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        if host is not None:
            conn.putheader("Host", f"127.0.0.1:{port}" if host == "default" else host)
        for key, value in (headers or {}).items():
            conn.putheader(key, value)
        conn.endheaders()
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


@pytest.fixture
def server():
    s = StatusServer(0, lambda: {"state": "running", "trainer_step": 7, "counters": {"events": 5}},
                     interval_s=0.2).start()
    try:
        yield s
    finally:
        s.stop()


def test_metrics_is_prometheus_clients_wsgi_app_behind_the_host_check(server):
    port = server.port
    assert server.host == "127.0.0.1"
    status, headers, body = _get(port, "/metrics")
    assert status == 200 and headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert headers["Cache-Control"] == "no-store"
    assert "flowtrain_trainer_step 7.0" in body.decode() and "flowtrain_events_total 5.0" in body.decode()
    # what prometheus_client's app adds: OpenMetrics on request, gzip, a chosen family
    status, headers, body = _get(port, "/metrics", {"Accept": "application/openmetrics-text; version=1.0.0"})
    assert headers["Content-Type"].startswith("application/openmetrics-text") and body.endswith(b"# EOF\n")
    status, headers, body = _get(port, "/metrics", {"Accept-Encoding": "gzip"})
    assert headers["Content-Encoding"] == "gzip" and b"flowtrain_trainer_step 7.0" in gzip.decompress(body)
    status, headers, body = _get(port, "/metrics?name[]=flowtrain_trainer_step")
    assert b"flowtrain_trainer_step 7.0" in body and b"flowtrain_events_total" not in body
    # the Host check stands in front of it
    status, _, body = _get(port, "/metrics", host=f"attacker.example:{port}")
    assert status == 421 and b"flowtrain_" not in body


def test_the_other_routes_answer_as_before(server):
    port = server.port
    status, headers, body = _get(port, "/status.json")
    assert status == 200 and headers["Content-Type"] == "application/json" and b'"trainer_step": 7' in body
    assert headers["Cache-Control"] == "no-store"
    status, headers, body = _get(port, "/")
    assert status == 200 and headers["Content-Type"] == "text/html; charset=utf-8" and b"<html" in body.lower()
    assert _get(port, "/favicon.ico")[0] == 204
    status, _, body = _get(port, "/nothing")
    assert status == 404 and b"/, /metrics and /status.json are served" in body
    assert _get(port, "/status.json", method="POST")[0] == 405
    # an HTTP/1.0 client without Host (no browser) is answered
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn._http_vsn, conn._http_vsn_str = 10, "HTTP/1.0"
    try:
        conn.putrequest("GET", "/status.json", skip_host=True)
        conn.endheaders()
        assert conn.getresponse().status == 200
    finally:
        conn.close()

"""The status server answers only requests that name it in ``Host`` (issue 28.14): a page of another
site whose name was rebound to 127.0.0.1 (DNS rebinding) must not read ``/status.json``, which holds
dead-letter payloads."""
from __future__ import annotations

import http.client

import pytest

SECRET = "payload-of-a-dead-letter-4711"


def _request(port: int, path: str, host: str | None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.putrequest("GET", path, skip_host=True)
        if host is not None:
            conn.putheader("Host", host)
        conn.endheaders()
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


@pytest.fixture
def server():
    from flowtrain.observe.server import StatusServer

    s = StatusServer(0, lambda: {"state": "running", "dead_letters": [{"reason": "bad json", "payload": SECRET}]},
                     interval_s=0.2).start()
    try:
        yield s
    finally:
        s.stop()


def test_status_server_refuses_a_host_header_that_does_not_name_it_dns_rebinding(server):
    port = server.port
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"LOCALHOST:{port}", f"[::1]:{port}"):
        for path in ("/status.json", "/metrics", "/"):
            status, body = _request(port, path, host)
            assert status == 200, (host, path, status)
        assert SECRET.encode() in _request(port, "/status.json", host)[1]
    for host in (f"attacker.example:{port}", "attacker.example", f"127.0.0.1:{port + 1}", f"localhost.:{port}",
                 "127.0.0.1", "", f"127.0.0.1:{port}.attacker.example"):
        for path in ("/status.json", "/metrics", "/"):
            status, body = _request(port, path, host)
            assert status == 421, (host, path, status)
            assert SECRET.encode() not in body and b"flowtrain_" not in body
    # HTTP/1.1 without any Host header: refused too (RFC 9112 requires one; browsers always send it)
    status, body = _request(port, "/status.json", None)
    assert status == 421 and SECRET.encode() not in body


def test_allowed_hosts_name_the_bound_address_and_loopback_with_the_port():
    from flowtrain.observe.server import allowed_hosts

    assert allowed_hosts("127.0.0.1", 9400) == {"127.0.0.1:9400", "localhost:9400", "[::1]:9400"}
    assert "[::1]:9400" in allowed_hosts("::1", 9400)
    assert "10.0.0.5:9400" in allowed_hosts("10.0.0.5", 9400)
    assert "localhost" in allowed_hosts("127.0.0.1", 80) and "localhost" not in allowed_hosts("127.0.0.1", 9400)

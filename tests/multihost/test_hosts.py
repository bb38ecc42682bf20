"""The namespace-host harness itself: hosts reach each other on their LAN, and nothing is left behind
after a test, after a failing test, or after pytest is sent SIGTERM."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.multihost.hosts import MARKERS

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable


def _netns() -> set[str]:
    return set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())


def _links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout


def _gone(lan) -> bool:
    return (not set(lan.names) & _netns() and f" {lan.bridge}:" not in _links()
            and not any(f" {v}@" in _links() or f" {v}:" in _links() for v in lan.veths))


@pytest.mark.timeout(120)
def test_two_hosts_talk_over_their_lan_by_their_own_addresses(make_hosts):
    lan = make_hosts(2)
    assert lan.names == [f"ft-{lan.id}-host0", f"ft-{lan.id}-host1"] and len(lan.bridge) <= 15
    assert all(a.startswith(str(lan.network.network_address)[:-1]) for a in lan.addresses)
    server = lan.popen(1, [PY, "-c", textwrap.dedent(f"""
        import socket
        s = socket.socket(); s.bind(("{lan.addresses[1]}", 5000)); s.listen(1)
        c, peer = s.accept(); c.sendall(("hello " + peer[0]).encode()); c.close()
    """)])
    assert any(addr == lan.addresses[1] and port == 5000 for addr, port, _ in _wait(lambda: lan.listening(1)))
    client = lan.run(0, [PY, "-c", f"""
import socket
c = socket.create_connection(("{lan.addresses[1]}", 5000), timeout=10); print(c.recv(100).decode())"""])
    assert client.returncode == 0, client.stderr
    assert client.stdout.strip() == f"hello {lan.addresses[0]}"  # host 1 saw host 0's own address
    server.wait(timeout=20)
    # a host does not see the machine's own network: only its LAN and loopback
    routes = lan.run(0, ["ip", "-4", "route"]).stdout
    assert "default" not in routes and str(lan.network) in routes


@pytest.mark.timeout(120)
def test_close_kills_every_process_of_each_host_then_removes_namespaces_and_links(make_hosts):
    lan = make_hosts(2)
    sleepers = [lan.popen(k, ["sleep", "600"]) for k in range(2)]
    # a grandchild in its own session, which no process-group kill of ours would reach
    lan.run(1, ["sh", "-c", "setsid sleep 601 >/dev/null 2>&1 &"])
    orphan = _wait(lambda: [p for p in lan.pids(1) if p not in {s.pid for s in sleepers}
                            and b"601" in Path(f"/proc/{p}/cmdline").read_bytes()])[0]
    assert set(lan.names) <= _netns() and Path(MARKERS / f"{lan.id}.json").exists()
    lan.close()
    assert all(s.poll() is not None for s in sleepers)
    assert not Path(f"/proc/{orphan}").exists() or "Z" in Path(f"/proc/{orphan}/stat").read_text().split()[2]
    assert _gone(lan) and not Path(MARKERS / f"{lan.id}.json").exists()


def _pytest_child(tmp_path: Path, body: str) -> tuple[subprocess.Popen, Path]:
    """Run a one-test pytest in tests/multihost that makes 2 hosts, writes their id to a file, then ``body``."""
    test = tmp_path / "test_child.py"
    out = tmp_path / "lan.id"
    test.write_text(textwrap.dedent(f"""
        import time
        from pathlib import Path
        def test_child(make_hosts):
            lan = make_hosts(2)
            lan.popen(0, ["sleep", "600"])
            Path({str(out)!r}).write_text(lan.id)
        """) + textwrap.indent(textwrap.dedent(body), "    "))
    proc = subprocess.Popen([PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.multihost.conftest",
                             "--rootdir", str(tmp_path), str(test)], cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return proc, out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["failure", "sigterm"])
def test_hosts_are_removed_when_the_test_fails_or_pytest_gets_sigterm(tmp_path, how, namespaces_available):
    body = "assert False, 'a failing test'\n" if how == "failure" else "time.sleep(600)\n"
    proc, out = _pytest_child(tmp_path, body)
    try:
        lan_id = _wait(lambda: out.exists() and out.read_text(), timeout=120)
        names = {f"ft-{lan_id}-host0", f"ft-{lan_id}-host1"}
        assert names <= _netns()
        if how == "sigterm":
            os.kill(proc.pid, signal.SIGTERM)
        output = proc.communicate(timeout=90)[0]
        assert proc.returncode != 0, output
        assert not names & _netns(), output
        assert f"ft{lan_id}" not in _links(), output
        assert not (MARKERS / f"{lan_id}.json").exists()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@pytest.mark.timeout(180)
def test_hosts_of_a_killed_run_are_removed_by_the_next_one(tmp_path, make_hosts):
    proc, out = _pytest_child(tmp_path, "time.sleep(600)\n")
    try:
        lan_id = _wait(lambda: out.exists() and out.read_text(), timeout=120)
        os.killpg(proc.pid, signal.SIGKILL)  # no teardown can run
        proc.wait(timeout=30)
        assert f"ft-{lan_id}-host0" in _netns()
        make_hosts(1)  # the next run cleans up
        assert f"ft-{lan_id}-host0" not in _netns() and f"ft{lan_id}" not in _links()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _wait(probe, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout} s: {probe}")

"""Fixtures for the multi-host tests: namespace hosts on a private LAN (``tests/multihost/hosts.py``).

Every test here is marked ``multihost`` (the ``make test-multihost`` lane runs them; ``make test`` leaves them
out). Where namespaces cannot be made the tests FAIL with the one-line reason: a skip would let CI go green
while rehearsing nothing. SIGTERM to pytest becomes a KeyboardInterrupt once, so pytest unwinds and the
fixtures' teardown removes every host; whatever is still up at interpreter exit is removed by ``atexit``.
"""
from __future__ import annotations

import atexit
import signal
import weakref
from pathlib import Path

import pytest

from tests.multihost.hosts import HostLAN, why_unavailable

_live: weakref.WeakSet[HostLAN] = weakref.WeakSet()
_terminated = False


def _on_sigterm(signum, frame) -> None:
    global _terminated
    if _terminated:  # a second SIGTERM while tearing down: keep tearing down
        return
    _terminated = True
    raise KeyboardInterrupt("pytest got SIGTERM: tearing the multihost test hosts down")


def _close_all() -> None:
    for lan in list(_live):
        lan.close()


def pytest_configure(config) -> None:
    signal.signal(signal.SIGTERM, _on_sigterm)
    atexit.register(_close_all)


def pytest_collection_modifyitems(config, items) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.multihost)


@pytest.fixture(scope="session")
def namespaces_available() -> None:
    reason = why_unavailable()
    if reason is not None:
        pytest.fail(f"multihost: {reason}", pytrace=False)


@pytest.fixture
def make_hosts(namespaces_available):
    """``make_hosts(n)`` -> a started ``HostLAN`` of ``n`` hosts, removed after the test whatever happens."""
    made: list[HostLAN] = []

    def make(n: int) -> HostLAN:
        lan = HostLAN(n)
        made.append(lan)
        _live.add(lan)
        return lan.start()

    try:
        yield make
    finally:
        for lan in made:
            lan.close()

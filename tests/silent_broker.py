"""A broker that does not answer, for the bounded-wait tests: a loopback port nothing listens on, and a call run
on a helper thread that the test joins with a generous bound (the unbounded code never returned at all)."""
from __future__ import annotations

import socket
import threading

GENEROUS_S = 90  # the bounds under test are 1-5 s; the old code waited forever
KNOWN_VERSION = {"api_version": "3.9"}  # as a client that already talked to the brokers: no probe at start


def dead_bootstrap() -> str:
    """``127.0.0.1:PORT`` of a port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def finishes(call, within_s: float = GENEROUS_S):
    """(finished, result or exception) of ``call()`` within ``within_s``."""
    out: list = []

    def run():
        try:
            out.append(call())
        except BaseException as err:  # noqa: BLE001
            out.append(err)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(within_s)
    return (not t.is_alive()), (out[0] if out else None)

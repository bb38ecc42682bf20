"""Issue 28 item 15, the supervisor of `flowtrain stream`: a stop request is honoured whatever its
live report waits on (brokers that do not answer), and a child that does not stop within the grace
period is killed with its process group and everything it started, and named."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.procs import descendants, still_running

_PARENT = """
import sys, time
from flowtrain.local.processes import supervise

def report():  # a live line whose Kafka lookups never return (a stopped broker)
    time.sleep(3600)

codes = supervise({"stubborn": (["sh", "-c", "trap '' INT; setsid sleep 600 & sleep 600"], sys.argv[1]),
                   "polite": (["sleep", "600"], sys.argv[1])},
                  report=report, every_s=0.2, grace_s=2.0, what="test")
print("supervise returned", sorted(codes.items()), flush=True)
"""


def _ignore_sigint() -> None:  # what a script's `flowtrain stream ... &` gets: SIGINT ignored, inherited
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("background", [False, True], ids=["foreground", "sigint-ignored-background-job"])
def test_item15_a_stop_is_not_held_by_the_report_and_a_stubborn_child_is_killed_and_named(tmp_path, background):
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, str(tmp_path / "children.log")], cwd=Path.cwd(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                              preexec_fn=_ignore_sigint if background else None)
    tree: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(tree) < 4:  # sh, its two sleeps, the polite sleep
            time.sleep(0.05)
            tree = descendants(parent.pid)
        assert len(tree) >= 4, f"children not started: {tree}"
        time.sleep(0.5)  # a report is under way (and never ends)
        os.kill(parent.pid, signal.SIGTERM)
        try:
            output, _ = parent.communicate(timeout=30)  # the grace period is 2 s
        except subprocess.TimeoutExpired:
            raise AssertionError("supervise did not return 30 s after SIGTERM (grace period 2 s)") from None
        assert "test: stopping (SIGTERM received): SIGINT to stubborn, polite" in output, output
        assert "test: stubborn did not stop within 2 s of SIGINT; killed (SIGKILL)" in output, output
        assert "polite did not stop" not in output, output
        assert "supervise returned [('polite', -2), ('stubborn', -9)]" in output, output
        time.sleep(0.5)
        # the sleep in a session of its own (as a runner may be) went too
        assert not still_running(tree), f"left running: {still_running(tree)}"
    finally:
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)
            parent.wait(timeout=10)
        for pid in still_running(tree):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

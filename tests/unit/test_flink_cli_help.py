"""Issue 29 item 9: each `flowtrain flink` action has its own help, listing only the options it takes."""
from __future__ import annotations

import pytest

from flowtrain.cli.main import build_parser


def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["flink", *argv, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def test_item9_each_flink_action_has_its_own_help(capsys):
    start, stop, status = (_help(capsys, action) for action in ("start", "stop", "status"))
    assert start.startswith("usage: flowtrain flink start") and stop.startswith("usage: flowtrain flink stop")
    assert status.startswith("usage: flowtrain flink status")
    for option in ("--taskmanagers", "--slots", "--bind", "--taskmanager-of", "--rest-port", "--job-port",
                   "--expose-job-server", "--task-heap-mb", "--data-dir", "--timeout"):
        assert option in start, option
    for option in ("--taskmanagers", "--bind", "--rest-port", "--json", "--task-heap-mb"):
        assert option not in stop, option
    assert "--data-dir" in stop and "--timeout" in stop
    for option in ("--taskmanagers", "--bind", "--rest-port", "--timeout", "--task-heap-mb"):
        assert option not in status, option
    assert "--data-dir" in status and "--json" in status
    whole = _help(capsys)
    assert all(action in whole for action in ("start", "stop", "status")) and "--taskmanagers" not in whole


def test_item9_flink_options_of_another_action_are_refused(capsys):
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["flink", "status", "--taskmanagers", "3"])
    assert done.value.code == 2
    assert "--taskmanagers" in capsys.readouterr().err

"""The stream job's halves (``flowtrain stream pipeline|train|score``, in-process through ``flowtrain.stream(...)`` or
the CLI's ``main``) take SIGINT, SIGTERM and SIGHUP as a stop request while they run, and give the caller's handlers
back when they return or raise: they left theirs installed, so a program (or pytest) that called one lost Ctrl-C
for good. The halves' real work is faked here (what is tested is the signal handling around it)."""
from __future__ import annotations

import os
import signal

import pytest

import flowtrain.commands.stream.pipeline as stream_pipeline
import flowtrain.commands.stream.score as score
import flowtrain.commands.stream.train as stream_train
from flowtrain.commands.stream import job as stream_job

STOP = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _stopped_by(sig):
    """A half's run function: a stop signal to this process must reach it as ``should_stop()``."""
    seen = {}

    def run(*_args, should_stop, **_kwargs):
        assert not should_stop()
        # installed (else the signal's default action would end pytest's process)
        assert signal.getsignal(sig) not in (signal.SIG_DFL, signal.SIG_IGN, signal.default_int_handler)
        os.kill(os.getpid(), sig)  # delivered to the main thread before kill returns
        seen["stopped"] = should_stop()
        return 0

    return run, seen


@pytest.mark.parametrize("sig", STOP, ids=lambda s: signal.Signals(s).name)
@pytest.mark.parametrize("half", ["pipeline", "score", "train"])
def test_a_stop_signal_stops_the_half_and_the_callers_handlers_come_back(monkeypatch, half, sig):
    before = {s: signal.getsignal(s) for s in STOP}
    run, seen = _stopped_by(sig)
    if half == "pipeline":
        monkeypatch.setattr(stream_pipeline, "run_stream_pipeline", run)
        assert stream_job._run_pipeline(object(), []) == 0
    elif half == "score":
        monkeypatch.setattr(score, "run_score", run)
        assert stream_job._run_scorer(object(), []) == 0
    else:
        def train(job, given, should_stop):
            run(should_stop=should_stop)
            return None  # no summary to print

        monkeypatch.setattr(stream_train, "run_stream_train", train)
        assert stream_job._run_trainer(object(), ()) == 0
    assert seen == {"stopped": True}
    assert {s: signal.getsignal(s) for s in STOP} == before


def test_the_trainers_handlers_come_back_when_it_refuses_its_options(monkeypatch, capsys):
    before = {s: signal.getsignal(s) for s in STOP}

    def clash(job, given, should_stop):
        raise ValueError("--hidden 64 (the run has 32,16)")

    monkeypatch.setattr(stream_train, "run_stream_train", clash)
    assert stream_job._run_trainer(object(), ()) == 2
    assert "--hidden 64 (the run has 32,16)" in capsys.readouterr().err
    assert {s: signal.getsignal(s) for s in STOP} == before

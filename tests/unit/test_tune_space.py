"""``flowtrain tune``'s search space (issue 46 item 3): the ``--search`` text and YAML forms, their checks against
``flowtrain batch``'s options, the default space, and the flags a trial's sampled parameters become."""
from __future__ import annotations

import pytest

from connectors.fields import OptionError
from flowtrain.commands.tune.options import TuneJob
from flowtrain.commands.tune.space import Dimension, default_space, parse_space, trial_flags


def test_the_text_form_gives_ranges_logs_integers_and_choices():
    space = parse_space("lr=1e-4:1e-1:log, width=16:256:int:log,dropout=0:0.5,ensemble=1|4|8")
    assert space == [Dimension("lr", 1e-4, 1e-1, log=True), Dimension("width", 16, 256, log=True, integer=True),
                     Dimension("dropout", 0, 0.5), Dimension("ensemble", choices=(1, 4, 8))]
    assert [d.text() for d in space] == ["0.0001:0.1:log", "16:256:log:int", "0:0.5", "1|4|8"]


def test_a_yaml_file_gives_the_same_space(tmp_path):
    path = tmp_path / "space.yaml"
    path.write_text("lr: 1e-4:1e-1:log\nwidth: {low: 16, high: 256, log: true, int: true}\nensemble: [1, 4, 8]\n")
    assert parse_space(str(path)) == parse_space("lr=1e-4:1e-1:log,width=16:256:int:log,ensemble=1|4|8")


@pytest.mark.parametrize("search, message", [
    ("learning_rate=1e-4:1e-1", "'learning_rate' is not a flowtrain batch option to search (did you mean lr?)"),
    ("lr=0.1:0.01", "LOW < HIGH"),
    ("lr=0:1:log", "LOW < HIGH (both > 0 with log)"),
    ("dropout=0:1.5", "dropout: dropout (--dropout)"),
    ("lr", "expected name=LOW:HIGH"),
    ("lr=1e-3:1e-2,lr=1e-4:1e-3", "a name is given twice (lr)"),
    ("out=a|b", "'out' is not a flowtrain batch option to search"),
])
def test_a_bad_space_is_one_line_naming_it(search, message):
    with pytest.raises(OptionError) as err:
        parse_space(search)
    assert message in str(err.value)


def test_the_default_space_and_the_flags_of_a_trial():
    names = [d.name for d in default_space("binary")]
    assert names == ["lr", "width", "depth", "dropout", "weight_decay", "numeric_embedding", "frequency_scale",
                     "ensemble"]
    flags = trial_flags({"lr": 0.0123456789, "width": 64, "depth": 3, "ensemble": 4, "weight_decay": 1e-5})
    assert flags == ["--hidden", "64,64,64", "--lr", "0.0123457", "--ensemble", "4", "--weight-decay", "1e-05"]


def test_the_tune_job_takes_the_batch_options_and_its_own():
    job = TuneJob(trials=3, parallel=2, search="lr=1e-3:1e-2:log", label="y", lr=0.01)
    assert job.trials == 3 and job.label == "y" and job.heartbeat == 5 and job.mlflow is None

"""Options once: every field of a command's config dataclass is a flag, a --config key and a config.json key,
with a documented default; config.json is a valid --config; --print-config prints the effective options."""
from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import flowtrain
from connectors.fields import OptionError, build, options_of, to_config
from connectors.sections import to_sections
from flowtrain.cli.main import build_parser
from flowtrain.cli.options import load_config
from flowtrain.commands.batch.job import BatchJob
from flowtrain.commands.batch.options import ExportJob
from flowtrain.commands.predict.job import PredictJob
from flowtrain.commands.stream.options import ReplayJob, StreamJob

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = {"batch": BatchJob, "predict": PredictJob, "export": ExportJob, "replay": ReplayJob, "stream": StreamJob}


def _sub(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def _sample(opt):
    """A valid value of the option as YAML would give it."""
    if opt.choices:
        return opt.choices[-1]
    if opt.parse is None:
        return True
    if opt.default not in (None, ()):
        return list(opt.default) if isinstance(opt.default, tuple) else opt.default
    name = getattr(opt.parse, "__name__", "")
    if "whole" in name:
        return 2
    if "number" in name:
        return 0.5
    if name == "comma-separated names":
        return ["a", "b"]
    if name == "key-value pairs":
        return ["client_id=a"]
    if name == "column ranges":
        return ["a=0:1"]
    if name == "preset_name":  # --preset: a registered dataset preset (checked with the options)
        return "flights"
    if name == "KEY:COLUMN:AGGS:WINDOWS":  # --aggregate: a declaration (pipelines.features.declare)
        return ["card:amount:sum,mean:1h,1d"]
    if name == "TABLE:KEY[:VALID_FROM]":  # --join
        return ["merchants.parquet:merchant:valid_from"]
    if name == "balanced or CLASS=W,...":  # --class-weight
        return "balanced"
    return "text"


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_field_has_a_flag_a_yaml_key_and_a_documented_default(command, tmp_path):
    cls, sub = COMMANDS[command], _sub(command)
    actions = {a.dest: a for a in sub._actions if a.option_strings}
    fields = options_of(cls)
    assert {f.name for f in dataclasses.fields(cls)} == {o.name for o in fields}  # every field is an option
    for opt in fields:
        action = actions.get(opt.name)
        assert action is not None and f"--{opt.name.replace('_', '-')}" in action.option_strings, opt.name
        if opt.parse is None:
            assert isinstance(action, argparse._StoreTrueAction) and opt.default is False, opt.name
        else:
            assert "default" in action.help.lower(), (opt.name, action.help)
            shown = "none" if opt.default in (None, ()) else None
            if shown:
                assert "none" in action.help or "default" in opt.help.lower(), (opt.name, action.help)
        assert opt.help.strip(), opt.name
    values = {opt.name: _sample(opt) for opt in fields}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({k.replace("_", "-"): v for k, v in values.items()}))
    loaded = load_config(tmp_path / "c.yaml", sub)
    assert set(loaded) == set(values)  # every key is accepted, none dropped
    config = build(cls, loaded)
    assert set(to_config(config)) == set(values)


def test_the_engine_configs_are_the_commands_options_declared_once():
    """Issue 30 item 2: the trainers' options are declared once (flowtrain.train.options); the commands compose
    them and the engine configs are them. What else an engine config holds is not a command option: the dataset's
    directory, and the Kafka settings and topics the streaming engines are given resolved (a KafkaTarget and Topics,
    issue 48). The feature pipeline's options are declared in pipelines.stream.options."""
    from flowtrain.commands.stream.options import StreamPipelineJob, StreamTrainJob
    from flowtrain.train.options import (
        EngineSettings,
        ParallelOptions,
        StreamTrainOptions,
        TrainOptions,
        UpdateOptions,
    )
    from flowtrain.train.plan import TrainConfig
    from flowtrain.train.stream.config import StreamTrainConfig
    from pipelines.stream.options import EventOptions, ParseBounds, PipelineOptions
    from pipelines.stream.pipeline import StreamConfig

    # both trainers' engines read one ParallelOptions (the stream trainer's are the batch run's, not a copy) and
    # the run's EngineSettings
    assert issubclass(StreamTrainOptions, ParallelOptions)
    assert all(issubclass(engine, EngineSettings) for engine in (TrainConfig, StreamTrainConfig))
    for sets, command, engine in (((TrainOptions, ParallelOptions), BatchJob, TrainConfig),
                                  ((StreamTrainOptions, UpdateOptions), StreamTrainJob, StreamTrainConfig)):
        assert all(issubclass(command, s) and issubclass(engine, s) for s in sets), engine
        assert {o.name for o in options_of(engine)} == {o.name for s in sets for o in options_of(s)}, engine
    batch_engine_only = {f.name for f in dataclasses.fields(TrainConfig)} - {o.name for o in options_of(TrainConfig)}
    assert batch_engine_only == {"log_every", "init_wide", "stage_bounds"}  # --weight-decay is an option (#46)
    assert not batch_engine_only & {f.name for f in dataclasses.fields(BatchJob)}
    # what the commands resolve from their Kafka and topic options is a KafkaTarget and Topics (connectors.kafka.target),
    # never a field of an option's name (tests/unit/test_options_declared_once.py checks every engine config)
    stream_engine_only = ({f.name for f in dataclasses.fields(StreamTrainConfig)}
                          - {o.name for o in options_of(StreamTrainConfig)})
    assert stream_engine_only == {"kafka", "topics", "run_dir", "dataset_dir", "stage_bounds", "max_source_gap",
                                  "max_steps"}
    assert not stream_engine_only & {f.name for f in dataclasses.fields(StreamTrainJob)}
    sets = (PipelineOptions, EventOptions)
    assert all(issubclass(StreamPipelineJob, s) and issubclass(StreamConfig, s) for s in sets)
    assert issubclass(EventOptions, ParseBounds)
    assert {o.name for o in options_of(StreamConfig)} == {o.name for s in sets for o in options_of(s)}
    pipeline_engine_only = ({f.name for f in dataclasses.fields(StreamConfig)}
                            - {o.name for o in options_of(StreamConfig)})
    assert {"kafka", "topics"} <= pipeline_engine_only
    assert not pipeline_engine_only & {f.name for f in dataclasses.fields(StreamPipelineJob)}
    # what the command resolves keeps no default of its own
    assert all(f.default is dataclasses.MISSING for f in dataclasses.fields(StreamConfig) if f.name in ("kafka", "topics"))
    from flowtrain.commands.stream.options import StreamScoreJob
    from pipelines.serving.config import ScoreConfig
    from pipelines.serving.options import ScorerOptions

    sets = (ScorerOptions, EventOptions)
    assert all(issubclass(StreamScoreJob, s) and issubclass(ScoreConfig, s) for s in sets)
    assert {o.name for o in options_of(ScoreConfig)} == {o.name for s in sets for o in options_of(s)}
    score_engine_only = {f.name for f in dataclasses.fields(ScoreConfig)} - {o.name for o in options_of(ScoreConfig)}
    assert {"kafka", "topics"} <= score_engine_only
    assert not score_engine_only & {f.name for f in dataclasses.fields(StreamScoreJob)}


def test_the_online_trainers_config_crosses_to_its_workers_as_json_and_back():
    """``flowtrain stream train --workers N`` sends the engine config as JSON (``asdict``); the worker rebuilds it
    (``flowtrain.train.jobs``) and the trainer checks it: the same config, ranges checked once."""
    from connectors.fields import check
    from connectors.kafka import KafkaTarget, Topics
    from flowtrain.train.stream.config import StreamTrainConfig

    cfg = StreamTrainConfig(kafka=KafkaTarget("b:1", {"client_id": "x"}), topics=Topics(features="f"), run_dir="r",
                            dataset_dir="d", hidden=(8, 4), checkpoint_every=7, idle_exit=2.5)
    again = check(StreamTrainConfig(**json.loads(json.dumps(dataclasses.asdict(cfg)))))
    assert again == cfg and again.hidden == (8, 4)
    with pytest.raises(OptionError, match="checkpoint_every"):
        check(dataclasses.replace(cfg, checkpoint_every=0))


def test_config_json_is_a_valid_config_and_print_config_shows_the_effective_options(tmp_path):
    job = BatchJob(input=("a.csv", "b.csv"), label="y", numeric=("x1",), categorical=("c",), epochs=3,
                   hidden=(8, 4), lr=0.01, no_progress=True)
    (tmp_path / "config.json").write_text(json.dumps(to_config(job)))
    proc = subprocess.run([sys.executable, "-m", "flowtrain.cli", "batch", "--config", str(tmp_path / "config.json"),
                           "--print-config"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout) == to_sections(job)  # in their sections (tests/unit/test_config_sections.py)
    proc = subprocess.run([sys.executable, "-m", "flowtrain.cli", "batch", "--config", str(tmp_path / "config.json"),
                           "--lr", "0.5", "--print-config"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert yaml.safe_load(proc.stdout) == to_sections(dataclasses.replace(job, lr=0.5))  # the command line wins


def test_each_command_help_shows_its_own_options():
    batch, predict, export = (_sub(n).format_help() for n in ("batch", "predict", "export"))
    # predict's --id-column (the row's id) is not batch's; batch's --id-columns (ID tables) is another option
    assert "--epochs" in batch and "--id-column " not in batch and "--id-column]" not in batch
    assert "--id-column" in predict and "--epochs" not in predict and "--keep-columns" in predict
    assert "--out" in export and "--epochs" not in export and "--input" not in export


def test_the_api_checks_options_as_the_cli_does(tmp_path):
    with pytest.raises(OptionError, match=r"lr \(--lr\): must be a number > 0"):
        flowtrain.batch(lr=-1, out=str(tmp_path / "r"))
    with pytest.raises(OptionError, match="unknown option epoch \\(did you mean epochs\\?\\)"):
        flowtrain.batch(epoch=3)
    with pytest.raises(OptionError, match="schedule"):
        flowtrain.batch(schedule="zigzag")
    assert not (tmp_path / "r").exists()
    proc = subprocess.run([sys.executable, "-m", "flowtrain.cli", "--version"], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == f"flowtrain {flowtrain.__version__}"

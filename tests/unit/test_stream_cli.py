"""The streaming command line: no import cycle between its modules, options once (flags, --config, config.json,
--print-config from ``flowtrain.commands.stream``), each part's --help its own."""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from dataclasses import MISSING, fields
from pathlib import Path
from types import SimpleNamespace

import yaml

ROOT = Path(__file__).resolve().parents[2]
CLI = ROOT / "flowtrain" / "cli"


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every ``from X import names`` in the file, function-local ones included."""
    tree = ast.parse(path.read_text())
    return [(node.module or "", [a.name for a in node.names]) for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)]


def test_the_scorer_cli_does_not_import_the_stream_cli_and_nobody_imports_its_privates():
    score = _imports(CLI / "score.py")
    assert not [m for m, _ in score if m == "flowtrain.cli.stream"], "score.py imports flowtrain.cli.stream"
    for name in ("cli/stream.py", "cli/score.py", "cli/stream_status.py", "commands/stream_inputs.py"):
        private = [(m, n) for m, names in _imports(CLI.parent / name) for n in names
                   if m.startswith("flowtrain.") and n.startswith("_")]
        assert not private, f"{name} imports private names {private}"


def _help(*argv: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "flowtrain.cli", *argv, "--help"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _flags(text: str) -> set[str]:
    return set(re.findall(r"^  (--[a-z][a-z-]*)", text, re.MULTILINE))  # an option line, not its help


def test_each_part_of_the_stream_job_shows_its_own_options_and_the_whole_job_all():
    from flowtrain.commands.stream import HALVES, StreamJob
    from flowtrain.fields import options_of

    whole = _flags(_help("stream"))
    assert {o.flag for o in options_of(StreamJob)} <= whole
    shown = {}
    for half, cls in HALVES.items():
        text = _help("stream", half)
        assert text.startswith(f"usage: flowtrain stream {half} "), text[:80]
        shown[half] = _flags(text) - {"--help", "--config", "--print-config"}
        assert shown[half] == {o.flag for o in options_of(cls)}, half
    assert "--lr" in shown["train"] and "--lr" not in shown["pipeline"] and "--lr" not in shown["score"]
    assert "--batch-size" in shown["pipeline"] and "--batch-size" not in shown["train"]
    assert "--swap-interval" in shown["score"] and "--workers" not in shown["score"]
    assert "--runner" not in shown["train"] and "--score" not in set().union(*shown.values())
    assert set().union(*shown.values()) | {"--score"} == whole - {"--help", "--config", "--print-config"}


def test_stream_option_defaults_are_the_engines():
    from flowtrain.commands.stream import ReplayJob, StreamJob
    from flowtrain.parallel.launch import LaunchConfig
    from flowtrain.train.stream import StreamTrainConfig
    from pipelines.serving.config import ScoreConfig
    from pipelines.stream.events import ParseBounds
    from pipelines.stream.pipeline import StreamConfig

    def defaults(cls):  # the dataclass's field defaults (some fields have none)
        return SimpleNamespace(**{f.name: f.default if f.default is not MISSING else f.default_factory()
                                  for f in fields(cls) if f.default is not MISSING or f.default_factory is not MISSING})

    job = StreamJob()
    pipe, bounds, train, launch, score = map(defaults, (StreamConfig, ParseBounds, StreamTrainConfig, LaunchConfig,
                                                        ScoreConfig))
    pairs = {
        "connect_timeout": pipe.connect_timeout_s, "raw_topic": pipe.raw_topic, "features_topic": pipe.features_topic,
        "dead_letter_topic": pipe.dead_letter_topic, "group_id": pipe.group_id, "batch_size": pipe.batch_size,
        "max_delay": pipe.max_delay_s, "read_batch_records": pipe.read_batch_records, "read_client": pipe.read_client,
        "max_event_bytes": bounds.max_event_bytes, "max_json_depth": bounds.max_depth,
        "max_abs_number": bounds.max_abs_number, "updates_topic": train.updates_topic, "hidden": tuple(train.hidden),
        "dropout": train.dropout, "seed": train.seed, "lr": train.lr, "device": train.device, "threads": train.threads,
        "checkpoint_every": train.checkpoint_every_steps, "checkpoint_seconds": train.checkpoint_every_s,
        "max_decoded_bytes": train.max_decoded_bytes, "idle_exit": train.idle_exit_s,
        "keep_published": train.keep_published, "workers": launch.workers, "failure_timeout": launch.failure_timeout_s,
        "predictions_topic": score.predictions_topic, "score_dead_letter_topic": score.dead_letter_topic,
        "score_group_id": score.group_id, "swap_interval": score.swap_interval_s, "score_batch_size": score.batch_size,
        "score_max_delay": score.max_delay_s, "keep_models": score.keep_models,
        "max_model_bytes": score.max_model_bytes}
    assert {k: getattr(job, k) for k in pairs} == pairs
    assert ReplayJob().topic == pipe.raw_topic
    from connectors.kafka import CLIENTS

    assert StreamJob().read_client == ReplayJob().client == CLIENTS[0]


def test_a_parts_config_json_is_its_options_and_a_valid_config(tmp_path):
    """`stream pipeline` writes <out>/config.json (before it needs a broker); fed back with --config,
    --print-config shows the same options; a whole job's --config is valid for a part."""
    out = tmp_path / "run"
    cli = [sys.executable, "-m", "flowtrain.cli", "stream"]
    proc = subprocess.run(cli + ["pipeline", "--bootstrap", "127.0.0.1:9", "--connect-timeout", "0.5", "--out",
                                 str(out), "--batch-size", "7", "--kafka-config", "sasl_plain_password=hush",
                                 "--runner", "prism"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode != 0 and "no Kafka broker answered at 127.0.0.1:9" in proc.stderr, proc.stderr
    written = json.loads((out / "config.json").read_text())
    from flowtrain.commands.stream import StreamPipelineJob
    from flowtrain.fields import options_of

    assert set(written) == {o.name for o in options_of(StreamPipelineJob)}
    assert written["batch_size"] == 7 and written["runner"] == "prism" and "hush" not in json.dumps(written)
    written["kafka_config"] = []  # the redacted secret is not a value to feed back
    (tmp_path / "c.json").write_text(json.dumps(written))
    shown = subprocess.run(cli + ["pipeline", "--config", str(tmp_path / "c.json"), "--print-config"],
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert shown.returncode == 0, shown.stderr
    assert yaml.safe_load(shown.stdout) == written
    whole = subprocess.run(cli + ["--lr", "0.5", "--score", "--print-config"], capture_output=True, text=True,
                           timeout=120, cwd=ROOT)
    assert whole.returncode == 0, whole.stderr
    (tmp_path / "whole.yaml").write_text(whole.stdout)
    part = subprocess.run(cli + ["train", "--config", str(tmp_path / "whole.yaml"), "--print-config"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert part.returncode == 0, part.stderr
    config = yaml.safe_load(part.stdout)
    assert config["lr"] == 0.5 and "score" not in config and "batch_size" not in config


def test_bad_stream_options_are_one_line_errors_naming_them():
    cli = [sys.executable, "-m", "flowtrain.cli"]
    for argv, flag in ((["stream", "score", "--swap-interval", "0"], "--swap-interval"),
                       (["stream", "train", "--hidden", "8,x"], "--hidden"),
                       (["replay", "--client", "other"], "--client")):
        proc = subprocess.run(cli + argv, capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert proc.returncode == 2 and flag in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_the_trainer_job_maps_every_option_onto_the_engines_config(tmp_path):
    from flowtrain.commands.stream import StreamTrainJob
    from flowtrain.commands.stream_train import stream_train_config
    from flowtrain.fields import build

    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "_manifest.json").write_text("{}")
    job = build(StreamTrainJob, {"dataset": str(tmp_path / "ds"), "out": str(tmp_path / "run"), "lr": 0.5,
                                 "checkpoint-every": 7, "checkpoint_seconds": 3, "idle_exit": 9, "hidden": "8,4",
                                 "kafka_config": ["sasl_plain_password=pa,ss", "client_id=t"],
                                 "keep_published": 2, "threads": 2, "features_topic": "f"})
    cfg = stream_train_config(job)
    assert (cfg.lr, cfg.checkpoint_every_steps, cfg.checkpoint_every_s, cfg.idle_exit_s, tuple(cfg.hidden)) == (
        0.5, 7, 3.0, 9.0, (8, 4))
    assert (cfg.keep_published, cfg.threads, cfg.features_topic, cfg.run_dir) == (2, 2, "f", str(tmp_path / "run"))
    assert cfg.kafka_config == {"sasl_plain_password": "pa,ss", "client_id": "t"}  # commas stay in a value
    assert cfg.dataset == str((tmp_path / "ds").resolve())

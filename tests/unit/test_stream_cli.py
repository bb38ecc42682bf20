"""The streaming command line: no import cycle between its modules, options once (flags, --config, config.json,
--print-config from ``flowtrain.commands.stream.options``), each part's --help its own."""
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

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CLI = ROOT / "flowtrain" / "cli"


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every ``from X import names`` in the file, function-local ones included."""
    tree = ast.parse(path.read_text())
    return [(node.module or "", [a.name for a in node.names]) for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)]


def test_the_stream_job_does_not_import_the_cli_and_nobody_imports_its_privates():
    for name in ("commands/stream/job.py", "commands/stream/status.py", "commands/stream/replay.py"):
        assert not [m for m, _ in _imports(CLI.parent / name) if m.startswith("flowtrain.cli")], name
    for name in ("cli/stream.py", "commands/stream/job.py", "commands/stream/status.py", "commands/stream/replay.py",
                 "commands/stream/inputs.py"):
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
    from connectors.fields import options_of
    from flowtrain.commands.stream.options import HALVES, StreamJob

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
    """The engine configs are their options (the feature pipeline's ``StreamConfig``: ``pipelines.stream.options``;
    the scorer's ``ScoreConfig``: ``pipelines.serving.options``; the online trainer's: ``StreamTrainOptions``):
    what the command resolves for them (brokers, topics, the consumer group, the connect timeout) has no engine
    default to keep in step."""
    from flowtrain.commands.stream.options import ReplayJob, StreamJob
    from pipelines.serving.config import ScoreConfig
    from pipelines.stream.pipeline import StreamConfig

    def defaults(cls):  # the dataclass's field defaults (some fields have none)
        return SimpleNamespace(**{f.name: f.default if f.default is not MISSING else f.default_factory()
                                  for f in fields(cls) if f.default is not MISSING or f.default_factory is not MISSING})

    from flowtrain.commands.stream.options import with_dataset_topics
    from pipelines.presets import default_preset

    job = with_dataset_topics(StreamJob())  # topics: the dataset's, the flights demo's without --dataset
    pipe, score = map(defaults, (StreamConfig, ScoreConfig))
    # the topics have no engine defaults (issue 30 item 3): the command names them after the dataset, the
    # demo's without --dataset (flights-raw, flights-features, ...: its preset's name); nor have the group and
    # the connect timeout the command gives the pipeline
    for cfg in (pipe, score):
        assert not {"raw_topic", "features_topic", "dead_letter_topic", "predictions_topic", "group_id",
                    "connect_timeout", "bootstrap"} & set(vars(cfg))
    name = default_preset().name
    assert (job.raw_topic, job.features_topic, job.dead_letter_topic, job.updates_topic, job.predictions_topic,
            job.score_dead_letter_topic) == tuple(f"{name}-{suffix}" for suffix in (
                "raw", "features", "dead-letters", "model-updates", "predictions", "scoring-dead-letters"))
    assert with_dataset_topics(ReplayJob()).topic == job.raw_topic
    from connectors.kafka import CLIENTS

    assert StreamJob().read_client == ReplayJob().client == CLIENTS[0]


def _printed(capsys, *argv) -> str:
    """What ``flowtrain ARGV --print-config`` prints, run in this process (a process per call cost the fast lane
    seconds each; the command line's own process is tested by the broker-less run above and --help)."""
    from flowtrain.cli import main

    capsys.readouterr()
    assert main([*argv, "--print-config"]) == 0
    return capsys.readouterr().out


def test_a_parts_config_json_is_its_options_and_a_valid_config(tmp_path, capsys):
    """`stream pipeline` writes <out>/config.json (before it needs a broker); fed back with --config,
    --print-config shows the same options; a whole job's --config is valid for a part."""
    out = tmp_path / "run"
    cli = [sys.executable, "-m", "flowtrain.cli", "stream"]
    proc = subprocess.run(cli + ["pipeline", "--bootstrap", "127.0.0.1:9", "--connect-timeout", "0.5", "--out",
                                 str(out), "--batch-size", "7", "--kafka-config", "sasl_plain_password=hush",
                                 "--runner", "prism"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode != 0 and "no Kafka broker answered at 127.0.0.1:9" in proc.stderr, proc.stderr
    written = json.loads((out / "config.json").read_text())
    from connectors.fields import options_of
    from connectors.sections import flat_config
    from flowtrain.commands.stream.options import StreamPipelineJob, StreamTrainJob

    assert set(written) == {o.name for o in options_of(StreamPipelineJob)}
    assert written["batch_size"] == 7 and written["runner"] == "prism" and "hush" not in json.dumps(written)
    written["kafka_config"] = []  # the redacted secret is not a value to feed back
    (tmp_path / "c.json").write_text(json.dumps(written))
    printed = yaml.safe_load(_printed(capsys, "stream", "pipeline", "--config", str(tmp_path / "c.json")))
    assert flat_config(printed, StreamPipelineJob) == written  # printed in sections, the same options
    (tmp_path / "whole.yaml").write_text(_printed(capsys, "stream", "--lr", "0.5", "--score"))
    config = flat_config(yaml.safe_load(_printed(capsys, "stream", "train", "--config", str(tmp_path / "whole.yaml"))),
                         StreamTrainJob)
    assert config["lr"] == 0.5 and "score" not in config and "batch_size" not in config


def test_bad_stream_options_are_one_line_errors_naming_them():
    cli = [sys.executable, "-m", "flowtrain.cli"]
    for argv, flag in ((["stream", "score", "--swap-interval", "0"], "--swap-interval"),
                       (["stream", "train", "--hidden", "8,x"], "--hidden"),
                       (["replay", "--client", "other"], "--client")):
        proc = subprocess.run(cli + argv, capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert proc.returncode == 2 and flag in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_the_trainer_job_maps_every_option_onto_the_engines_config(tmp_path):
    from connectors.fields import build
    from flowtrain.commands.stream.options import StreamTrainJob
    from flowtrain.commands.stream.train import stream_train_config

    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "_manifest.json").write_text("{}")
    job = build(StreamTrainJob, {"dataset": str(tmp_path / "ds"), "out": str(tmp_path / "run"), "lr": 0.5,
                                 "checkpoint-every": 7, "checkpoint_seconds": 3, "idle_exit": 9, "hidden": "8,4",
                                 "kafka_config": ["sasl_plain_password=pa,ss", "client_id=t"],
                                 "keep_published": 2, "threads": 2, "features_topic": "f"})
    cfg = stream_train_config(job)
    assert (cfg.lr, cfg.checkpoint_every, cfg.checkpoint_seconds, cfg.idle_exit, tuple(cfg.hidden)) == (
        0.5, 7, 3.0, 9.0, (8, 4))
    assert (cfg.keep_published, cfg.threads, cfg.topics.features, cfg.run_dir) == (2, 2, "f", str(tmp_path / "run"))
    assert cfg.kafka.config == {"sasl_plain_password": "pa,ss", "client_id": "t"}  # commas stay in a value
    assert cfg.dataset_dir == str((tmp_path / "ds").resolve())


def test_topic_defaults_follow_the_dataset_and_the_flights_demo_keeps_flights_topics(tmp_path, capsys):
    """Topics left unset are named after --dataset (NAME-raw, NAME-features, ...), in every part, replay and the
    whole job alike; a given topic stays; the flights demo's dataset (and no --dataset) gives flights-*."""
    manifest = {"format": "flowtrain.dataset/1", "spec": {"label": "y"}, "stats": {}}
    (tmp_path / "sensors" / "dataset").mkdir(parents=True)
    (tmp_path / "sensors" / "dataset" / "_manifest.json").write_text(json.dumps(manifest))
    (tmp_path / "demo" / "dataset").mkdir(parents=True)
    (tmp_path / "demo" / "dataset" / "_manifest.json").write_text(json.dumps(
        {**manifest, "spec": {"label": "arr_delay"}, "inputs": {"flights": "f", "weather": "w", "planes": "p"}}))
    roles = {"raw_topic": "raw", "features_topic": "features", "dead_letter_topic": "dead-letters",
             "updates_topic": "model-updates", "predictions_topic": "predictions",
             "score_dead_letter_topic": "scoring-dead-letters"}

    def shown(*argv):  # the printed options, flat (printed in their sections)
        from connectors.sections import flat_config
        from flowtrain.commands.stream.options import ReplayJob, StreamJob

        return flat_config(yaml.safe_load(_printed(capsys, *argv)), ReplayJob if argv[0] == "replay" else StreamJob)

    sensors = str(tmp_path / "sensors" / "dataset")
    assert {k: v for k, v in shown("stream", "--dataset", sensors).items() if k in roles} == {
        k: f"sensors-{suffix}" for k, suffix in roles.items()}
    train = shown("stream", "train", "--dataset", sensors, "--features-topic", "mine")
    assert (train["features_topic"], train["updates_topic"]) == ("mine", "sensors-model-updates")
    assert shown("stream", "score", "--dataset", sensors)["predictions_topic"] == "sensors-predictions"
    assert shown("replay", "--input", "t.csv", "--dataset", sensors)["topic"] == "sensors-raw"
    flights = shown("stream", "--dataset", str(tmp_path / "demo" / "dataset"))
    assert {k: v for k, v in flights.items() if k in roles} == {k: f"flights-{s}" for k, s in roles.items()}
    assert shown("replay")["topic"] == "flights-raw"
    from connectors.fields import build
    from flowtrain.commands.stream.options import StreamTrainJob
    from flowtrain.commands.stream.train import stream_train_config

    cfg = stream_train_config(build(StreamTrainJob, {"dataset": sensors}))  # the Python API names them too
    assert (cfg.topics.features, cfg.topics.updates, cfg.topics.raw) == ("sensors-features", "sensors-model-updates",
                                                                      "sensors-raw")


@pytest.mark.kafka
@pytest.mark.timeout(120)
def test_dead_letters_are_counted_by_kind_not_by_message(bootstrap, new_topic, tmp_path):
    """Broken JSON at different positions is one kind on the status page ("broken JSON"), not one row per
    "Expecting ',' delimiter: line 1 column N" message; each dead letter keeps its whole message."""
    from types import SimpleNamespace

    from connectors.dataset_spec import FeatureSpec
    from connectors.deadletter import reason_kind
    from connectors.kafka import close_client, dead_letter_record, new_producer
    from flowtrain.commands.stream.status import StreamSampler
    from pipelines.stream.events import event_schema, parse_event

    schema = event_schema(FeatureSpec(label="y", task="regression", numeric=["x"], categorical=["c"]))
    payloads = [b'{"x": 1 "c": "a"}', b'{"x": 1, "c": "a", "y" 2}', b'{"x": 1,, "c": "a"}', b'[1, 2]',
                b'{"c": "a"}', b'{"x": "one", "c": "a"}', b'{"x": "two", "c": "b"}']
    letters = [parse_event(p, f"raw/0/{i}", schema) for i, p in enumerate(payloads)]
    reasons = [letter.reason for letter in letters]
    assert len(set(reasons[:3])) == 3 and all(r.startswith("broken JSON: Expecting") for r in reasons[:3])
    assert [reason_kind(r) for r in reasons] == ["broken JSON"] * 4 + ["missing field(s)"] + [
        "wrong type: field 'x'"] * 2
    dead, updates = new_topic(1), new_topic(1)
    producer = new_producer(bootstrap, {})
    try:
        for letter in letters:
            key, value, headers = dead_letter_record(letter)
            producer.send(dead, value=value, key=key, headers=headers)
        producer.flush(30)
    finally:
        close_client(producer)
    args = SimpleNamespace(out=str(tmp_path), kafka_config=(), kafka_config_file=None, bootstrap=bootstrap,
                           dead_letter_topic=dead, updates_topic=updates, update_key_file=None)
    sampler = StreamSampler(args, lambda: {})
    snap: dict = {"counters": {}}
    try:
        for _ in range(100):
            sampler._kafka(snap)
            if sum(snap["dead_letters_by_reason"].values()) >= len(letters):
                break
    finally:
        sampler.letters.close()
        sampler.updates.close()
    assert snap["dead_letters_by_reason"] == {"broken JSON": 4, "missing field(s)": 1, "wrong type: field 'x'": 2}
    assert sorted(d["reason"] for d in snap["dead_letters"]) == sorted(reasons)  # the whole messages

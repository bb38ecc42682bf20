"""Issue 30 item 2, options in sections: ``--config`` takes each option set's section (``train: {lr: 0.01}``,
``score: {batch_size: 64}`` for ``score_batch_size``) as well as the flat names, mixed; the same job either way;
``--print-config`` prints the sections and is a valid ``--config``; ``config.json`` stays flat and loads as
before; a misplaced key is one line naming the key, the file and the right place. In process: no broker, no
runner (each command line is parsed as ``flowtrain`` parses it)."""
from __future__ import annotations

import json
import re

import pytest
import yaml

from connectors.fields import OptionError, build, options_of, to_config
from connectors.sections import flat_config, layout, to_sections
from flowtrain.cli.main import build_parser, main, parse
from flowtrain.cli.options import load_config
from flowtrain.cli.stream import job_of
from flowtrain.commands.batch.job import BatchJob
from flowtrain.commands.stream.options import HALVES, ReplayJob, StreamJob

#: Every topic given, so that no part looks for the dataset to name them.
TOPICS = {"raw_topic": "r", "features_topic": "f", "dead_letter_topic": "d", "updates_topic": "u"}


def _write(tmp_path, name: str, values) -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(values, sort_keys=False))
    return str(path)


def _job(argv: list[str]):
    """The job ``flowtrain ARGV`` would run (as its command builds it from the parsed options)."""
    args, _ = parse(argv)
    return build(BatchJob, args.options) if argv[0] == "batch" else job_of(args)


def _printed(capsys, *argv: str) -> str:
    capsys.readouterr()
    assert main([*argv, "--print-config"]) == 0
    return capsys.readouterr().out


def _stream_parser():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sub.choices["stream"]


def test_batch_flat_nested_and_mixed_keys_make_the_same_job(tmp_path):
    flat = {"label": "y", "input": ["a.csv"], "lr": 0.01, "hidden": [8, 4], "epochs": 3, "workers": 2,
            "shard_states": "optimizer", "stages": 2}
    nested = {"label": "y", "input": ["a.csv"], "train": {"lr": 0.01, "hidden": [8, 4], "epochs": 3},
              "parallel": {"workers": 2, "shard_states": "optimizer", "stages": 2}}
    mixed = {"label": "y", "input": "a.csv", "lr": 0.01, "train": {"hidden": "8,4", "epochs": 3},
             "parallel": {"workers": 2, "stages": 2}, "shard-states": "optimizer"}
    jobs = [_job(["batch", "--config", _write(tmp_path, f"{n}.yaml", v)])
            for n, v in (("flat", flat), ("nested", nested), ("mixed", mixed))]
    assert jobs[0] == jobs[1] == jobs[2]
    assert (jobs[0].lr, jobs[0].hidden, jobs[0].workers, jobs[0].shard_states) == (0.01, (8, 4), 2, "optimizer")


@pytest.mark.parametrize("half", [None, "train", "score", "pipeline"])
def test_stream_flat_and_nested_keys_make_the_same_job_for_the_whole_job_and_each_part(half, tmp_path):
    flat = {**TOPICS, "out": str(tmp_path / "run"), "bootstrap": "b:1", "kafka_config_file": "c.properties",
            "lr": 0.5, "workers": 2, "stages": 2, "batch_size": 7, "max_event_bytes": 4096,
            "score_batch_size": 64, "score_group_id": "g", "predictions_topic": "p", "score_dead_letter_topic": "sd",
            "update_key_file": "key", "score": True}
    nested = {**TOPICS, "out": str(tmp_path / "run"),
              "kafka": {"bootstrap": "b:1", "config_file": "c.properties"},
              "trainer": {"lr": 0.5, "workers": 2}, "parallel": {"stages": 2}, "pipeline": {"batch_size": 7},
              "events": {"max_event_bytes": 4096}, "updates": {"update_key_file": "key"},
              "score": {"batch_size": 64, "group_id": "g", "predictions_topic": "p", "dead_letter_topic": "sd",
                        "score": True}}
    argv = ["stream", *([half] if half else [])]
    one = _job([*argv, "--config", _write(tmp_path, "flat.yaml", flat)])
    other = _job([*argv, "--config", _write(tmp_path, "nested.yaml", nested)])
    assert one == other and type(one) is (HALVES[half] if half else StreamJob)
    expected = {"lr": 0.5, "stages": 2, "batch_size": 7, "score_batch_size": 64, "score_group_id": "g",
                "score_dead_letter_topic": "sd", "bootstrap": "b:1", "update_key_file": "key"}
    assert {k: getattr(one, k) for k in expected if hasattr(one, k)} == {
        k: v for k, v in expected.items() if hasattr(one, k)}


def test_inside_its_section_an_option_drops_its_sections_name_or_keeps_it(tmp_path):
    sub = _stream_parser()
    short = load_config(_write(tmp_path, "a.yaml", {"score": {"batch_size": 64, "max-delay": 0.5},
                                                     "kafka": {"config": ["client_id=x"]}}), sub)
    full = load_config(_write(tmp_path, "b.yaml", {"score": {"score_batch_size": 64, "score_max_delay": 0.5},
                                                    "kafka": {"kafka_config": ["client_id=x"]}}), sub)
    assert short == full == {"score_batch_size": 64, "score_max_delay": 0.5, "kafka_config": ["client_id=x"]}
    # the feature pipeline's batch_size is another option, flat or in its own section
    assert load_config(_write(tmp_path, "c.yaml", {"pipeline": {"batch_size": 9}, "score_batch_size": 3}), sub) == {
        "batch_size": 9, "score_batch_size": 3}


@pytest.mark.parametrize("values, message", [
    ({"trainer": {"batch_size": 7}},
     "'trainer.batch_size' is not an option of section trainer (did you mean pipeline.batch_size or "
     "score.batch_size?)"),
    ({"trainer": {"lrr": 0.1}}, "'trainer.lrr' is not an option of section trainer (did you mean trainer.lr?)"),
    ({"pipeline": {"update_key_file": "k"}},
     "'pipeline.update_key_file' is not an option of section pipeline (did you mean updates.update_key_file?)"),
    ({"trainr": {"lr": 0.1}}, "unknown section 'trainr' (did you mean 'trainer'?)"),
    ({"score_batch_size": 64, "score": {"batch_size": 32}},
     "score_batch_size is given twice, as 'score_batch_size' and as 'score.batch_size'; keep one (score.batch_size)"),
    ({"score": {"batch_size": 32, "score_batch_size": 64}},
     "score_batch_size is given twice, as 'score.batch_size' and as 'score.score_batch_size'"),
    ({"trainer": 5}, "'trainer' is a section: give it a mapping of its options (trainer: {workers: ...})"),
])
def test_a_misplaced_key_is_one_line_naming_it_the_file_and_the_right_place(values, message, tmp_path):
    path = _write(tmp_path, "bad.yaml", values)
    with pytest.raises(OptionError, match=re.escape(f"--config {path}: {message}")):
        load_config(path, _stream_parser())


def test_a_misplaced_key_on_the_command_line_exits_2_with_one_line(tmp_path, capsys):
    path = _write(tmp_path, "bad.yaml", {"train": {"lr": 0.1, "batch_size": 7}})
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        main(["stream", "train", "--config", path, "--print-config"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"--config {path}: unknown section 'train' (did you mean 'trainer'?)" in err
    # a value is checked in its section as it is flat, naming where it was written
    path = _write(tmp_path, "range.yaml", {"trainer": {"lr": -1}})
    with pytest.raises(SystemExit):
        main(["stream", "--config", path, "--print-config"])
    assert f"--config {path}: trainer.lr: must be a number > 0" in capsys.readouterr().err
    # a flat key that is no option keeps its message
    path = _write(tmp_path, "typo.yaml", {"epoch": 3})
    with pytest.raises(SystemExit):
        main(["batch", "--config", path, "--print-config"])
    assert "unknown key 'epoch' (did you mean 'epochs'?)" in capsys.readouterr().err


@pytest.mark.parametrize("argv, cls", [
    (["batch", "--lr", "0.5", "--workers", "2", "--label", "y"], BatchJob),
    (["stream", "--score", "--lr", "0.5", "--score-batch-size", "64", *sum(
        ([f"--{k.replace('_', '-')}", v] for k, v in TOPICS.items()), [])], StreamJob),
    (["stream", "train", "--stages", "2", "--features-topic", "f", "--updates-topic", "u", "--raw-topic", "r",
      "--dead-letter-topic", "d"], StreamJob),
    (["replay", "--topic", "t", "--rate", "5"], ReplayJob),
])
def test_print_config_prints_the_sections_and_is_a_valid_config(argv, cls, tmp_path, capsys):
    printed = _printed(capsys, *argv)
    shown = yaml.safe_load(printed)
    sections = layout(options_of(cls))
    top = set(shown) - set(sections)
    assert set(shown) & set(sections) and not top & {o.name for o in options_of(cls) if o.section}, shown
    again = _printed(capsys, argv[0], *argv[1:2] if argv[1] in HALVES else (), "--config",
                     _write(tmp_path, "printed.yaml", shown))
    assert again == printed  # the round trip
    # config.json stays flat, loads as before, and prints the same sections
    flat = flat_config(shown, cls)
    assert set(flat) <= {o.name for o in options_of(cls)}
    (tmp_path / "config.json").write_text(json.dumps(flat))
    assert _printed(capsys, argv[0], *argv[1:2] if argv[1] in HALVES else (), "--config",
                    str(tmp_path / "config.json")) == printed


def test_sections_come_in_help_order_and_every_command_declares_them_without_a_clash():
    assert [k for k, v in to_sections(StreamJob()).items() if isinstance(v, dict)] == [
        "kafka", "events", "pipeline", "trainer", "parallel", "score", "updates"]
    assert [k for k, v in to_sections(BatchJob()).items() if isinstance(v, dict)] == ["train", "parallel"]
    assert to_sections(BatchJob())["train"]["lr"] == BatchJob().lr
    # the command's own options (input, out, dataset, topics, runner) stay at the top level
    assert {"input", "out", "runner"} <= set(to_sections(BatchJob()))
    assert {"out", "dataset", "raw_topic", "runner"} <= set(to_sections(StreamJob()))
    assert flat_config(to_sections(StreamJob()), StreamJob) == to_config(StreamJob())
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    seen = 0
    for sub in commands.values():
        parsers = [sub, *(p for a in sub._actions if a.choices and isinstance(a.choices, dict)
                          for p in a.choices.values())]
        for p in parsers:
            if p.get_default("option_class") is not None:
                layout(options_of(p.get_default("option_class")))  # a clash is a TypeError naming it
                seen += 1
    assert seen >= 10

"""Options of the command line: --config YAML under the command line, unknown keys and flags, Beam
options, typed --kafka-config, ranges, --out, --resume without a loadable checkpoint, a corrupt
newest checkpoint, and --job-only run through the worker entry point as printed."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flowtrain.cli.main import main, parse
from flowtrain.commands.kafka_options import kafka_config

ROOT = Path(__file__).resolve().parents[2]  # the repository
pytestmark = pytest.mark.timeout(300)


def _rejected(capsys, argv: list[str]) -> str:
    """Parsing ``argv`` must stop with status 2; returns what it printed."""
    with pytest.raises(SystemExit) as stopped:
        parse(argv)
    assert stopped.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv, option", [
    (["batch", "--workers", "0"], "--workers"), (["batch", "--workers", "-1"], "--workers"),
    (["batch", "--stages", "0"], "--stages"), (["batch", "--batch-size", "0"], "--batch-size"),
    (["batch", "--microbatches", "0"], "--microbatches"), (["batch", "--epochs", "0"], "--epochs"),
    (["batch", "--patience", "0"], "--patience"), (["batch", "--lr", "0"], "--lr"),
    (["batch", "--dropout", "1.5"], "--dropout"), (["batch", "--hidden", "64,0"], "--hidden"),
    (["batch", "--failure-timeout", "-5"], "--failure-timeout"),
    (["stream", "train", "--workers", "0"], "--workers"), (["stream", "--batch-size", "0"], "--batch-size"),
    (["stream", "--checkpoint-every", "0"], "--checkpoint-every"), (["stream", "--max-delay", "-1"], "--max-delay"),
    (["stream", "--idle-exit", "0"], "--idle-exit"), (["stream", "--lr", "-0.1"], "--lr"),
    (["replay", "--partitions", "0"], "--partitions"), (["replay", "--malformed", "2"], "--malformed"),
])
def test_out_of_range_options_are_errors_naming_the_option(capsys, argv, option):
    err = _rejected(capsys, argv)
    assert f"argument {option}: must be" in err, err


def test_yaml_flags_survive_absent_command_line_flags_and_given_flags_win(tmp_path):
    batch = tmp_path / "batch.yaml"
    batch.write_text("resume: true\nno-progress: true\nepochs: 3\nworkers: 2\nhidden: [64, 32]\n")
    args, beam_args = parse(["batch", "--config", str(batch), "--epochs", "5"])
    assert args.options == {"resume": True, "no_progress": True, "epochs": 5, "workers": 2, "hidden": (64, 32)}
    assert args.resume is True and args.no_progress is True and beam_args == []

    from flowtrain.train.stream.config import StreamTrainConfig
    from pipelines.flights.streaming import StreamConfig

    stream = tmp_path / "stream.yaml"
    stream.write_text("batch_size: 300\nledger: true\nkafka_config: {ssl_check_hostname: false, "
                      "request_timeout_ms: 20000}\n")
    args, _ = parse(["stream", "train", "--config", str(stream), "--lr", "0.01"])
    assert (args.batch_size, args.ledger, args.lr) == (300, True, 0.01)
    # options set nowhere read their default from the config dataclasses
    assert args.max_delay == StreamConfig.max_delay and args.checkpoint_every == StreamTrainConfig.checkpoint_every
    assert kafka_config(args.kafka_config) == {"ssl_check_hostname": False, "request_timeout_ms": 20000}


@pytest.mark.parametrize("text, message", [
    ("epochs: ten\n", "epochs: 'ten' is not a whole number"),
    ("epochs: 0\n", "epochs: must be a whole number >= 1"),
    ("resume: yes please\n", "resume: 'yes please' is not true or false"),
    ("epoch: 3\n", "unknown key 'epoch' (did you mean 'epochs'?)"),
    ("schedule: zigzag\n", "schedule: 'zigzag' is not one of 1f1b, gpipe"),
    ("- epochs\n", "must hold a mapping of option: value"),
])
def test_bad_yaml_is_a_message_naming_file_and_key(capsys, tmp_path, text, message):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    err = _rejected(capsys, ["batch", "--config", str(path)])
    assert f"--config {path}" in err and message in err, err
    assert "Traceback" not in err


def test_mistyped_flags_are_errors_and_beam_options_pass(capsys):
    err = _rejected(capsys, ["batch", "--epohcs", "3"])
    assert "unknown option --epohcs (did you mean --epochs?)" in err
    err = _rejected(capsys, ["stream", "pipeline", "--flink_mastr=localhost:8081"])
    assert "unknown option --flink_mastr (did you mean --flink_master?)" in err
    args, beam_args = parse(["batch", "--experiments=my_flag", "--direct_num_workers", "1", "--epochs", "2",
                             "--", "--my_runner_flag=1"])
    assert beam_args == ["--experiments=my_flag", "--direct_num_workers", "1", "--my_runner_flag=1"]
    assert args.options == {"epochs": 2}
    err = _rejected(capsys, ["kafka", "status", "--prot", "9092"])
    assert err == ("flowtrain kafka status: error: unknown option --prot (did you mean --port?); "
                   "see flowtrain kafka status --help\n")


@pytest.mark.parametrize("argv, line", [
    (["batch", "--lable", "y"], "flowtrain batch: error: unknown option --lable (did you mean --label?); "
                                "see flowtrain batch --help"),
    (["predict", "--lable", "y"], "flowtrain predict: error: unknown option --lable (did you mean --label?); "
                                  "see flowtrain predict --help"),
    (["batch", "--learning-rate", "0.1"], "flowtrain batch: error: unknown option --learning-rate (did you mean "
                                          "--lr?); see flowtrain batch --help"),
    (["batch", "--epochs", "ten"], "flowtrain batch: error: argument --epochs: 'ten' is not a whole number; "
                                   "see flowtrain batch --help"),
    ([], "flowtrain: error: the following arguments are required: COMMAND; see flowtrain --help"),
])
def test_a_mistyped_flag_is_one_line_naming_the_command_not_the_usage(capsys, argv, line):
    assert _rejected(capsys, argv).splitlines() == [line]


def test_predicts_unknown_option_hint_names_predict_not_batch(capsys):
    err = _rejected(capsys, ["predict", "--zzzq", "1"])
    assert "`flowtrain predict ... -- --my_runner_option=1`" in err and "flowtrain batch" not in err, err
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize("key, nearest", [("learning_rate", "lr"), ("max_epochs", "epochs"), ("epoch", "epochs"),
                                          ("per_device_train_batch_size", "batch_size"),
                                          ("warmup", "warmup_steps")])
def test_an_unknown_config_key_suggests_the_nearest_option_instead_of_listing_all(capsys, tmp_path, key, nearest):
    path = tmp_path / "run.yaml"
    path.write_text(f"{key}: 3\n")
    err = _rejected(capsys, ["batch", "--config", str(path)])
    assert err.splitlines() == [f"flowtrain batch: error: --config {path}: unknown key {key!r} (did you mean "
                                f"{nearest!r}?); see flowtrain batch --help"], err
    from connectors.fields import OptionError, build
    from flowtrain.commands.batch.job import BatchJob

    with pytest.raises(OptionError, match=f"unknown option {key} \\(did you mean {nearest}\\?\\)"):
        build(BatchJob, {key: 3})


def test_kafka_start_has_its_own_help_and_no_longer_says_single_node():
    for action in ("start", "stop", "status"):
        proc = subprocess.run([sys.executable, "-m", "flowtrain.cli", "kafka", action, "--help"], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0 and proc.stdout.startswith(f"usage: flowtrain kafka {action} "), proc.stdout
        assert "single-node" not in proc.stdout and "--brokers" in proc.stdout
        assert ("--timeout" in proc.stdout) == (action == "start") and ("--json" in proc.stdout) == (action == "status")


def test_kafka_config_values_are_typed_and_keys_checked(capsys):
    assert kafka_config(["ssl_check_hostname=false", "request_timeout_ms=30000", "client_id=123",
                         "security.protocol=SSL", "sasl_plain_password=0042"]) == {
        "ssl_check_hostname": False, "request_timeout_ms": 30000, "client_id": "123",
        "security_protocol": "SSL", "sasl_plain_password": "0042"}
    for bad, message in (("ssl_check_hostname=maybe", "ssl_check_hostname expects true or false"),
                         ("request_timeout_ms=soon", "request_timeout_ms expects a whole number"),
                         ("group_id=g", "group_id: only the kafka-python consumer takes it"),
                         ("ssl_check_hostnam=false", "(did you mean ssl_check_hostname?)"),
                         ("novalue", "expected KEY=VALUE")):
        err = _rejected(capsys, ["replay", "--kafka-config", bad])
        assert "argument --kafka-config" in err and message in err, err


@pytest.mark.kafka
def test_typed_kafka_config_reaches_real_clients_and_a_bad_key_is_one_line(bootstrap, new_topic):
    from kafka import KafkaConsumer, TopicPartition

    topic = new_topic(partitions=1)
    cli = [sys.executable, "-m", "flowtrain.cli", "replay", "--bootstrap", bootstrap, "--topic", topic]
    ok = subprocess.run(cli + ["--limit", "20", "--kafka-config", "client_id=flowtrain-typed", "--kafka-config",
                               "request_timeout_ms=20000", "--kafka-config", "ssl_check_hostname=false"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr[-2000:]
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    tp = TopicPartition(topic, 0)
    assert consumer.end_offsets([tp])[tp] == 20
    consumer.close()
    bad = subprocess.run(cli + ["--limit", "1", "--kafka-config", "no_such_option=1"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no_such_option: not a kafka-python client option" in bad.stderr
    assert "Traceback" not in bad.stderr


# --- the batch job: --out, --resume, a corrupt newest checkpoint, --job-only -------------------------------
@pytest.fixture(scope="module")
def synthetic(shared_data) -> str:
    return shared_data.regression_dataset(rows=1200)


def _batch(dataset: str, out: Path, *extra: str) -> list[str]:
    return ["batch", "--dataset", dataset, "--out", str(out), "--no-progress", "--dropout", "0", "--patience", "10",
            "--batch-size", "128", "--threads", "1", *extra]


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_yaml_resume_falls_back_past_a_corrupt_newest_checkpoint_and_all_corrupt_is_an_error(
        synthetic, tmp_path, capsys):
    assert main(_batch(synthetic, tmp_path / "full", "--epochs", "3")) == 0
    part = tmp_path / "part"
    assert main(_batch(synthetic, part, "--epochs", "2")) == 0
    older, newest = sorted((part / "checkpoints").glob("ckpt-*.pt"))
    _corrupt(newest)
    config = tmp_path / "resume.yaml"  # resume and no_progress from YAML only: absent flags must not undo them
    config.write_text(f"resume: true\nno_progress: true\ndataset: {synthetic}\nout: {part}\nepochs: 3\n"
                      f"dropout: 0\npatience: 10\nbatch_size: 128\nthreads: 1\n")
    capsys.readouterr()
    assert main(["batch", "--config", str(config)]) == 0
    printed = capsys.readouterr().out
    assert f"resumed from {older.name}" in printed, printed[-2000:]
    full = torch.load(tmp_path / "full" / "model.pt", weights_only=True)
    resumed = torch.load(part / "model.pt", weights_only=True)
    assert max(float((full[k] - resumed[k]).abs().max()) for k in full) <= 1e-6

    for path in (part / "checkpoints").glob("ckpt-*.pt"):
        _corrupt(path)
    assert main(["batch", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "--resume: none of the" in err and "does not match its checksum" in err, err
    assert "leave out --resume" in err


def test_out_that_is_a_file_and_resume_without_checkpoints_are_messages(synthetic, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert main(_batch(synthetic, afile)) == 2
    assert f"--out {afile} is a file, not a directory" in capsys.readouterr().err
    assert main(_batch(synthetic, tmp_path / "new", "--resume")) == 2
    assert "holds no checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "new" / "model.pt").exists()


@pytest.mark.timeout(120)
def test_a_bad_input_is_one_line_on_stderr_without_beams_import_warning(tmp_path):
    """The error is the only line: Beam's 'apitools not found' import warning is not printed first."""
    table = tmp_path / "t.csv"
    table.write_text("a,b\n1,x\n")
    proc = subprocess.run([sys.executable, "-m", "flowtrain.cli", "batch", "--input", str(table), "--label", "zz",
                           "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=100)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [  # no --numeric/--categorical: the columns are inferred (#45 item 1)
        f"flowtrain batch: --label 'zz' is not a column of {table}; it has a, b"], proc.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rows, label, line", [
    ("x,c,y\n1,a,2\n2,b,3\n", "tir", "flowtrain batch: --label 'tir' is not a column of {path}; it has x, c, y"),
    ("x,c,yy\n1,a,2\n", "y", "flowtrain batch: --label 'y' is not a column of {path} (did you mean 'yy'?); it has "
                             "x, c, yy"),
    ("x,c,y\n1,a,\n2,b,\n", "y", "flowtrain batch: label column 'y' holds no values: it is empty in the first 2 rows "
                                 "of {path}; check --label, or give --task if later rows hold values"),
    ("x,c,y\n", "y", "flowtrain batch: the input is empty: {path} holds no rows"),
])
def test_a_missing_or_empty_label_is_the_first_line_not_a_task_guess(tmp_path, capsys, rows, label, line):
    """Nothing about the task ("task: regression (label 'tir' not found ...)") is printed before the error. (In
    this process: a process each cost the fast lane seconds; the command's own process prints only its one line:
    test_a_bad_input_is_one_line_on_stderr_without_beams_import_warning.)"""
    table = tmp_path / "t.csv"
    table.write_text(rows)
    capsys.readouterr()
    code = main(["batch", "--input", str(table), "--label", label, "--numeric", "x", "--out", str(tmp_path / "run")])
    out, err = capsys.readouterr()
    assert code == 2, err
    assert "task:" not in out and "numbers of type null" not in err, out
    assert err.strip().splitlines() == [line.format(path=table)], err

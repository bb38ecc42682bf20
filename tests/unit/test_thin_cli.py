"""Issue 30 item 4 (a thin CLI) and the Kafka/Flink part of item 2: the command line only parses and calls the
jobs; producers live in connectors/kafka, one supervisor in flowtrain/local, one place picks the runner, the
kafka/flink flags are option fields, and every streaming job has a Python entry point."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CLI = ROOT / "flowtrain" / "cli"


def _trees():
    return {path.name: ast.parse(path.read_text()) for path in sorted(CLI.glob("*.py"))}


def test_item4_the_cli_is_under_1000_lines_and_no_module_over_500():
    lines = {path.name: len(path.read_text().splitlines()) for path in CLI.glob("*.py")}
    assert sum(lines.values()) < 1000, lines
    assert max(lines.values()) <= 500, lines
    for module in ("flowtrain/commands/stream/replay.py", "flowtrain/commands/stream/job.py",
                   "flowtrain/commands/stream/status.py", "flowtrain/commands/local.py", "connectors/kafka/produce.py",
                   "flowtrain/local/processes.py", "flowtrain/local/runners.py"):
        assert len((ROOT / module).read_text().splitlines()) <= 500, module


def test_item4_the_cli_defines_no_kafka_producer_or_supervisor():
    for name, tree in _trees().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                methods = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
                assert not methods & {"send", "confirm", "produce"}, f"{name}: class {node.name} produces"
                assert not any(w in node.name.lower() for w in ("sender", "producer", "supervis")), (name, node.name)
            if isinstance(node, ast.Attribute):  # nothing started or watched from here
                assert node.attr not in ("Popen", "killpg", "waitpid"), f"{name} starts or signals processes"
            if isinstance(node, ast.ImportFrom):
                names = {a.name for a in node.names}
                assert not names & {"supervise", "Supervisor", "new_producer", "KafkaDelivery", "runner_args",
                                    "pick_runner", "LocalKafka", "LocalFlink"}, f"{name} imports {names}"
                assert node.module not in ("subprocess", "confluent_kafka", "kafka"), f"{name} imports {node.module}"
            if isinstance(node, ast.Import):
                assert not {a.name for a in node.names} & {"subprocess", "confluent_kafka", "kafka"}, name


def test_item4_producers_are_in_connectors_kafka():
    from connectors.kafka import ProduceError, new_sender
    from connectors.kafka.produce import ConfluentSender, PythonSender

    assert issubclass(ProduceError, RuntimeError)
    assert callable(new_sender) and PythonSender.send and ConfluentSender.confirm
    tree = ast.parse((ROOT / "connectors/kafka/produce.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not [m for m in imported if m and m.split(".")[0] in ("flowtrain", "pipelines")], imported


def test_item4_one_supervisor_runs_the_whole_stream_job():
    """The whole job (with or without the scorer) is one function on ``flowtrain.local.processes.supervise``."""
    tree = ast.parse((ROOT / "flowtrain/commands/stream/job.py").read_text())
    calls = [n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    assert calls.count("supervise") == 1
    for path in [*CLI.glob("*.py"), *(ROOT / "flowtrain/commands").rglob("*.py")]:
        if path != ROOT / "flowtrain/commands/stream/job.py":
            assert "supervise(" not in path.read_text(), path


def test_item4_one_place_picks_the_runner():
    from flowtrain.local.runners import RunnerOptionError, pick_runner, pipeline_options

    assert pick_runner(None, None, ["--x=1"]) == ["--x=1"]
    assert pick_runner("PrismRunner", None, ["--x=1"]) == ["--runner=PrismRunner", "--x=1"]
    with pytest.raises(RunnerOptionError, match="--flink-master goes with --runner flink"):
        pick_runner("PrismRunner", "jm:8081")
    with pytest.raises(RunnerOptionError, match="--environment_type"):
        pick_runner("flink", "jm:8081")
    assert pipeline_options("batch", runner="DirectRunner").get_all_options()["runner"] == "DirectRunner"
    for path in [*CLI.glob("*.py"), *(ROOT / "flowtrain/commands").rglob("*.py")]:
        assert "runner_args(" not in path.read_text(), path  # batch and predict: pipeline_options; stream: pick_runner
    assert "pick_runner(" in (ROOT / "flowtrain/commands/stream/job.py").read_text()


#: The flags of each action before they became fields (issue 29/30): names unchanged.
FLAGS = {
    ("kafka", "start"): {"--port", "--data-dir", "--brokers", "--timeout"},
    ("kafka", "stop"): {"--port", "--data-dir", "--brokers"},
    ("kafka", "status"): {"--port", "--data-dir", "--brokers", "--json"},
    ("flink", "start"): {"--taskmanagers", "--slots", "--rest-port", "--job-port", "--bind", "--taskmanager-of",
                         "--rpc-port", "--pool-port", "--parallelism", "--expose-job-server", "--task-heap-mb",
                         "--managed-mb", "--task-off-heap-mb", "--data-dir", "--timeout"},
    ("flink", "stop"): {"--data-dir", "--timeout"},
    ("flink", "status"): {"--data-dir", "--json"},
}


def test_item2_kafka_and_flink_flags_are_option_fields():
    import argparse

    from connectors.fields import options_of
    from flowtrain.cli.main import build_parser
    from flowtrain.commands.local import ACTIONS

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for (command, action), flags in FLAGS.items():
        sub = next(a for a in commands[command]._actions if isinstance(a, argparse._SubParsersAction))
        leaf = sub.choices[action]
        shown = {s for a in leaf._actions for s in a.option_strings if s.startswith("--")}
        assert shown - {"--help", "--config", "--print-config"} == flags, (command, action)
        assert {o.flag for o in options_of(ACTIONS[command][action])} == flags, (command, action)


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flowtrain.cli", *argv], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def test_item2_kafka_and_flink_take_config_and_print_config(tmp_path):
    config = tmp_path / "kafka.yaml"
    config.write_text("port: 19092\nbrokers: 3\n")
    got = _cli("kafka", "start", "--config", str(config), "--timeout", "12", "--print-config")
    assert got.returncode == 0, got.stderr
    assert yaml.safe_load(got.stdout) == {"port": 19092, "data_dir": None, "brokers": 3, "timeout": 12.0}
    got = _cli("flink", "start", "--taskmanagers", "3", "--task-heap-mb", "512", "--print-config")
    assert got.returncode == 0, got.stderr
    shown = yaml.safe_load(got.stdout)
    assert shown["taskmanagers"] == 3 and shown["task_heap_mb"] == 512 and shown["timeout"] == 180.0
    bad = _cli("flink", "stop", "--timeout", "soon")
    assert bad.returncode == 2 and "--timeout" in bad.stderr and "Traceback" not in bad.stderr
    wrong_key = tmp_path / "flink.yaml"
    wrong_key.write_text("taskmanager: 3\n")
    bad = _cli("flink", "start", "--config", str(wrong_key), "--print-config")
    assert bad.returncode == 2 and "'taskmanager' (did you mean 'taskmanagers'?)" in bad.stderr, bad.stderr
    down = _cli("kafka", "status", "--port", "1", "--data-dir", str(tmp_path / "none"))
    assert down.returncode == 3 and down.stdout.startswith("kafka: not running"), (down.stdout, down.stderr)


def test_item5_streaming_jobs_run_from_python_with_the_same_job_objects(tmp_path):
    import flowtrain
    from flowtrain.commands.stream.options import ReplayJob, StreamJob
    from flowtrain.local.tools import free_port

    assert flowtrain.ReplayJob is ReplayJob and flowtrain.StreamJob is StreamJob
    assert {"replay", "stream", "score"} <= set(flowtrain.__all__)
    with pytest.raises(flowtrain.FlowtrainError, match="did you mean partitions"):
        flowtrain.replay(partition=3)
    nobody = f"127.0.0.1:{free_port()}"
    events = tmp_path / "events.csv"
    events.write_text("x,y\n1,0\n2,1\n")
    with pytest.raises(SystemExit, match=f"flowtrain replay: no Kafka broker answered at {nobody}"):
        flowtrain.replay(ReplayJob(bootstrap=nobody, input=(str(events),), connect_timeout=1.0))
    with pytest.raises(SystemExit, match=f"flowtrain stream train: no Kafka broker answered at {nobody}"):
        flowtrain.stream(bootstrap=nobody, half="train", out=str(tmp_path / "run"), connect_timeout=1.0)
    assert (tmp_path / "run" / "config.json").is_file()  # the run directory prepared as the command does

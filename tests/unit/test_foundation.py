"""The foundation: a real Kafka broker, a batch Beam runner, a streaming Beam runner, the CLI."""
from __future__ import annotations

import subprocess
import sys

import apache_beam as beam
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to

from flowtrain.local.runners import pipeline_options
from flowtrain.local.tools import free_port


def test_batch_pipeline_on_local_batch_runner():
    options = pipeline_options("batch")
    assert options.get_all_options()["runner"] == "FnApiRunner"
    with TestPipeline(options=options) as p:
        counts = (p | beam.Create(["a b", "b c", "c"]) | beam.FlatMap(str.split)
                  | beam.combiners.Count.PerElement())
        assert_that(counts, equal_to([("a", 1), ("b", 2), ("c", 2)]))


def test_cluster_ids_never_start_with_a_dash():
    """StorageTool reads ``-t -xyz`` as a missing argument; 1 random id in 64 starts with '-'
    and once failed the session broker's start."""
    import base64

    from flowtrain.local.kafka.broker import new_cluster_id

    ids = [new_cluster_id() for _ in range(2000)]
    assert not [i for i in ids if i.startswith("-")]
    assert all(len(base64.urlsafe_b64decode(i + "==")) == 16 for i in ids)
    assert len(set(ids)) == len(ids)


def test_streaming_options_keep_user_flags_and_turn_off_prism_dynamic_splits():
    """Prism's dynamic split of a waiting Kafka read once failed a CI run inside Beam's harness
    (NaN progress); the reader never splits a partition, so streaming runs turn it off."""
    from apache_beam.options.pipeline_options import DebugOptions

    options = pipeline_options("streaming", ["--experiments=my_flag"])
    experiments = options.view_as(DebugOptions).experiments
    assert "prism_disable_sdf_split" in experiments and "my_flag" in experiments
    assert options.get_all_options()["runner"] == "flowtrain.local.runners.LocalPrismRunner"  # Prism on 127.0.0.1
    user = pipeline_options("streaming", ["--runner=FlinkRunner"])
    assert user.get_all_options()["runner"] == "FlinkRunner"
    assert "prism_disable_sdf_split" not in (user.view_as(DebugOptions).experiments or [])


def test_kafka_cli_missing_java_says_what_to_install(tmp_path):
    env = {"PATH": "/nonexistent", "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "flowtrain.cli", "kafka", "start", "--port",
                           str(free_port()), "--data-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2
    assert "`java` was not found" in proc.stderr and "Java 17" in proc.stderr


def test_cli_help_describes_every_command_and_option_with_the_config_defaults(monkeypatch):
    """`flowtrain --help` lists every command; every option of every command has a help text, and
    an option whose default lives in a config dataclass shows that dataclass's value."""
    import argparse

    from flowtrain.cli.main import build_parser
    from flowtrain.commands.batch.job import BatchJob

    proc = subprocess.run([sys.executable, "-m", "flowtrain.cli", "--help"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert {"kafka", "batch", "replay", "stream", "bench"} <= set(commands)
    for name in commands:
        assert f"    {name} " in proc.stdout or f"    {name}\n" in proc.stdout, f"{name} missing from --help"
    undocumented = [f"{name} {a.option_strings[-1]}" for name, sub in commands.items() for a in sub._actions
                    if a.option_strings and a.dest != "help" and not (a.help or "").strip()]
    assert not undocumented, f"options without a help text: {undocumented}"
    monkeypatch.setenv("COLUMNS", "2000")  # no wrapping inside a default such as flights-dead-letters
    # (every field's documented default: tests/unit/test_options_fields.py walks the fields)
    batch_help = " ".join(commands["batch"].format_help().split())
    assert f"reduced as sums and counts; a whole number >= 1 (default: {BatchJob().workers})" in batch_help


def test_free_ports_are_under_the_ephemeral_range_with_their_next_port_free_and_never_repeated():
    """A service binds its port seconds after it is picked (a JVM starting) and a broker's controller takes the next
    one: both free, picked where client sockets never take theirs (seen in CI: a controller port taken meanwhile)."""
    import socket

    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    ports = [free_port() for _ in range(200)]
    assert all(p + 1 < low for p in ports)
    assert len(set(ports) | {p + 1 for p in ports}) == 400  # no port, nor its neighbour, handed out twice
    for p in ports[:20]:
        for q in (p, p + 1):
            with socket.socket() as s:
                s.bind(("127.0.0.1", q))

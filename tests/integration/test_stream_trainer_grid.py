"""The online trainer through the engine's grid (issue 30 item 1): `flowtrain stream train --stages 2` and
`--tensor-parallel 2` (real Kafka, real torch.distributed gloo) end with the parameters of a one-process
run on the same feature messages, and a grid run with ZeRO on its stages' replicas (sharded checkpoints)
killed with SIGKILL and restarted from them trains every row exactly once (and still ends with those
parameters)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from kafka import KafkaProducer

from connectors.arrow import encode_batch
from connectors.dataset import read_manifest
from tests.integration.test_stream_trainer import _exactly_once, _status_step
from tests.procs import worker_pids

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "flowtrain.cli"]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))
ROWS = 40  # rows per feature message: one step each


def _messages(dataset: str) -> list[pa.RecordBatch]:
    """The dataset's rows as feature messages on one feature partition, with their sources (raw partition 0)."""
    manifest = read_manifest(dataset)
    table = pa.concat_tables([pq.read_table(Path(dataset) / s["file"]) for split in ("train", "valid", "test")
                              for s in manifest["splits"][split]])
    out = []
    for start in range(0, table.num_rows, ROWS):
        chunk = table.slice(start, ROWS).combine_chunks()
        chunk = chunk.append_column("src_partition", pa.array([0] * chunk.num_rows, pa.int32()))
        chunk = chunk.append_column("src_offset", pa.array(range(start, start + chunk.num_rows), pa.int64()))
        out.append(chunk.to_batches()[0])
    return out


def _send(bootstrap: str, topic: str, messages: list[pa.RecordBatch]) -> set:
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    for batch in messages:
        producer.send(topic, value=encode_batch(batch), partition=0).get(timeout=30)
    producer.close()
    return {(0, o) for b in messages for o in b.column("src_offset").to_pylist()}


def _argv(bootstrap: str, topic: str, dataset: str, out: Path, *extra: str) -> list[str]:
    return CLI + ["stream", "train", "--bootstrap", bootstrap, "--features-topic", topic, "--updates-topic",
                  f"{topic}-updates", "--dead-letter-topic", f"{topic}-dead", "--dataset", dataset, "--out", str(out),
                  "--hidden", "32,16", "--device", "cpu", "--ledger", "--checkpoint-every", "3",
                  "--checkpoint-seconds", "1000", "--failure-timeout", "60",
                  "--dtype", "float64", *extra]  # the check mode: layouts equal one process to 1e-9 (#49 item 5)


def _run(argv: list[str], timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=ENV)


def _final_model(out: Path) -> dict:
    return torch.load(sorted((out / "checkpoints").glob("ckpt-*.pt"))[-1], weights_only=True)["model"]


def _assert_equal_models(mine: dict, reference: dict) -> None:
    assert mine.keys() == reference.keys()
    worst = max(float((mine[k].double() - reference[k].double()).abs().max()) for k in reference
                if reference[k].is_floating_point())
    assert all(v.dtype == torch.float64 for v in mine.values() if v.is_floating_point())
    assert worst <= 1e-9, f"parameters differ from the one-process run's by {worst:.3g}"


@pytest.fixture(scope="module")
def features(bootstrap, shared_data, tmp_path_factory) -> dict:
    """A regression dataset's feature messages on a one-partition topic, and a one-process run over them."""
    from kafka.admin import KafkaAdminClient, NewTopic

    base = tmp_path_factory.mktemp("grid")
    dataset = shared_data.regression_dataset(rows=600)
    messages = _messages(dataset)
    topic = f"grid-{os.getpid()}-{time.monotonic_ns()}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])
    admin.close()
    sources = _send(bootstrap, topic, messages)
    one = base / "one"
    proc = _run(_argv(bootstrap, topic, dataset, one, "--idle-exit", "2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    _exactly_once(one, sources)
    return {"dataset": dataset, "messages": messages, "topic": topic, "sources": sources,
            "reference": _final_model(one), "steps": len(messages)}


def test_stream_tensor_parallel_equals_one_process(features, bootstrap, tmp_path):
    """--tensor-parallel 2 (--stages 2: the SIGKILL test below ends with the same comparison)."""
    out = tmp_path / "grid"
    proc = _run(_argv(bootstrap, features["topic"], features["dataset"], out, "--tensor-parallel", "2",
                      "--idle-exit", "3"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "grid: " in proc.stdout  # the engine's grid, not data parallelism
    _exactly_once(out, features["sources"])
    assert torch.load(sorted((out / "checkpoints").glob("ckpt-*.pt"))[-1], weights_only=True)["step"] == \
        features["steps"]
    _assert_equal_models(_final_model(out), features["reference"])


@pytest.mark.timeout(360)
def test_stream_pipeline_stages_sigkill_restart_exactly_once_equals_one_process(features, bootstrap, new_topic,
                                                                                 tmp_path):
    """--workers 2 --stages 2 --shard-states optimizer (ZeRO-1 over each stage's replicas: its checkpoints sharded,
    one file per rank, no whole model; ZeRO-3 saves through the same code, 72 s here against 40 s): a process is
    killed with SIGKILL mid-stream; the restart resumes from the last checkpoint's shards, trains every row once,
    and ends where the uninterrupted one-process run ended (1e-9, float64)."""
    dataset, messages = features["dataset"], features["messages"]
    topic = new_topic(partitions=1)
    first, rest = messages[:8], messages[8:]
    sources = _send(bootstrap, topic, first)
    out = tmp_path / "crashed"
    argv = _argv(bootstrap, topic, dataset, out, "--workers", "2", "--stages", "2", "--shard-states", "optimizer")
    run = subprocess.Popen(argv + ["--idle-exit", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=ENV, start_new_session=True)
    job_path = str(out / "workers" / "job.json")
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and _status_step(out) < 4 and run.poll() is None:
            time.sleep(0.05)
        pids = worker_pids(job_path)
        assert set(pids) == {0, 1, 2, 3}, f"processes not found ({pids}); {run.poll()}"
        os.kill(pids[1], signal.SIGKILL)  # it reads no partition, rank 0 does
        _, err = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait(timeout=10)
    assert run.returncode != 0 and "worker rank 1 was killed by SIGKILL" in err, err[-3000:]
    newest = sorted((out / "checkpoints").glob("ckpt-*.pt"))[-1]
    assert {p.name for p in newest.with_suffix(".dcp").iterdir()} == {".metadata", *(f"__{r}_0.distcp" for r in range(4))}
    assert "model" not in torch.load(newest, weights_only=True)

    sources |= _send(bootstrap, topic, rest)
    again = _run(argv + ["--idle-exit", "3"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {newest.name}" in again.stdout
    _exactly_once(out, sources)
    # sharded checkpoints hold no whole model: the final model whole is the version published last
    final = torch.load(sorted((out / "published").glob("ckpt-*.pt"))[-1], weights_only=True)
    assert final["step"] == features["steps"]
    _assert_equal_models(final["model"], features["reference"])

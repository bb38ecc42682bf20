"""What a streaming run shows: TensorBoard event files of `flowtrain stream train` against the
real broker (prequential metrics, model version, hparams)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from connectors.arrow import encode_batch
from connectors.dataset import read_manifest
from tests.synthetic_data import make_regression_run

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parent.parent.parent
CLI = [sys.executable, "-m", "flowtrain.cli"]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))


def publish_features(bootstrap: str, topic: str, dataset: str, rows: int = 40) -> int:
    """The dataset's rows as feature messages on partition 0, as the stream pipeline writes them
    (each row with its source); returns the rows sent."""
    from kafka import KafkaProducer

    manifest = read_manifest(dataset)
    table = pa.concat_tables([pq.read_table(Path(dataset) / s["file"]) for split in ("train", "valid", "test")
                              for s in manifest["splits"][split]])
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    for start in range(0, table.num_rows, rows):
        chunk = table.slice(start, rows).combine_chunks()
        chunk = chunk.append_column("src_partition", pa.array([0] * chunk.num_rows, pa.int32()))
        chunk = chunk.append_column("src_offset", pa.array(range(start, start + chunk.num_rows), pa.int64()))
        (batch,) = chunk.to_batches()
        producer.send(topic, value=encode_batch(batch), partition=0).get(timeout=30)
    producer.close()
    return table.num_rows


@pytest.fixture(scope="module")
def stream_train_run(bootstrap, tmp_path_factory):
    from kafka.admin import KafkaAdminClient, NewTopic

    base = tmp_path_factory.mktemp("observe-stream")
    dataset, batch = make_regression_run(base, epochs=2, rows=900)
    topic = f"obs-{os.getpid()}-{time.monotonic_ns()}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])
    admin.close()
    rows = publish_features(bootstrap, topic, dataset)
    out = base / "stream"
    t0 = time.time()
    proc = subprocess.run(CLI + ["stream", "train", "--bootstrap", bootstrap, "--features-topic", topic,
                                 "--updates-topic", f"{topic}-updates", "--dataset", dataset, "--out", str(out),
                                 "--init-weights", str(batch / "model.pt"), "--checkpoint-every", "5",
                                 "--checkpoint-seconds", "1000", "--idle-exit", "2"],
                          capture_output=True, text=True, timeout=240, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, rows, t0, time.time()


def test_stream_train_writes_prequential_metrics_and_versions_to_tensorboard(stream_train_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    out, rows, t0, t1 = stream_train_run
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    preq = [r for r in records if r["kind"] == "prequential"]
    assert preq and all(t0 <= r["time"] <= t1 for r in records)
    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    scalars = acc.Tags()["scalars"]
    for tag in ("prequential/loss", "prequential/rmse", "prequential/mae", "prequential/version",
                "prequential/rows_trained"):
        assert tag in scalars, (tag, scalars)
    # one point per published version, at its step, equal to metrics.jsonl
    assert [(e.step, e.value) for e in acc.Scalars("prequential/version")] == [(r["step"], r["version"]) for r in preq]
    with_rows = [r for r in preq if "rmse" in r]
    assert [e.value for e in acc.Scalars("prequential/rmse")] == pytest.approx([r["rmse"] for r in with_rows])
    assert acc.Scalars("prequential/rows_trained")[-1].value == rows
    content = acc.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    assert start.session_start_info.hparams["checkpoint_every_steps"].number_value == 5
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"])
    assert "prequential/rmse" in {m.name.tag for m in experiment.experiment.metric_infos}

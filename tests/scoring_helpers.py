"""Helpers of the scoring tests (`flowtrain stream score` on the real broker, on Prism and on Flink):
the 3-class sensor events, topics, the batch-trained model, publishing signed versions as the online
trainer does, reading the predictions and dead-letter topics, and the forward each prediction must equal."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pyarrow as pa
import torch
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from connectors.arrow import decode_batch
from tests.sensor_data import sensor_rows

CLI = [sys.executable, "-m", "flowtrain.cli"]
#: The scorer's --swap-interval in these tests (seconds).
SWAP_S = 1.0


def events(n: int, *, seed: int = 1, unlabelled_every: int = 10, unseen_every: int = 0) -> list[dict]:
    """Sensor events with their own id; every ``unlabelled_every``-th has no label, every
    ``unseen_every``-th a class the training split never saw."""
    out = []
    for i, row in enumerate(sensor_rows(n, seed=seed)):
        row = {"reading_id": f"r-{seed}-{i}", **row}
        if unlabelled_every and i % unlabelled_every == 4:
            del row["state"]
        elif unseen_every and i % unseen_every == 7:
            row["state"] = "exploded"
        out.append(row)
    return out


def topic_names():
    tag = uuid.uuid4().hex[:6]
    return {"raw": f"sraw-{tag}", "pred": f"spred-{tag}", "dead": f"sdead-{tag}", "updates": f"supd-{tag}",
            "group": f"sg-{tag}"}


def random_weights(data, arch: dict, seed: int) -> dict:
    from flowtrain.train.models import Architecture

    model = Architecture.from_dict(arch, "test").build(data)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.state_dict()


def batch_model(sensor) -> tuple[dict, dict]:
    """The batch run's trained model: (architecture, weights), as --init-weights reads them."""
    from connectors.kafka import KafkaTarget, Topics
    from flowtrain.train.stream.config import StreamTrainConfig, initial_weights

    arch, state = initial_weights(StreamTrainConfig(kafka=KafkaTarget("-"), topics=Topics(), run_dir="-",
                                                    dataset_dir=sensor["dataset"], init_weights=str(sensor["run"] / "model.pt")))
    return arch.to_dict(), state


def send(bootstrap, topic, value: bytes, key: bytes | None = None) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    producer.send(topic, key=key, value=value).get(timeout=30)
    producer.close()


def produce(bootstrap, topic, events, *, malformed_every: int = 0) -> int:
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    for i, e in enumerate(events):
        if malformed_every and i % malformed_every == 3:
            value = b'{"temp": 1,' if i % 2 else json.dumps({**e, "temp": "hot"}).encode()
        else:
            value = json.dumps(e).encode()
        producer.send(topic, value=value)
    producer.flush()
    producer.close()
    return len(events)


def read_topic(bootstrap, topic):
    """Every record of the topic now (up to its end offsets)."""
    c = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, fetch_max_wait_ms=50)
    try:
        tps = [TopicPartition(topic, p) for p in c.partitions_for_topic(topic) or []]
        if not tps:
            return []
        ends = c.end_offsets(tps)
        c.assign(tps)
        c.seek_to_beginning()
        out, deadline = [], time.monotonic() + 30
        while any(c.position(tp) < ends[tp] for tp in tps) and time.monotonic() < deadline:
            for records in c.poll(timeout_ms=200).values():
                out += records
        return out
    finally:
        c.close()


def probabilities(prediction: dict, classes) -> list[float]:
    """A prediction's class probabilities in ``classes``' order (its ``pred_probability_<class>`` columns)."""
    return [prediction[f"pred_probability_{c}"] for c in classes]


def predictions(bootstrap, topic) -> list[dict]:
    rows = []
    for m in read_topic(bootstrap, topic):
        rows += decode_batch(m.value).to_pylist()
    return rows


def dead_letters(bootstrap, topic) -> list[dict]:
    return [{k: v.decode() for k, v in m.headers} for m in read_topic(bootstrap, topic)]


def scorer(bootstrap, names, dataset, out: Path, *extra) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        CLI + ["stream", "score", "--bootstrap", bootstrap, "--raw-topic", names["raw"], "--updates-topic",
               names["updates"], "--predictions-topic", names["pred"], "--score-dead-letter-topic", names["dead"],
               "--score-group-id", names["group"], "--dataset", dataset, "--out", str(out), "--swap-interval",
               str(SWAP_S), "--wait-model", "120", "--id-column", "reading_id", *extra],
        stdout=open(out / "scorer.log", "ab"), stderr=subprocess.STDOUT, start_new_session=True,
        env={k: v for k, v in os.environ.items() if k != "FLOWTRAIN_UPDATE_KEY"})


def wait_covered(bootstrap, names, n_raw: int, proc, log: Path, timeout=180):
    """Until predictions + dead letters cover every raw event (distinct sources); returns both."""
    deadline = time.monotonic() + timeout
    while True:
        preds, dead = predictions(bootstrap, names["pred"]), dead_letters(bootstrap, names["dead"])
        if len({p["pred_source"] for p in preds} | {d["source"] for d in dead}) >= n_raw:
            return preds, dead
        assert proc.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() < deadline, (f"{len(preds)} predictions + {len(dead)} dead letters of {n_raw} "
                                             f"events after {timeout} s\n{log.read_text()[-3000:]}")
        time.sleep(0.5)


def expected(bootstrap, names, sensor, weights: dict[tuple[str, int], tuple[dict, dict]]) -> dict:
    """source -> {(run, version): probabilities}, computed here from the raw topic with the stream
    featurizer and flowtrain's model."""
    from connectors.dataset import read_manifest
    from flowtrain.train.loader import table_to_split
    from flowtrain.train.models import Architecture
    from pipelines.stream.featurize import StreamFeaturizer

    featurizer = StreamFeaturizer.from_manifest(read_manifest(sensor["dataset"]))
    data = sensor["data"]
    models = {}
    for tag, (arch, state) in weights.items():
        models[tag] = Architecture.from_dict(arch, "test").build(data)
        models[tag].load_state_dict(state)
        models[tag].eval()
    records = read_topic(bootstrap, names["raw"])
    out = featurizer.featurize_payloads([m.value for m in records], [(m.topic, m.partition, m.offset)
                                                                     for m in records])
    split = table_to_split(pa.Table.from_batches([out.features]), data.spec)
    expected: dict = {}
    for tag, model in models.items():
        with torch.no_grad():
            probs = torch.softmax(model(split.x_num, split.x_cat), dim=1).numpy()
        for src, p in zip(out.features.column("source").to_pylist(), probs):
            expected.setdefault(src, {})[tag] = p
    return expected


def publisher(sensor, run_dir: Path, keep: int = 10):
    from connectors.model_updates import UpdateKeySource
    from flowtrain.train.published import Publisher

    return Publisher(run_dir, keep=keep, key_source=UpdateKeySource.from_options(sensor["key_file"]))


def publish(bootstrap, names, pub, version: int, arch: dict, state: dict, run_id: str = "run-a") -> dict:
    """A version as the online trainer publishes it (its Publisher), then its record on the topic."""
    record = pub.publish(model=state, architecture=arch, version=version, step=version, run_id=run_id,
                         reason="periodic", time=time.time())
    send(bootstrap, names["updates"], json.dumps(record).encode(), key=str(version).encode())
    return record


def apply_marks(marks):
    def wrap(fn):
        for m in marks:
            fn = m(fn)
        return fn
    return wrap


#: The update key of the scoring tests' trainer and scorer.
KEY = b"serving-test-key-0123456789abcdef"


def make_sensor(shared_data, base: Path) -> dict:
    """The session's batch-trained 3-class sensor run and its dataset (``shared_data``: read only), and an update key
    file under ``base`` (the `sensor` fixtures)."""
    from flowtrain.train.loader import TabularDataset

    dataset, run, _ = shared_data.sensor_run(rows=1500, epochs=6)
    key_file = base / "update.key"
    key_file.write_bytes(KEY)
    key_file.chmod(0o600)  # a key only its owner may read (a group- or world-readable one is refused)
    return {"dataset": dataset, "run": run, "data": TabularDataset(dataset), "key_file": str(key_file)}

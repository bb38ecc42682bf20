"""bench serve's environment: one broker, the dataset, the raw events, the update key (``ServeEnv``), and the
plumbing the measurements share: topics, producing, reading, publishing versions, the scorer process."""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

from bench.demo import demo, demo_inputs, hook
from bench.inputs import Table
from connectors.kafka import topic_partitions
from flowtrain.local.tools import free_port
from flowtrain.train.loader import TabularDataset

CLI = [sys.executable, "-m", "flowtrain.cli"]
ARCH = {"kind": "mlp", "hidden": [128, 64], "dropout": 0.0, "seed": 0}  # the online trainer's default


class ServeEnv:
    """One broker, the dataset, the raw events and the update key for all rounds."""

    def __init__(self, events: int, rate: float, seconds: float, table=None, broker: bool = True,
                 bootstrap: str | None = None, publish_every_s: float = 5.0):
        """``bootstrap``: a running broker's, else (with ``broker``) one of its own."""
        from flowtrain.local.kafka import LocalKafka

        self.table = table or Table()
        self.work = Path(tempfile.mkdtemp(prefix="flowtrain-bench-serve-"))
        self.publish_every_s = publish_every_s
        self.broker, self.bootstrap = None, bootstrap
        if broker and bootstrap is None:  # none for the in-process measurements (--drift-micro)
            self.broker = LocalKafka(port=free_port(), data_dir=self.work / "kafka")
            self.broker.start(quiet=True)
            self.bootstrap = self.broker.bootstrap
        self.dataset = self.table.make_dataset(self.work)
        need = events + int(rate * seconds) + 2000
        self.events = list(event_values(self.table, need))
        self.n_throughput = events
        self.rate, self.seconds = rate, seconds
        self.key_file = self.work / "update.key"
        self.key_file.write_bytes(os.urandom(32).hex().encode())
        self.key_file.chmod(0o600)

    def featurizer(self):
        """The scorer's featurizer for this dataset (the demo preset's enrichment for the demo)."""
        from connectors.dataset import read_manifest
        from pipelines.stream.featurize import StreamFeaturizer

        manifest = read_manifest(self.dataset)
        enrichment = None
        preset = demo() if not self.table.input else None
        if preset is not None and preset.enrichment is not None:  # as --enrichment auto on the demo's dataset
            enrichment = preset.enrichment(demo_inputs(preset))()
        return StreamFeaturizer.from_manifest(manifest, enrichment)

    def close(self):
        from connectors.kafka import close_all_clients

        close_all_clients()
        if self.broker is not None:
            self.broker.stop(quiet=True)


def event_values(table, n: int):
    """``n`` raw events as JSON bytes: the demo's (its preset's replay events), or the input table's rows
    (repeated)."""
    if not table.input:
        source = (event for event, _key in hook(demo(), "replay", "serve")().rows)
        for i, e in enumerate(source):
            if i >= n:
                return
            yield json.dumps(e).encode()
        return
    from pipelines.stream.replay import read_files, table_events

    rows = [json.dumps(e).encode() for e in table_events(read_files(table.input))]
    for i in range(n):
        yield rows[i % len(rows)]


def topic_names() -> dict:
    tag = uuid.uuid4().hex[:6]
    return {"raw": f"braw-{tag}", "pred": f"bpred-{tag}", "dead": f"bdead-{tag}", "updates": f"bupd-{tag}",
            "group": f"bg-{tag}"}


def model_of(env: ServeEnv, seed: int):
    from flowtrain.train.models import Architecture

    model = Architecture.from_dict(ARCH, "bench").build(TabularDataset(env.dataset))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.eval()


def publish(env: ServeEnv, names: dict, version: int, work: Path) -> None:
    """A version as the online trainer publishes it: its file in published/, a signed record."""
    from connectors.kafka import KafkaDelivery, close_client, new_producer
    from connectors.model_updates import UpdateKeySource
    from flowtrain.train.published import Publisher

    record = Publisher(work / "trainer", key_source=UpdateKeySource.from_options(str(env.key_file))).publish(
        model=model_of(env, version).state_dict(), architecture=ARCH, version=version, step=version, run_id="bench",
        time=time.time())
    producer = new_producer(env.bootstrap)
    delivery = KafkaDelivery(producer, what="bench serve: publish")
    delivery.send(names["updates"], key=str(version).encode(), value=json.dumps(record).encode())
    delivery.confirm()  # a failed publish raises, never drops a version from the sample
    close_client(producer)


def produce(env: ServeEnv, topic: str, values: list[bytes], rate: float = 0.0) -> None:
    from connectors.kafka import KafkaDelivery, close_client, new_producer

    producer = new_producer(env.bootstrap, {"linger_ms": 5})
    delivery = KafkaDelivery(producer, what="bench serve: events")
    t0 = time.monotonic()
    for i, v in enumerate(values):
        delivery.send(topic, key=str(i % 97).encode(), value=v)
        if rate:
            ahead = (i + 1) / rate - (time.monotonic() - t0)
            if ahead > 0:
                time.sleep(ahead)
    delivery.confirm()  # every event acknowledged, or an error naming the Kafka failure
    close_client(producer)


def read_topic(bootstrap: str, topic: str) -> list:
    from kafka import KafkaConsumer, TopicPartition

    c = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, fetch_max_wait_ms=50,
                      max_partition_fetch_bytes=16 * 1024 * 1024)
    try:
        tps = [TopicPartition(topic, p) for p in sorted(topic_partitions(c, topic))]
        if not tps:
            return []
        ends = c.end_offsets(tps)
        c.assign(tps)
        c.seek_to_beginning()
        out = []
        while any(c.position(tp) < ends[tp] for tp in tps):
            for records in c.poll(timeout_ms=200).values():
                out += records
        return out
    finally:
        c.close()


def scored(env: ServeEnv, names: dict) -> tuple[list, int]:
    """(prediction messages with their decoded batches, dead letters)."""
    from connectors.arrow import decode_batch

    return [(m, decode_batch(m.value)) for m in read_topic(env.bootstrap, names["pred"])], \
        len(read_topic(env.bootstrap, names["dead"]))


def wait_all(env: ServeEnv, names: dict, n: int, proc, log: Path, timeout: float = 600) -> list:
    deadline = time.monotonic() + timeout
    while True:
        msgs, dead = scored(env, names)
        if sum(b.num_rows for _, b in msgs) + dead >= n:
            return msgs
        if proc.poll() is not None:
            raise RuntimeError(f"the scorer stopped:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"not every event scored after {timeout} s")
        time.sleep(0.5)


def start_scorer(env: ServeEnv, names: dict, out: Path, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        CLI + ["stream", "score", "--bootstrap", env.bootstrap, "--raw-topic", names["raw"], "--updates-topic",
               names["updates"], "--predictions-topic", names["pred"], "--score-dead-letter-topic", names["dead"],
               "--score-group-id", names["group"], "--dataset", env.dataset, "--out", str(out),
               "--update-key-file", str(env.key_file), *extra],
        stdout=open(out / "scorer.log", "ab"), stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def make_topics(env: ServeEnv, names: dict) -> None:
    from connectors.kafka import ensure_topic

    ensure_topic(env.bootstrap, names["raw"], partitions=2)
    ensure_topic(env.bootstrap, names["updates"])

"""Issue 30 item 7: one file checksum (``connectors.atomic.file_sha256``, used by checkpoints and bundles) and
one state-file reader (``LocalService._read_state``, used by the Kafka cluster too), each equal to the copies
they replaced."""
from __future__ import annotations

import hashlib
import json

from connectors.atomic import file_sha256
from flowtrain.local.kafka.cluster import LocalKafkaCluster
from flowtrain.local.service import LocalService
from flowtrain.train import bundle, checkpoint


def _old_sha256(path) -> str:  # the copy both modules had (the oracle)
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def test_one_sha256_equals_the_old_copies_and_both_modules_use_it(tmp_path):
    for size in (0, 1, (1 << 20) - 1, 1 << 20, (3 << 20) + 17):
        path = tmp_path / f"f{size}"
        path.write_bytes(bytes(range(256)) * (size // 256) + b"x" * (size % 256))
        assert file_sha256(path) == _old_sha256(path) == file_sha256(str(path))
    assert checkpoint.file_sha256 is file_sha256 and bundle.file_sha256 is file_sha256
    assert not hasattr(checkpoint, "_sha256") and not hasattr(bundle, "_sha256")


def test_one_read_state_the_kafka_cluster_reads_cluster_json_as_every_local_service(tmp_path):
    assert LocalKafkaCluster._read_state is LocalService._read_state
    cluster = LocalKafkaCluster(brokers=2, port=19092, data_dir=tmp_path / "c")
    assert cluster._read_state() is None  # no file yet
    cluster.data_dir.mkdir(parents=True)
    (cluster.data_dir / "cluster.json").write_text("{not json")
    assert cluster._read_state() is None  # a damaged file is no state, as before
    (cluster.data_dir / "cluster.json").write_text(json.dumps({"brokers": 2, "port": 19092, "cluster_id": "abc"}))
    assert cluster._read_state()["cluster_id"] == "abc"
    assert LocalKafkaCluster(brokers=2, port=19092, data_dir=tmp_path / "c").cluster_id == "abc"

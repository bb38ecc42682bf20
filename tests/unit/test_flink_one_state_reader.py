"""Issue 30 item 7 (task h5 item 4): the Flink cluster reads its ``cluster.json`` through ``LocalService`` as the
Kafka broker and cluster do: one ``_read_state``, no copy of its own."""
from __future__ import annotations

import json

import pytest

from flowtrain.local.flink import FlinkError, LocalFlink
from flowtrain.local.kafka.cluster import LocalKafkaCluster
from flowtrain.local.service import LocalService


def test_flink_reads_its_state_through_local_service_as_kafka_does(tmp_path):
    assert issubclass(LocalFlink, LocalService)
    assert LocalFlink._read_state is LocalService._read_state is LocalKafkaCluster._read_state
    assert "_read_state" not in vars(LocalFlink)  # no copy of its own
    cluster = LocalFlink(data_dir=tmp_path / "f")
    assert cluster.data_dir == (tmp_path / "f").resolve()
    assert cluster._state_path == cluster.data_dir / "cluster.json"
    assert cluster.read_state() is None and not cluster.running()  # no file yet
    cluster.data_dir.mkdir(parents=True)
    cluster._state_path.write_text("{not json")
    assert cluster.read_state() is None and not cluster.running()  # a damaged file is no state
    assert cluster.stop(quiet=True) is False
    record = {"complete": True, "role": "cluster", "job_endpoint": "127.0.0.1:8099", "rest": "http://127.0.0.1:8081",
              "processes": {"jobmanager": {"pid": 2 ** 22 + 7, "started": 1.0, "log": "x"}}}
    cluster._state_path.write_text(json.dumps(record))
    assert cluster.read_state()["job_endpoint"] == "127.0.0.1:8099"
    assert not cluster.running()  # the recorded process is not alive
    assert cluster.status()["processes"]["jobmanager"]["alive"] is False
    with pytest.raises(FlinkError, match="no local Flink cluster is running in"):
        cluster.beam_args()

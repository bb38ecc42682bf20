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


def test_only_a_cluster_whose_dead_processes_are_all_taskmanagers_is_healed_in_place(tmp_path):
    """``start`` starts dead TaskManagers again (the JobManager, job server, pool and jobs kept) only when every
    dead process is a TaskManager and the cluster was asked for as it runs; otherwise it is started anew (here
    checked without starting anything: ``_restart_dead_taskmanagers`` declines before any process starts). The
    restart itself is tested on the session's cluster (tests/integration/test_features_flink.py)."""
    import os

    from flowtrain.local.processes import start_time

    cluster = LocalFlink(data_dir=tmp_path / "f", taskmanagers=2, slots=1)
    cluster.data_dir.mkdir(parents=True)
    me = {"pid": os.getpid(), "started": start_time(os.getpid()), "log": "x"}
    dead = {"pid": 2 ** 22 + 7, "started": 1.0, "log": "x"}

    def declines(processes: dict, **fields) -> bool:
        cluster._state_path.write_text(json.dumps({"complete": True, "role": "cluster", "taskmanagers": 2,
                                                   "slots": 1, "jars": str(tmp_path), "processes": processes,
                                                   **fields}))
        return cluster._restart_dead_taskmanagers(timeout_s=1, quiet=True) is False

    assert declines({"jobmanager": me, "taskmanager-1": me})  # nothing dead: nothing to heal
    assert declines({"jobmanager": dead, "taskmanager-1": dead})  # the JobManager died too: started anew
    assert declines({"jobmanager": me, "taskmanager-1": dead}, slots=2)  # asked for another shape
    assert declines({"jobmanager": me, "taskmanager-1": dead}, complete=False)  # a start that never finished

"""A replicated Apache Kafka cluster on 127.0.0.1: N KRaft nodes, each broker and controller.

``LocalKafkaCluster(brokers=3)`` runs N combined broker+controller nodes (node ids 1..N) that form
one controller quorum (static voters), from the same Apache jars as ``LocalKafka``. Node ``i``
listens on ``port + 2*(i-1)`` (clients) and the port after it (controller); its data lives in
``data_dir/node-<i>``. Topics flowtrain creates get replication factor ``min(3, brokers)``
(``connectors.kafka.ensure_topic``); the cluster makes ``min.insync.replicas`` 2 (with 3 or more
brokers) and the same replication for topics created any other way and for Kafka's internal
topics (consumer offsets, transactions). So with ``acks=all`` a write is on at least two brokers
before it is acknowledged: one broker may die without losing an acknowledged record, and with
two down producers get an error (retried) instead of a write that could be lost.

A node is a ``LocalKafka`` (same start, stop, status, log and ``broker.json``), so one can be
stopped, killed and started again on its own; ``cluster.json`` in ``data_dir`` records the
layout for ``flowtrain kafka status/stop``.
"""
from __future__ import annotations

import json
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

from flowtrain.local.kafka.broker import KAFKA_VERSION, BrokerError, LocalKafka, new_cluster_id
from flowtrain.local.paths import cache_root
from flowtrain.local.service import LocalService


@dataclass
class ClusterNode(LocalKafka):
    """One node of a ``LocalKafkaCluster``: its own id, the cluster's voters and cluster id."""

    node_id: int = 1
    voters: str = ""
    cluster_id: str = ""
    replication: int = 1

    def _properties(self) -> str:
        rf, isr = str(self.replication), str(min(2, self.replication))
        props = super()._properties().splitlines()
        drop = {"controller.quorum.bootstrap.servers"}
        kept = [line for line in props if line.split("=", 1)[0] not in drop]
        overrides = {
            "node.id": str(self.node_id),
            "controller.quorum.voters": self.voters,
            "default.replication.factor": rf,
            "min.insync.replicas": isr,
            "offsets.topic.replication.factor": rf,
            "transaction.state.log.replication.factor": rf,
            "transaction.state.log.min.isr": isr,
            "share.coordinator.state.topic.replication.factor": rf,
            "share.coordinator.state.topic.min.isr": isr,
            "unclean.leader.election.enable": "false",
            **self.extra_config,
        }
        out = [line for line in kept if line.split("=", 1)[0] not in overrides]
        return "".join(f"{line}\n" for line in out) + "".join(f"{k}={v}\n" for k, v in overrides.items())

    def _format_if_needed(self, java: str, classpath: str) -> None:
        meta = self.data_dir / "logs" / "meta.properties"
        if meta.exists():
            return
        proc = subprocess.run(
            [java, "-cp", classpath, "kafka.tools.StorageTool", "format", "-t", self.cluster_id,
             "-c", str(self.data_dir / "server.properties")],
            capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise BrokerError(f"formatting KRaft storage in {self.data_dir} failed:\n{proc.stdout}{proc.stderr}")


@dataclass
class LocalKafkaCluster(LocalService):
    """``brokers`` KRaft nodes on 127.0.0.1 forming one cluster; ``nodes[i]`` is node id ``i + 1``. Its state
    file is ``cluster.json`` (read as every local service reads its own, ``LocalService._read_state``); the
    processes are the nodes'."""

    prefix = "kafka"
    noun = "cluster"
    state_file = "cluster.json"
    error = BrokerError

    brokers: int = 3
    port: int = 9092
    data_dir: Path = field(default_factory=lambda: cache_root() / "kafka-cluster")
    version: str = KAFKA_VERSION
    heap: str = "512m"
    extra_config: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.brokers < 1:
            raise BrokerError(f"--brokers must be at least 1, got {self.brokers}")
        super().__post_init__()
        state = self._read_state()
        if state and (state["brokers"] != self.brokers or state["port"] != self.port):
            raise BrokerError(f"{self.data_dir} holds a cluster of {state['brokers']} broker(s) on port "
                              f"{state['port']}; pass --brokers {state['brokers']} --port {state['port']} "
                              f"or a new --data-dir")
        cluster_id = state["cluster_id"] if state else new_cluster_id()
        ports = [self.port + 2 * i for i in range(self.brokers)]
        voters = ",".join(f"{i + 1}@127.0.0.1:{p + 1}" for i, p in enumerate(ports))
        self.cluster_id = cluster_id
        self.nodes = [ClusterNode(port=p, data_dir=self.data_dir / f"node-{i + 1}", version=self.version,
                                  heap=self.heap, extra_config=dict(self.extra_config), node_id=i + 1,
                                  voters=voters, cluster_id=cluster_id, replication=min(3, self.brokers))
                      for i, p in enumerate(ports)]

    @property
    def bootstrap(self) -> str:
        return ",".join(node.bootstrap for node in self.nodes)

    def node(self, node_id: int) -> ClusterNode:
        return self.nodes[node_id - 1]

    def status(self) -> dict:
        nodes = [node.status() | {"node_id": node.node_id} for node in self.nodes]
        return {"brokers": self.brokers, "running": sum(n["running"] for n in nodes), "bootstrap": self.bootstrap,
                "data_dir": str(self.data_dir), "cluster_id": self.cluster_id, "version": self.version,
                "nodes": nodes}

    def start(self, *, timeout_s: float = 120.0, quiet: bool = False) -> dict:
        """Start every node that is not running, together (a quorum needs a majority up before any
        node answers); return the status. Idempotent."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._state_path.write_text(json.dumps({"brokers": self.brokers, "port": self.port,
                                                "cluster_id": self.cluster_id, "version": self.version}))
        errors: dict[int, BaseException] = {}
        took: dict[int, float] = {}

        def start(node: ClusterNode) -> None:
            try:
                took[node.node_id] = node.start(timeout_s=timeout_s, quiet=True).get("start_seconds", 0.0)
            except BaseException as err:  # noqa: BLE001 - reported below, after every node is tried
                errors[node.node_id] = err

        threads = [threading.Thread(target=start, args=(node,), daemon=True) for node in self.nodes]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            self.stop(quiet=True)
            node_id, err = next(iter(sorted(errors.items())))
            raise BrokerError(f"node {node_id} of the {self.brokers}-broker cluster did not start: {err}")
        if not quiet:
            print(f"kafka: {self.brokers}-broker cluster {self.version} (KRaft, {self.brokers} controller voters, "
                  f"replication {min(3, self.brokers)}, min.insync.replicas {min(2, self.brokers)}) on "
                  f"{self.bootstrap} ({max(took.values(), default=0):.1f} s); data {self.data_dir}", flush=True)
        return self.status() | {"start_seconds": max(took.values(), default=0.0)}

    def stop(self, *, timeout_s: float = 30.0, quiet: bool = False) -> bool:
        """Stop every running node (SIGTERM, then SIGKILL after ``timeout_s``); False if none ran."""
        stopped = [node.stop(timeout_s=timeout_s, quiet=True) for node in reversed(self.nodes)]
        if not quiet:
            print(f"kafka: stopped {sum(stopped)} of {self.brokers} broker(s) of the cluster in {self.data_dir}"
                  if any(stopped) else f"kafka: no broker of the cluster in {self.data_dir} was running")
        return any(stopped)

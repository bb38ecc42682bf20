"""A real single-node Apache Kafka (KRaft) broker on 127.0.0.1, from the Apache jars.

The jars come from Maven Central through ``mvn dependency:copy-dependencies`` on the
``pom.xml`` beside this file, into ``<cache>/kafka/<version>/libs``. The broker runs as a
detached ``java`` process (so ``flowtrain kafka start`` can return) and leaves a
``broker.json`` in its data directory that ``status`` and ``stop`` read. The pid there is trusted
only while it is still that broker (its start time and command line,
:func:`flowtrain.local.processes.same_process`): a pid the kernel gave to another process since is
never signalled.
"""
from __future__ import annotations

import base64
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from kafka import KafkaAdminClient

from flowtrain.local.paths import cache_root
from flowtrain.local.service import LocalService
from flowtrain.local.tools import port_open, require_tool

KAFKA_VERSION = "4.3.1"
_HERE = Path(__file__).resolve().parent


def new_cluster_id() -> str:
    """A KRaft cluster id: a random UUID in URL-safe base64, never starting with '-'.

    Kafka's ``Uuid.randomUuid()`` skips ids that start with '-' because the command line
    would read ``-t -xyz...`` as an option; ``StorageTool format`` then fails (1 id in 64).
    """
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


class BrokerError(RuntimeError):
    """The broker could not be provisioned, started or stopped; the message says what to do."""


def ensure_jars(version: str = KAFKA_VERSION, *, quiet: bool = False) -> Path:
    """Resolve the broker jars once per machine; return the directory that holds them."""
    libs = cache_root() / "kafka" / version / "libs"
    marker = libs / ".complete"
    if marker.exists():
        return libs
    mvn = require_tool("mvn", "to fetch the Kafka broker jars from Maven Central",
                       "Install Apache Maven 3.8+ (Debian: `apt-get install maven`).", BrokerError)
    tmp = libs.with_name("libs.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = [mvn, "-B", "-q", "-f", str(_HERE / "pom.xml"), f"-Dkafka.version={version}",
           "dependency:copy-dependencies", f"-DoutputDirectory={tmp}", "-DincludeScope=runtime"]
    if not quiet:
        print(f"kafka: first use on this machine: resolving org.apache.kafka:kafka_2.13:{version} from Maven "
              f"Central into {libs} (once; ~40 s, 44 MB)", flush=True)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise BrokerError(f"mvn could not resolve the Kafka {version} jars:\n{proc.stdout[-2000:]}"
                          f"{proc.stderr[-2000:]}")
    shutil.rmtree(libs, ignore_errors=True)
    tmp.rename(libs)
    marker.write_text(version)
    if not quiet:
        print(f"kafka: broker jars ready in {time.monotonic() - t0:.0f} s", flush=True)
    return libs


def answers_metadata(bootstrap: str, timeout_s: float = 5.0) -> bool:
    """True when the broker answers a metadata request (not just an open socket)."""
    try:
        admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=int(timeout_s * 1000),
                                 bootstrap_timeout_ms=int(timeout_s * 1000))
    except Exception:  # noqa: BLE001 - any failure means "not ready yet"
        return False
    try:
        admin.describe_cluster()
        return True
    except Exception:  # noqa: BLE001
        return False
    finally:
        admin.close()


@dataclass
class LocalKafka(LocalService):
    """One KRaft broker+controller on 127.0.0.1 with its data in ``data_dir``."""

    prefix = "kafka"
    noun = "broker"
    state_file = "broker.json"
    log_file = "broker.log"
    error = BrokerError
    what = "the Kafka broker"
    not_ready = "did not answer a metadata request"
    start_timeout_s = 90.0

    port: int = 9092
    data_dir: Path = field(default_factory=lambda: cache_root() / "kafka-data")
    version: str = KAFKA_VERSION
    heap: str = "768m"
    extra_config: dict[str, str] = field(default_factory=dict)

    @property
    def controller_port(self) -> int:
        return self.port + 1

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    # -- state -------------------------------------------------------------------------
    @property
    def _marker(self) -> str:
        """What this broker's command line holds: its own server.properties."""
        return str(self.data_dir / "server.properties")

    def status(self) -> dict:
        state = self._read_state() or {}
        pid = self.running_pid()
        return {
            "running": pid is not None,
            "pid": pid,
            "bootstrap": state.get("bootstrap", self.bootstrap),
            "data_dir": str(self.data_dir),
            "log": str(self.log_path),
            "version": state.get("version", self.version),
            "answers_metadata": bool(pid) and answers_metadata(state.get("bootstrap", self.bootstrap), 3.0),
        }

    # -- config ------------------------------------------------------------------------
    def _properties(self) -> str:
        props = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.bootstrap.servers": f"127.0.0.1:{self.controller_port}",
            "listeners": f"PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            "inter.broker.listener.name": "PLAINTEXT",
            "log.dirs": str(self.data_dir / "logs"),
            "num.partitions": "1",
            "offsets.topic.replication.factor": "1",
            "offsets.topic.num.partitions": "3",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "transaction.state.log.num.partitions": "3",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "group.initial.rebalance.delay.ms": "0",
            "auto.create.topics.enable": "true",
            "log.retention.hours": "168",
        }
        props.update(self.extra_config)
        return "".join(f"{k}={v}\n" for k, v in props.items())

    def _format_if_needed(self, java: str, classpath: str) -> None:
        meta = self.data_dir / "logs" / "meta.properties"
        formatted_for = self.data_dir / "formatted_port"
        if meta.exists():
            if formatted_for.exists() and formatted_for.read_text().strip() != str(self.port):
                raise BrokerError(
                    f"{self.data_dir} holds a broker formatted for port {formatted_for.read_text().strip()}, "
                    f"not {self.port}; pass that --port or a new --data-dir")
            return
        cluster_id = new_cluster_id()
        proc = subprocess.run(
            [java, "-cp", classpath, "kafka.tools.StorageTool", "format", "--standalone",
             "-t", cluster_id, "-c", str(self.data_dir / "server.properties")],
            capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise BrokerError(f"formatting KRaft storage in {self.data_dir} failed:\n{proc.stdout}{proc.stderr}")
        formatted_for.write_text(str(self.port))

    # -- lifecycle ---------------------------------------------------------------------
    @property
    def _where(self) -> str:
        return f"on {self.bootstrap}"

    @property
    def _ports(self) -> tuple[int, ...]:
        return self.port, self.controller_port

    def _prepare(self, quiet: bool) -> tuple[list[str], dict]:
        java = self._java()
        libs = ensure_jars(self.version, quiet=quiet)
        classpath = str(libs / "*")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        (self.data_dir / "server.properties").write_text(self._properties())
        self._format_if_needed(java, classpath)
        cmd = [java, f"-Xmx{self.heap}", f"-Xms{self.heap}", "-XX:+UseG1GC", "-Djava.awt.headless=true",
               f"-Dlog4j2.configurationFile={_HERE / 'log4j2.properties'}",
               "-cp", classpath, "kafka.Kafka", str(self.data_dir / "server.properties")]
        return cmd, {"bootstrap": self.bootstrap, "port": self.port, "version": self.version, "jars": str(libs),
                     "log": str(self.log_path)}

    def _ready(self) -> bool:
        return port_open(self.port) and answers_metadata(self.bootstrap, 3.0)

    def _started(self, pid: int, took: float) -> str:
        jars = (self._read_state() or {}).get("jars")
        return (f"broker {self.version} started from jars in {jars} on {self.bootstrap} (pid {pid}, {took:.1f} s); "
                f"data {self.data_dir}")

    def stop(self, *, timeout_s: float = 30.0, quiet: bool = False) -> bool:
        """Stop the broker (SIGTERM, then SIGKILL after ``timeout_s``); False if none ran. Only the
        process ``broker.json`` records, while it still is that broker, is signalled."""
        state = self._stop_recorded(timeout_s, quiet)
        if state is not None and not quiet:
            print(f"kafka: stopped broker pid {state['pid']} on {self.bootstrap}")
        return state is not None

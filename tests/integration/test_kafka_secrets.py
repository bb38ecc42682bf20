"""Kafka credentials from a client properties file against a real SASL/PLAIN listener: `flowtrain replay`
and `flowtrain stream` (both halves, the trainer with --workers 2) authenticate with them, and the
password is found nowhere under --out, in no process's command line while the job runs, and in no
output; a wrong password is refused by the broker (the listener really checks)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.procs import stop_group

pytestmark = [pytest.mark.kafka, pytest.mark.streaming, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parent.parent.parent
CLI = [sys.executable, "-m", "flowtrain.cli"]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))
PASSWORD = "pw-" + os.urandom(8).hex()  # a value that cannot appear anywhere by chance


@pytest.fixture(scope="module")
def sasl_broker(tmp_path_factory):
    """A broker with a SASL_PLAINTEXT listener (mechanism PLAIN, user alice) beside its own PLAINTEXT one."""
    from flowtrain.local.kafka import LocalKafka
    from flowtrain.local.tools import free_port

    port = free_port()
    sasl_port = free_port()
    jaas = ('org.apache.kafka.common.security.plain.PlainLoginModule required username="admin" '
            f'password="admin-pw" user_admin="admin-pw" user_alice="{PASSWORD}";')
    broker = LocalKafka(port=port, data_dir=tmp_path_factory.mktemp("sasl-kafka"), extra_config={
        "listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{port + 1},"
                     f"SASL_PLAINTEXT://127.0.0.1:{sasl_port}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port},SASL_PLAINTEXT://127.0.0.1:{sasl_port}",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT",
        "sasl.enabled.mechanisms": "PLAIN",
        "listener.name.sasl_plaintext.plain.sasl.jaas.config": jaas})
    broker.start(timeout_s=120, quiet=True)
    try:
        yield f"127.0.0.1:{sasl_port}"
    finally:
        broker.stop(timeout_s=20, quiet=True)


@pytest.fixture(scope="module")
def flights_dataset(shared_data) -> str:
    return shared_data.flights(every=80)


def _properties(path: Path, password: str) -> Path:
    path.write_text("# as a Java client or kafka-console-producer --command-config takes it\n"
                    "security.protocol=SASL_PLAINTEXT\n"
                    "sasl.mechanism=PLAIN\n"
                    "sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required \\\n"
                    f'    username="alice" password="{password}";\n'
                    "client.id=flowtrain-secrets-test\n")
    path.chmod(0o600)  # it writes the password out: only its owner may read it
    return path


class _CmdlineWatch:
    """Reads every process's /proc/PID/cmdline while the job runs; remembers any that holds ``needle``."""

    def __init__(self, needle: bytes):
        self.needle, self.hits, self.scans = needle, [], 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for proc in Path("/proc").iterdir():
                if proc.name.isdigit():
                    try:
                        cmd = (proc / "cmdline").read_bytes()
                    except OSError:
                        continue
                    if self.needle in cmd:
                        self.hits.append(cmd.replace(b"\0", b" ").decode(errors="replace"))
            self.scans += 1
            self._stop.wait(0.2)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=10)


def _files_holding(root: Path, needle: bytes) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and needle in p.read_bytes()]


def test_a_wrong_password_is_refused_and_the_right_one_authenticates(sasl_broker, tmp_path):
    wrong = _properties(tmp_path / "wrong.properties", "not-the-password")
    refused = subprocess.run(CLI + ["replay", "--bootstrap", sasl_broker, "--kafka-config-file", str(wrong),
                                    "--topic", "sasl-probe", "--limit", "5", "--connect-timeout", "15"],
                             capture_output=True, text=True, timeout=180, env=ENV)
    assert refused.returncode != 0, refused.stdout[-2000:]
    good = _properties(tmp_path / "client.properties", PASSWORD)
    ok = subprocess.run(CLI + ["replay", "--bootstrap", sasl_broker, "--kafka-config-file", str(good),
                               "--topic", "sasl-probe", "--limit", "5"], capture_output=True, text=True, timeout=180,
                        env=ENV)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert PASSWORD not in ok.stdout + ok.stderr


def test_a_sasl_password_given_by_file_is_nowhere_under_out_in_no_command_line_and_no_log(sasl_broker,
                                                                                         flights_dataset, tmp_path):
    props = _properties(tmp_path / "client.properties", PASSWORD)
    raw = f"raw-{os.getpid()}-{time.monotonic_ns()}"
    common = ["--bootstrap", sasl_broker, "--kafka-config-file", str(props)]
    replay = subprocess.run(CLI + ["replay", *common, "--topic", raw, "--partitions", "2", "--limit", "300"],
                            capture_output=True, text=True, timeout=240, env=ENV)
    assert replay.returncode == 0, replay.stderr[-3000:]
    out = tmp_path / "run"
    argv = CLI + ["stream", *common, "--raw-topic", raw, "--features-topic", f"{raw}-features",
                  "--dead-letter-topic", f"{raw}-dead", "--updates-topic", f"{raw}-updates", "--group-id",
                  f"{raw}-group", "--dataset", flights_dataset, "--out", str(out), "--batch-size", "100",
                  "--workers", "2", "--checkpoint-every", "2", "--failure-timeout", "120"]
    with _CmdlineWatch(PASSWORD.encode()) as watch:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV,
                                start_new_session=True)
        printed = []
        reader = threading.Thread(target=lambda: printed.extend(proc.stdout), daemon=True)
        reader.start()
        try:
            deadline = time.monotonic() + 400
            status = {}
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    status = json.loads((out / "trainer-status.json").read_text())
                except (OSError, ValueError):
                    status = {}
                if status.get("version", 0) >= 1 and (out / "workers" / "job.json").exists():
                    break
                time.sleep(0.5)
            assert status.get("version", 0) >= 1, (proc.poll(), "".join(printed)[-3000:],
                                                    (out / "trainer.log").read_text()[-3000:]
                                                    if (out / "trainer.log").exists() else "")
            stop_group(proc, signal.SIGINT, timeout=120)
        finally:
            stop_group(proc, signal.SIGKILL, timeout=10)
        reader.join(timeout=10)
    assert watch.scans > 10 and watch.hits == [], watch.hits
    output = "".join(printed)
    assert "stream: stopped" in output, output[-3000:]
    assert PASSWORD not in output
    assert status["rows"] > 0  # the trainer read features through the SASL listener with the file's password
    job = (out / "workers" / "job.json").read_text()
    assert "sasl_plain_username" in job and "sasl_plain_password" not in job  # the replicas got it otherwise
    assert _files_holding(out, PASSWORD.encode()) == []
    assert {p.name for p in out.iterdir()} >= {"pipeline.log", "trainer.log", "workers", "checkpoints"}

"""Data parallelism across two hosts: ``flowtrain batch --job-only``, then torchrun on each namespace host.

The dataset and run directory are in a tmp directory both hosts see (the shared filesystem). The two-host
run trains the same parameters as one process; gloo talks on each host's own LAN address; killing every
process of host 1 mid-run ends host 0's job within ``--failure-timeout``, naming the lost rank and host.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from flowtrain.cli.main import main
from tests.synthetic_data import make_regression_run

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
TARGET = "flowtrain.train.jobs:train_worker"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    return make_regression_run(tmp_path_factory.mktemp("synthetic"), epochs=1)[0]


def _batch(dataset: str, out: Path, *extra: str) -> list[str]:
    return ["batch", "--dataset", dataset, "--out", str(out), "--no-progress", "--dropout", "0",
            "--batch-size", "128", "--threads", "1", "--hidden", "16,8", *extra]


def _torchrun(lan, k: int, job: Path, log: Path) -> subprocess.Popen:
    """torchrun on host ``k`` exactly as docs/parallelism.md prints it; no GLOO_SOCKET_IFNAME is given."""
    env = {key: v for key, v in os.environ.items() if not key.endswith("_SOCKET_IFNAME")}
    env.update(PYTHONPATH=str(ROOT), FLOWTRAIN_THREADS="1", OMP_NUM_THREADS="1")
    return lan.popen(k, [TORCHRUN, "--nnodes=2", "--nproc-per-node=1", f"--node-rank={k}",
                         f"--master-addr={lan.addresses[0]}", "--master-port=29500",
                         "-m", "flowtrain.parallel.worker", TARGET, str(job)],
                     env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def _workers(lan, k: int) -> set[int]:
    """pids of the flowtrain workers (not torchrun's agent) on host ``k``."""
    pids = set()
    for pid in lan.pids(k):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"flowtrain.parallel.worker" in cmd and b"torchrun" not in cmd:
            pids.add(pid)
    return pids


def _gloo_sockets(lan, k: int) -> tuple[list, list]:
    """(listening, established) TCP sockets of host ``k``'s worker processes, torchrun's store excluded."""
    pids = {f"pid={p}," for p in _workers(lan, k)}
    listening = [s for s in lan.listening(k) if any(p in s[2] for p in pids)]
    connected = [s for s in lan.connected(k) if any(p in s[4] for p in pids) and 29500 not in (s[1], s[3])]
    return listening, connected


def _wait_all(procs, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))


@pytest.mark.timeout(600)
def test_two_hosts_train_one_process_parameters_on_their_own_addresses_then_resume_writes_the_report(
        make_hosts, dataset, tmp_path, capsys):
    reference = tmp_path / "one-process"
    assert main(_batch(dataset, reference, "--epochs", "3", "--patience", "10")) == 0
    run = tmp_path / "shared" / "run"  # the shared filesystem: both hosts see tmp_path
    assert main(_batch(dataset, run, "--epochs", "3", "--patience", "10", "--workers", "2", "--job-only")) == 0
    printed = capsys.readouterr().out
    lan = make_hosts(2)
    procs = [_torchrun(lan, k, run / "job.json", tmp_path / f"host{k}.log") for k in range(2)]
    seen: dict[int, tuple[list, list]] = {}
    deadline = time.monotonic() + 400
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        for k in range(2):
            if k not in seen:
                listening, connected = _gloo_sockets(lan, k)
                if listening and connected:
                    seen[k] = (listening, connected)
        time.sleep(0.2)
    _wait_all(procs, 30)
    logs = [(tmp_path / f"host{k}.log").read_text(errors="replace") for k in range(2)]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-3000:] for log in logs)
    # gloo listened and connected on each host's own LAN address: not 0.0.0.0, not loopback
    assert sorted(seen) == [0, 1], f"no gloo socket of a worker was seen: {seen}"
    for k, (listening, connected) in seen.items():
        other = lan.addresses[1 - k]
        assert {addr for addr, _, _ in listening} == {lan.addresses[k]}, (k, listening)
        assert {(la, pa) for la, _, pa, _, _ in connected} == {(lan.addresses[k], other)}, (k, connected)
    # the same parameters as one process
    one = torch.load(reference / "model.pt", weights_only=True)
    two = torch.load(run / "model.pt", weights_only=True)
    assert one.keys() == two.keys()
    diff = max((one[name].double() - two[name].double()).abs().max().item() for name in one)
    assert diff <= 1e-5, f"two hosts differ from one process by {diff:.3g}"
    trained = json.loads((run / "fit.json").read_text())
    # the report step --job-only printed: it trains nothing more and writes the report
    report = next(line for line in printed.splitlines() if "then the report:" in line)
    argv = shlex.split(report.split("then the report:", 1)[1])
    assert argv[0] == "flowtrain"
    assert main(argv[1:] + ["--no-progress"]) == 0
    assert (run / "report.md").exists()
    assert json.loads((run / "fit.json").read_text())["steps"] == trained["steps"]


@pytest.mark.timeout(600)
def test_killing_every_process_of_host_1_ends_host_0_within_the_failure_timeout_naming_rank_and_host(
        make_hosts, dataset, tmp_path):
    failure_timeout = 30
    run = tmp_path / "shared" / "run"
    assert main(_batch(dataset, run, "--epochs", "400", "--patience", "1000", "--workers", "2", "--job-only",
                       "--failure-timeout", str(failure_timeout))) == 0
    assert json.loads((run / "job.json").read_text())["failure_timeout_s"] == failure_timeout
    lan = make_hosts(2)
    logs = [tmp_path / f"host{k}.log" for k in range(2)]
    procs = [_torchrun(lan, k, run / "job.json", logs[k]) for k in range(2)]
    deadline = time.monotonic() + 300
    while not list((run / "checkpoints").glob("*")) and time.monotonic() < deadline:  # training is under way
        assert all(p.poll() is None for p in procs), "\n".join(log.read_text()[-3000:] for log in logs)
        time.sleep(0.2)
    assert list((run / "checkpoints").glob("*")), "no checkpoint within 300 s"
    assert _workers(lan, 0) and _workers(lan, 1)
    killed_at = time.monotonic()
    assert lan.kill_host(1)  # torchrun's agent and the worker of host 1, all at once (SIGKILL)
    procs[0].wait(timeout=failure_timeout + 60)
    took = time.monotonic() - killed_at
    host0 = logs[0].read_text(errors="replace")
    assert procs[0].returncode != 0, host0[-3000:]
    assert took <= failure_timeout, f"host 0 ended {took:.1f} s after host 1 died (bound {failure_timeout} s)"
    line = next((x for x in host0.splitlines() if x.startswith("flowtrain worker rank 0 failed")), None)
    assert line is not None, host0[-3000:]
    assert "lost rank 1 on host " in line and f"({lan.addresses[1]})" in line, line
    assert not _workers(lan, 0)
    print(f"host 0 ended {took:.2f} s after every process of host 1 was killed: {line[:200]}")

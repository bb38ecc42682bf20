"""Restarts across hosts: torchrun's elastic agent (``--max-restarts``, c10d rendezvous) on two namespace hosts.

A worker of host 1 is killed -9 at a random step, twice; each time the group restarts from the run's last
checkpoint (``TORCHELASTIC_RESTART_COUNT`` > 0 makes ``train_worker`` resume) and the final parameters equal
an uninterrupted one-process run's.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from flowtrain.cli.main import main
from tests.multihost.test_torchrun_hosts import _batch, _workers
from tests.synthetic_data import make_regression_run

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    return make_regression_run(tmp_path_factory.mktemp("synthetic"), epochs=1, rows=3000)[0]


def _elastic(lan, k: int, job: Path, log: Path, restarts: int) -> subprocess.Popen:
    env = {key: v for key, v in os.environ.items() if not key.endswith("_SOCKET_IFNAME")}
    # each round's rank 0 serves a fresh store: torchrun's shared one keeps dead workers' addresses (restart_hazard)
    env.update(PYTHONPATH=str(ROOT), FLOWTRAIN_THREADS="1", OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    return lan.popen(k, [TORCHRUN, "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
                         f"--rdzv-endpoint={lan.addresses[0]}:29400", f"--rdzv-id=ft-{lan.id}",
                         # host 0 serves the rendezvous store (torchrun cannot tell by its hostname here)
                         f"--rdzv-conf=is_host={int(k == 0)}", f"--local-addr={lan.addresses[k]}",
                         f"--max-restarts={restarts}", "--monitor-interval=0.5",
                         "-m", "flowtrain.parallel.worker", "flowtrain.train.jobs:train_worker", str(job)],
                     env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def _newest(run: Path) -> int:
    """The step of the run's newest checkpoint (0: none yet)."""
    names = [p.stem.split("-")[1] for p in (run / "checkpoints").glob("ckpt-*.pt")]
    return max((int(n) for n in names if n.isdigit()), default=0)


def _after_checkpoints(run: Path, count: int, procs, logs, timeout: float = 400) -> int:
    """Wait for ``count`` newer checkpoints; returns the newest step."""
    step, seen = _newest(run), 0
    deadline = time.monotonic() + timeout
    while seen < count:
        assert time.monotonic() < deadline, f"{count} new checkpoint(s) not within {timeout} s"
        assert all(p.poll() is None for p in procs), "\n".join(x.read_text()[-3000:] for x in logs)
        if _newest(run) != step:
            step, seen = _newest(run), seen + 1
        time.sleep(0.05)
    return step


@pytest.mark.timeout(900)
def test_a_worker_killed_twice_restarts_from_the_checkpoint_and_ends_with_the_uninterrupted_parameters(
        make_hosts, dataset, tmp_path, say):
    common = ("--epochs", "40", "--patience", "1000", "--batch-size", "64")
    reference = tmp_path / "one-process"
    assert main(_batch(dataset, reference, *common)) == 0
    run = tmp_path / "shared" / "run"
    assert main(_batch(dataset, run, *common, "--workers", "2", "--job-only", "--failure-timeout", "30")) == 0
    lan = make_hosts(2)
    logs = [tmp_path / f"host{k}.log" for k in range(2)]
    # two kills; headroom for restarted rounds that fail to connect and restart again (seen: three in a row after a
    # kill, each agent re-rendezvousing while the other's new worker was still starting)
    procs = [_elastic(lan, k, run / "job.json", logs[k], restarts=8) for k in range(2)]
    rng = random.Random(7)
    costs = []
    try:
        for _ in range(2):
            _after_checkpoints(run, rng.randint(1, 3), procs, logs)
            time.sleep(rng.random())  # a random point between checkpoints
            [victim] = _workers(lan, 1)
            killed = time.monotonic()
            os.kill(victim, 9)
            # torchrun restarts the group: a new worker on host 1 (rank 0 may still finish a checkpoint it had begun
            # before it notices the loss, so a newer checkpoint alone does not say the group restarted) ...
            deadline = time.monotonic() + 300
            while not _workers(lan, 1) - {victim}:
                assert time.monotonic() < deadline, "host 1's worker was not restarted within 300 s"
                assert all(p.poll() is None for p in procs), "\n".join(x.read_text()[-3000:] for x in logs)
                time.sleep(0.05)
            _after_checkpoints(run, 1, procs, logs, timeout=300)  # ... that resumed and checkpointed again
            costs.append(time.monotonic() - killed)
        for proc in procs:
            proc.wait(timeout=600)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    host0 = logs[0].read_text(errors="replace")
    assert [p.returncode for p in procs] == [0, 0], host0[-3000:] + logs[1].read_text()[-3000:]
    assert host0.count("resumed from ckpt-") >= 2, host0[-3000:]  # restarted from checkpoints, not from scratch
    host1 = logs[1].read_text(errors="replace")
    # a fresh store per round: no restarted round reads a dead worker's address (the shared store's failure mode)
    stale = sum(log.count("connectFullMesh failed") for log in (host0, host1))
    assert stale == 0, host1[-3000:]
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in host0  # the worker's warning is for the shared store only
    one = torch.load(reference / "model.pt", weights_only=True)
    two = torch.load(run / "model.pt", weights_only=True)
    diff = max((one[k].double() - two[k].double()).abs().max().item() for k in one)
    assert diff <= 1e-5, f"restarted twice, the parameters differ from one process by {diff:.3g}"
    say(f"\ntorchrun --max-restarts 8 across 2 hosts: worker of host 1 killed -9 twice; kill -> restarted and "
        f"checkpointed again in {', '.join(f'{c:.1f}' for c in costs)} s; final parameters within {diff:.2g}")

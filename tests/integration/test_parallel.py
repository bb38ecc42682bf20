"""Data parallelism: map/reduce equals one device, torchrun, failures, resume with other N."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from flowtrain.local.tools import free_port
from flowtrain.parallel import shard_bounds
from flowtrain.parallel.launch import WorkerFailure, spawn
from tests.dp_jobs import reference
from tests.procs import worker_pids as _worker_pids

ROOT = Path(__file__).resolve().parents[2]  # the repository
ENV = {"PYTHONPATH": str(ROOT)}
pytestmark = pytest.mark.timeout(300)


def test_shard_bounds_cover_every_row_once():
    for n in (0, 1, 5, 7, 64):
        for world in (1, 2, 3, 5):
            spans = [shard_bounds(n, r, world) for r in range(world)]
            assert spans[0][0] == 0 and spans[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            sizes = [hi - lo for lo, hi in spans]
            assert max(sizes) - min(sizes) <= 1


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_map_reduce_equals_single_process(tmp_path, world, optimizer):
    out = tmp_path / "params.pt"
    spawn(world, "tests.dp_jobs:equivalence_job", {"steps": 20, "optimizer": optimizer, "out": str(out)},
          failure_timeout_s=60, workdir=tmp_path / "w", extra_env=ENV)
    got = torch.load(out, weights_only=True)
    want = reference(20, world, optimizer).state_dict()
    assert _max_diff(got, want) <= 1e-5
    # the parameter that never gets a gradient is untouched (the optimizer skipped it)
    assert torch.equal(got["unused.weight"], want["unused.weight"])


def test_torchrun_two_nodes_equals_spawned_run(tmp_path):
    job = {"steps": 20, "optimizer": "adam", "failure_timeout_s": 60}
    spawned = tmp_path / "spawned.pt"
    spawn(2, "tests.dp_jobs:equivalence_job", {**job, "out": str(spawned)}, workdir=tmp_path / "w", extra_env=ENV)
    job_path = tmp_path / "job.json"
    job_path.write_text(json.dumps({**job, "out": str(tmp_path / "torchrun.pt")}))
    # Loopback only: the agents' store and gloo's sockets on 127.0.0.1, a port below the
    # ephemeral range (no client socket can hold it). A rendezvous that does not complete in
    # 90 s is tried once more on a new port (seen once in a full CI run: torchrun hung with no
    # output); the equality below is asserted either way.
    env = dict(os.environ, **ENV, FLOWTRAIN_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    failures = []
    for _attempt in range(2):
        port = free_port()
        nodes = [subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
             f"--node-rank={rank}", "--master-addr=127.0.0.1", f"--master-port={port}", "--local-addr=127.0.0.1",
             "-m", "flowtrain.parallel.worker", "tests.dp_jobs:equivalence_job", str(job_path)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True) for rank in range(2)]
        try:
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline and any(p.poll() is None for p in nodes):
                time.sleep(0.2)
        finally:
            for p in nodes:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
        outs = [p.communicate(timeout=30)[0].decode(errors="replace") for p in nodes]
        if all(p.returncode == 0 for p in nodes):
            break
        failures.append(outs)
    else:
        raise AssertionError(f"torchrun failed twice: {failures}")
    a = torch.load(spawned, weights_only=True)
    b = torch.load(tmp_path / "torchrun.pt", weights_only=True)
    assert _max_diff(a, b) <= 1e-6
    assert _max_diff(b, reference(20, 2, "adam").state_dict()) <= 1e-5


def test_a_worker_that_raises_ends_the_job_naming_its_rank(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(WorkerFailure) as err:
        spawn(2, "tests.dp_jobs:equivalence_job", {"steps": 10, "optimizer": "sgd", "out": str(tmp_path / "x"),
                                                   "fail": [1, 3]},
              failure_timeout_s=30, workdir=tmp_path / "w", extra_env=ENV)
    assert err.value.rank == 1 and "worker rank 1 exited with code 1" in str(err.value)
    assert "injected failure at step 3" in str(err.value)
    assert time.monotonic() - t0 < 30


@pytest.fixture(scope="module")
def small_dataset(shared_data) -> str:
    return shared_data.flights(every=40)


def _batch_cli(*args):
    return [sys.executable, "-m", "flowtrain.cli", "batch", "--no-progress", *args]


def test_sigkill_of_a_worker_ends_the_job_within_the_bound(small_dataset, tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen(_batch_cli("--dataset", small_dataset, "--out", str(run), "--workers", "2",
                                       "--epochs", "200", "--patience", "1000", "--batch-size", "64",
                                       "--failure-timeout", "30"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    job_path = str(run / "workers" / "job.json")
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (run / "workers" / "heartbeats" / "rank-1.beat").exists():
            time.sleep(0.2)
        pids = _worker_pids(job_path)
        assert set(pids) == {0, 1}, f"workers not found: {pids}"
        killed_at = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        _, stderr = proc.communicate(timeout=90)
        took = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert "worker rank 1 was killed by SIGKILL" in stderr
    assert took < 30
    time.sleep(0.5)
    assert _worker_pids(job_path) == {}


def test_resume_with_a_different_worker_count(small_dataset, tmp_path):
    common = ["--dataset", small_dataset, "--dropout", "0", "--batch-size", "256", "--patience", "100",
              "--device", "cpu", "--decay-steps", "400"]  # one schedule for the 2- and the 4-epoch budget
    full = subprocess.run(_batch_cli(*common, "--out", str(tmp_path / "full"), "--workers", "2", "--epochs", "4"),
                          capture_output=True, text=True, timeout=240)
    assert full.returncode == 0, full.stderr[-2000:]
    part = subprocess.run(_batch_cli(*common, "--out", str(tmp_path / "part"), "--workers", "2", "--epochs", "2"),
                          capture_output=True, text=True, timeout=240)
    assert part.returncode == 0, part.stderr[-2000:]
    resumed = subprocess.run(_batch_cli(*common, "--out", str(tmp_path / "part"), "--workers", "3", "--epochs", "4",
                                        "--resume"), capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a = json.loads((tmp_path / "full" / "summary.json").read_text())
    b = json.loads((tmp_path / "part" / "summary.json").read_text())
    assert a["training"]["steps"] == b["training"]["steps"]
    assert abs(a["test"]["model"]["loss"] - b["test"]["model"]["loss"]) < 1e-5
    wa = torch.load(tmp_path / "full" / "model.pt", weights_only=True)
    wb = torch.load(tmp_path / "part" / "model.pt", weights_only=True)
    assert _max_diff(wa, wb) <= 1e-5

"""The online trainer with ZeRO (issue 31: `flowtrain stream train --workers 2 --shard-states parameters`, real
Kafka, real torch.distributed gloo): its checkpoints are sharded (one file per rank); killed with SIGKILL
mid-stream and restarted from them, it trains every row exactly once and ends with the parameters of a
one-process run on the same feature messages."""
from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
import torch

from tests.integration.test_stream_trainer import _exactly_once, _status_step
from tests.integration.test_stream_trainer_grid import (  # noqa: F401 - features: the module's fixture, reused
    ENV,
    _argv,
    _assert_equal_models,
    _run,
    _send,
    features,
)
from tests.procs import worker_pids

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(360)]


def test_stream_shard_states_two_workers_sigkill_restart_exactly_once_equals_one_process(features, bootstrap,  # noqa: F811
                                                                                          new_topic, tmp_path):
    """--workers 2 --shard-states parameters (ZeRO-3): rank 1 (it reads no partition; it holds half of the
    parameters and of the Adam state) is killed with SIGKILL mid-stream; the restart resumes from the last
    checkpoint, trains every row once and ends where the uninterrupted one-process run ended (1e-9 in float64)."""
    dataset, messages = features["dataset"], features["messages"]
    topic = new_topic(partitions=1)
    first, rest = messages[:8], messages[8:]
    sources = _send(bootstrap, topic, first)
    out = tmp_path / "crashed"
    argv = _argv(bootstrap, topic, dataset, out, "--workers", "2", "--shard-states", "parameters")
    run = subprocess.Popen(argv + ["--idle-exit", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=ENV, start_new_session=True)
    job_path = str(out / "workers" / "job.json")
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and _status_step(out) < 4 and run.poll() is None:
            time.sleep(0.05)
        pids = worker_pids(job_path)
        assert set(pids) == {0, 1}, f"processes not found ({pids}); {run.poll()}"
        os.kill(pids[1], signal.SIGKILL)
        _, err = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait(timeout=10)
    assert run.returncode != 0 and "worker rank 1 was killed by SIGKILL" in err, err[-3000:]
    # its checkpoints are sharded: one file per rank (DCP), the positions in the small file written last
    newest = sorted((out / "checkpoints").glob("ckpt-*.pt"))[-1]
    assert {p.name for p in newest.with_suffix(".dcp").iterdir()} == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    small = torch.load(newest, weights_only=True)
    assert "model" not in small and small["positions"]

    sources |= _send(bootstrap, topic, rest)
    again = _run(argv + ["--idle-exit", "3"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from ckpt-" in again.stdout
    assert "--shard-states parameters with one worker" not in again.stdout  # sharded over 2, not a no-op
    _exactly_once(out, sources)
    # the checkpoints hold shards: the final model whole is the version published last
    final = torch.load(sorted((out / "published").glob("ckpt-*.pt"))[-1], weights_only=True)
    assert final["step"] == features["steps"]
    _assert_equal_models(final["model"], features["reference"])

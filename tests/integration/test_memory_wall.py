"""The memory wall, shown (#31 item 5): a model whose Adam state does not fit one capped worker trains, under
the same cap, on four workers with ``--shard-states parameters`` to the parameters of an uncapped one-process run.

Size (runs in about two to three minutes here): a wide & deep model (``tests.memory_wall_jobs.WideDeep``) with
four ID tables of 300,000 x 64, hidden layers of 4,096 and a wide part over the IDs: 96 M parameters, 0.36 GiB
of parameters, 1.43 GiB of parameters + gradients + Adam state on one device; a worker's fixed overhead (the
interpreter, torch, gloo) is about 0.5 GiB. The cap, 1.5 GiB per worker, is enforced on each worker
(``flowtrain.parallel.memcap``: RLIMIT_AS here, cgroup v2 memory.max where delegated):

- one worker: the plan stops it before training in one line naming the smallest layout that fits; and a worker
  that trains anyway under the cap ends with one line naming the cap (the wall is real, not only planned);
- four workers, ZeRO-3: each holds a quarter of the state plus one gathered layer, trains 4 steps of a global
  batch of 512 under the cap, and each rank's shards assembled equal the one-process run's parameters <= 1e-5.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from flowtrain.parallel.launch import WorkerFailure, spawn
from flowtrain.train.memory_plan import fits_line, plan_memory, worker_overhead_bytes
from tests.memory_wall_jobs import assemble, build, reference

ROOT = Path(__file__).resolve().parents[2]
ENV = {"PYTHONPATH": str(ROOT)}
SHAPE = {"vocab": 300_000, "dim": 64, "hidden": 4096, "batch": 512, "steps": 4}
CAP = int(1.5 * 2**30)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_memory_wall_four_sharded_workers_train_what_one_capped_worker_cannot(tmp_path):
    overhead = worker_overhead_bytes()  # before any model: what every worker loads first
    model = build(SHAPE)
    params = sum(p.numel() for p in model.parameters())
    assert 90e6 < params < 100e6
    one = plan_memory(model, workers=1, batch_size=SHAPE["batch"])
    assert one.parameters + one.gradients + one.optimizer > CAP - overhead  # Adam's state alone does not fit
    line = fits_line(one, model, CAP, batch_size=SHAPE["batch"], overhead=overhead)
    assert line is not None and "\n" not in line
    assert line.startswith("does not fit --worker-memory 1.50 GiB: --workers 1 needs ") and "--shard-states" in line
    four = plan_memory(model, workers=4, shard_states="parameters", batch_size=SHAPE["batch"])
    assert fits_line(four, model, CAP, batch_size=SHAPE["batch"], overhead=overhead) is None
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    del model

    # one worker that trains anyway: the cap stops it, in one line
    with pytest.raises(WorkerFailure) as failed:
        spawn(1, "tests.memory_wall_jobs:train_job", {"shape": SHAPE, "stage": "none", "out": str(tmp_path / "one")},
              failure_timeout_s=120, workdir=tmp_path / "w1", extra_env=ENV, memory_cap=CAP)
    assert "\n" not in str(failed.value)
    assert str(failed.value).startswith("worker rank 0 exceeded its memory cap, --worker-memory 1.50 GiB enforced by")

    # four workers, ZeRO-3, the same cap: they train
    out = tmp_path / "four"
    spawn(4, "tests.memory_wall_jobs:train_job", {"shape": SHAPE, "stage": "parameters", "out": str(out)},
          failure_timeout_s=120, workdir=tmp_path / "w4", extra_env=ENV, threads_per_worker=1, memory_cap=CAP)
    got = assemble(str(out), 4, shapes)
    want = reference(SHAPE)  # the uncapped one-process run
    assert set(got) == set(want)
    diff = max(float((got[k] - want[k]).abs().max()) for k in want)
    assert diff <= 1e-5, diff
    moved = max(float((want[k] - v).abs().max()) for k, v in build(SHAPE).state_dict().items())
    assert moved > 5e-5  # it trained (4 Adam steps of lr 1e-4)

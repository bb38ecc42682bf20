"""Pipeline parallelism: schedules as data, the validator, stage plans, execution, hybrid."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowtrain.parallel.launch import WorkerFailure, spawn
from flowtrain.parallel.schedules import (
    ScheduleError,
    add_communication,
    format_schedule,
    gpipe,
    one_f_one_b,
    parse_schedule,
    peak_in_flight,
    validate,
)
from flowtrain.parallel.stages import merge_stage_states, partition, plan_stages
from tests.pp_jobs import build_model, reference

ROOT = Path(__file__).resolve().parents[2]  # the repository
ENV = {"PYTHONPATH": str(ROOT)}


def test_gpipe_and_1f1b_as_strings():
    assert format_schedule(gpipe(2, 4)) == ("stage 0: F0 F1 F2 F3 B0 B1 B2 B3\n"
                                            "stage 1: F0 F1 F2 F3 B0 B1 B2 B3")
    assert format_schedule(one_f_one_b(2, 4)) == ("stage 0: F0 F1 B0 F2 B1 F3 B2 B3\n"
                                                  "stage 1: F0 B0 F1 B1 F2 B2 F3 B3")
    assert format_schedule(one_f_one_b(3, 4)) == ("stage 0: F0 F1 F2 B0 F3 B1 B2 B3\n"
                                                  "stage 1: F0 F1 B0 F2 B1 F3 B2 B3\n"
                                                  "stage 2: F0 B0 F1 B1 F2 B2 F3 B3")
    assert format_schedule(one_f_one_b(4, 1)) == "\n".join(f"stage {s}: F0 B0" for s in range(4))
    assert format_schedule(add_communication(one_f_one_b(2, 2))) == (
        "stage 0: F0 sF0 F1 sF1 rB0 B0 rB1 B1\n"
        "stage 1: rF0 F0 B0 sB0 rF1 F1 B1 sB1")


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("micro", [1, 4, 8])
def test_schedules_are_complete_deadlock_free_and_round_trip(stages, micro):
    for make in (gpipe, one_f_one_b):
        schedule = make(stages, micro)
        validate(schedule, micro)
        program = add_communication(schedule)
        validate(program, micro)
        assert parse_schedule(format_schedule(program)) == program
    assert peak_in_flight(gpipe(stages, micro)[0]) == micro
    assert peak_in_flight(one_f_one_b(stages, micro)[0]) == min(stages, micro)


def test_validator_rejects_a_missing_backward_and_a_deadlock():
    missing = gpipe(2, 4)
    missing[1] = [a for a in missing[1] if str(a) != "B2"]
    with pytest.raises(ScheduleError, match="stage 1 is incomplete: B of micro-batch.*2.*missing"):
        validate(missing, 4)
    # stage 0 waits for B0's gradient before it has sent F0's activations: nobody can move
    deadlock = parse_schedule("stage 0: F0 rB0 sF0 B0\nstage 1: rF0 F0 B0 sB0")
    with pytest.raises(ScheduleError, match="deadlock") as err:
        validate(deadlock, 1)
    assert ">>rB0<<" in str(err.value)


def test_partition_balances_and_plan_table():
    assert partition([1, 1, 1, 1], 2) == [(0, 2), (2, 4)]
    assert partition([5, 1, 1, 1, 1, 1], 2) == [(0, 1), (1, 6)]
    assert partition([1, 2, 3, 4, 5, 6], 3) == [(0, 3), (3, 5), (5, 6)]
    model = build_model()
    plan = plan_stages(model, 2, torch.randn(64, 8))
    assert plan.cost_unit == "ms" and len(plan.bounds) == 2 and plan.out_shapes[-1] == ()
    table = plan.table(model)
    assert "| stage | layers | parameters | cost |" in table and "Linear" in table
    assert sum(plan.params) == sum(p.numel() for p in model.parameters())


def _run(tmp_path, world, stages, schedule, steps=10, **extra):
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    spawn(world, "tests.pp_jobs:pp_job", {"stages": stages, "microbatches": 4, "schedule": schedule,
                                           "steps": steps, "out": str(out), **extra},
          failure_timeout_s=60, workdir=tmp_path / "w", extra_env=ENV)
    return merge_stage_states([torch.load(out / f"stage-{s}.pt", weights_only=True) for s in range(stages)])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stages,schedule", [(2, "gpipe"), (2, "1f1b"), (3, "1f1b"), (3, "gpipe")])
def test_pipeline_equals_single_device(tmp_path, stages, schedule):
    # 1F1B with the grid's per-direction pipeline groups (as the engine runs), GPipe on the default group
    merged = _run(tmp_path, stages, stages, schedule, p2p_groups=schedule == "1f1b")
    want = reference(10)
    diff = max(float((merged[k] - v).abs().max()) for k, v in want.state_dict().items())
    assert diff <= 1e-5
    # the merged checkpoint loads into the unsplit model and predicts the same
    model = build_model()
    model.load_state_dict(merged)
    x = torch.randn(16, 8)
    assert torch.allclose(model(x), want(x), atol=1e-5)


@pytest.mark.timeout(240)
def test_hybrid_two_by_two_equals_single_device(tmp_path):
    merged = _run(tmp_path, 4, 2, "1f1b", p2p_groups=True)
    want = reference(10).state_dict()
    assert max(float((merged[k] - v).abs().max()) for k, v in want.items()) <= 1e-5


@pytest.mark.timeout(120)
def test_a_failing_stage_ends_the_job_with_the_schedule_marked(tmp_path):
    with pytest.raises(WorkerFailure) as err:
        _run(tmp_path, 2, 2, "1f1b", steps=4, fail=[1, 2])
    text = str(err.value)
    assert "worker rank 1" in text and "stage 1 (replica 0) failed at action F0" in text
    assert "stage 1: rF0 >>F0<< B0 sB0" in text


@pytest.mark.timeout(300)
def test_batch_cli_with_stages_writes_a_mergeable_checkpoint(shared_data, tmp_path):
    import subprocess
    import sys

    from flowtrain.train.loader import TabularDataset
    from flowtrain.train.models import Architecture

    dataset = shared_data.flights(every=40)
    proc = subprocess.run([sys.executable, "-m", "flowtrain.cli", "batch", "--no-progress", "--dataset",
                           dataset, "--out", str(tmp_path / "run"), "--stages", "2", "--epochs", "2",
                           "--microbatches", "3", "--batch-size", "256", "--device", "cpu"],
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| stage | layers | parameters | cost |" in proc.stdout
    assert "1 replica(s) x 2 pipeline stage(s) x 1 tensor shard(s) on 127.0.0.1 (cpu, gloo)" in proc.stdout
    ckpt = sorted((tmp_path / "run" / "checkpoints").glob("ckpt-*.pt"))[-1]
    state = torch.load(ckpt, weights_only=True)
    assert len(state["stages"]) == 2 and len(state["optimizer"]["stages"]) == 2
    merged = merge_stage_states(state["stages"])
    assert set(merged) == set(state["model"])
    data = TabularDataset(dataset)
    arch = Architecture.from_dict(state["config"], "the run's checkpoint")  # the default recipe, as the run chose it
    model = arch.build(data)
    model.load_state_dict(merged)
    model.eval()
    whole = arch.build(data)
    whole.load_state_dict(state["model"])
    whole.eval()
    test = data.split("test")
    assert torch.equal(model(test.x_num, test.x_cat), whole(test.x_num, test.x_cat))


def _pipeline_jobs_in_a_row(tmp_path, jobs: int) -> None:
    """Issue #11: a pipeline worker once died with SIGABRT at exit ("terminate called without an
    active exception": point-to-point work or gloo threads alive while the process exits). Every
    stage now waits for its sends, destroys its groups and leaves without tearing torch down in
    a half-finalized interpreter; ``jobs`` short pipeline jobs in a row all end with status 0."""
    for i in range(jobs):
        work = tmp_path / f"job-{i}"
        out = work / "out"
        out.mkdir(parents=True)
        spawn(2, "tests.pp_jobs:pp_job", {"stages": 2, "microbatches": 2, "schedule": "1f1b", "steps": 2,
                                           "out": str(out), "p2p_groups": i % 2 == 0},
              failure_timeout_s=60, workdir=work / "w", extra_env=ENV, threads_per_worker=1)
        for log in (work / "w").glob("rank-*.log"):
            text = log.read_text(errors="replace")
            assert "terminate called" not in text and "Traceback" not in text, f"job {i}, {log.name}:\n{text[-2000:]}"
        assert (out / "stage-0.pt").exists() and (out / "stage-1.pt").exists()


@pytest.mark.timeout(240)
def test_short_pipeline_jobs_in_a_row_exit_cleanly(tmp_path):
    _pipeline_jobs_in_a_row(tmp_path, 4)


@pytest.mark.slow  # the 4-job variant above runs by default
@pytest.mark.timeout(900)
def test_twenty_short_pipeline_jobs_in_a_row_none_aborts(tmp_path):
    _pipeline_jobs_in_a_row(tmp_path, 20)

"""The run directory (#22 items 2, 3, 6): a used --out only with --resume (same run) or --overwrite,
checkpoints scoped by run id, final outputs written atomically and the run marked complete last,
no checkpoint temporaries left behind."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from connectors.atomic import atomic_file, atomic_write
from flowtrain.cli.main import main
from flowtrain.train import checkpoint

pytestmark = pytest.mark.timeout(300)


# --- the rules, directly -----------------------------------------------------------------------------
def test_a_non_empty_out_that_is_not_a_flowtrain_run_is_refused_even_with_overwrite(tmp_path):
    from flowtrain.train.rundir.marker import RunDirError
    from flowtrain.train.rundir.rules import prepare_run_dir

    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    for kwargs in ({}, {"overwrite": True}, {"resume": True}):
        with pytest.raises(RunDirError, match=rf"--out {out} is not empty \(thesis.tex\) and is not a flowtrain run"):
            prepare_run_dir(out, {"epochs": 2}, **kwargs)
    assert sorted(p.name for p in out.iterdir()) == ["thesis.tex"]


def test_other_options_are_refused_naming_them_and_overwrite_deletes_only_what_the_run_wrote(tmp_path):
    from flowtrain.train.rundir.marker import RUN_MARKER, RunDirError, read_marker
    from flowtrain.train.rundir.rules import prepare_run_dir

    out = tmp_path / "run"
    first = prepare_run_dir(out, {"epochs": 2, "hidden": [32, 16]})
    for name in ("model.pt", "report.md", "summary.json", "config.json"):
        (out / name).write_text("old")
    (out / "notes.txt").write_text("a user's file")
    mine = checkpoint.save(out / "checkpoints", 20, {"w": torch.zeros(1)}, run_id=first.run_id)
    other = checkpoint.save(out / "checkpoints", 30, {"w": torch.ones(1)}, run_id="someone-else")
    with pytest.raises(RunDirError, match=r"other options \(--epochs: 2 in the run, 5 now\); give --resume to "
                                          r"continue it, --overwrite to replace it"):
        prepare_run_dir(out, {"epochs": 5, "hidden": [32, 16]})
    assert (out / "report.md").read_text() == "old" and mine.exists()
    second = prepare_run_dir(out, {"epochs": 5, "hidden": [32, 16]}, overwrite=True)
    assert second.run_id != first.run_id and "replaced the earlier run" in second.note
    left = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert left == ["checkpoints/ckpt-000000030.pt", "checkpoints/ckpt-000000030.sha256", "notes.txt", RUN_MARKER]
    assert other.exists() and not mine.exists()
    marker = read_marker(out)
    assert marker["run_id"] == second.run_id and marker["status"] == "running" and marker["options"]["epochs"] == 5


def test_resume_keeps_the_run_takes_its_options_and_refuses_changed_ones(tmp_path):
    from flowtrain.train.rundir.marker import RunDirError, read_marker
    from flowtrain.train.rundir.rules import mark_complete, prepare_run_dir

    out = tmp_path / "run"
    run = prepare_run_dir(out, {"epochs": 2, "hidden": [16, 8], "lr": 0.01})
    with pytest.raises(RunDirError, match="--resume: .* holds no checkpoint"):
        prepare_run_dir(out, {"epochs": 4}, resume=True)
    checkpoint.save(out / "checkpoints", 5, {"w": torch.zeros(1)}, run_id=run.run_id)
    mark_complete(out)
    resumed = prepare_run_dir(out, {"epochs": 4}, resume=True)  # a larger budget: fine
    assert resumed.run_id == run.run_id and resumed.resumed
    assert resumed.options["hidden"] == [16, 8] and resumed.options["lr"] == 0.01 and resumed.options["epochs"] == 4
    assert read_marker(out)["status"] == "running"
    with pytest.raises(RunDirError, match=r"--hidden: \[16, 8\] in the run, \[64\] now"):
        prepare_run_dir(out, {"hidden": [64]}, resume=True)


def test_resume_refuses_a_checkpoint_of_another_run(tmp_path):
    from flowtrain.train.rundir.marker import RunDirError
    from flowtrain.train.rundir.rules import prepare_run_dir

    out = tmp_path / "run"
    prepare_run_dir(out, {"epochs": 2})
    checkpoint.save(out / "checkpoints", 20, {"w": torch.zeros(1)}, run_id="an-earlier-run")
    with pytest.raises(RunDirError, match=r"ckpt-000000020.pt, \.\.\.\) of another run \(run id an-earlier-run\)"):
        prepare_run_dir(out, {"epochs": 2}, resume=True)


# --- checkpoints: pruning and loading by run ---------------------------------------------------------------
def test_pruning_keeps_another_runs_checkpoints_and_never_deletes_the_new_ones(tmp_path):
    d = tmp_path / "checkpoints"
    checkpoint.save(d, 20, {"w": torch.zeros(1)}, run_id="old")
    for step in range(1, 6):  # lower step numbers than the old run's: name order would prune them at once
        checkpoint.save(d, step, {"w": torch.full((1,), float(step))}, keep=3, run_id="new")
    assert [p.name for p in checkpoint.all_checkpoints(d)] == [
        "ckpt-000000003.pt", "ckpt-000000004.pt", "ckpt-000000005.pt", "ckpt-000000020.pt"]
    path, state = checkpoint.require_latest(d, run_id="new")
    assert path.name == "ckpt-000000005.pt" and float(state["w"]) == 5.0
    assert checkpoint.latest(d, run_id="old").name == "ckpt-000000020.pt"


class _CrashWhileSaving:
    """Fails half way through ``torch.save`` (after the file is opened and partly written)."""

    def __reduce__(self):
        raise RuntimeError("crash while saving")


def test_a_failed_checkpoint_save_leaves_no_temporary_and_stale_ones_of_this_run_are_removed(tmp_path):
    d = tmp_path / "checkpoints"
    with pytest.raises(RuntimeError, match="crash while saving"):
        checkpoint.save(d, 1, {"w": torch.zeros(1), "bad": _CrashWhileSaving()}, run_id="r1")
    assert list(d.iterdir()) == []
    (d / "ckpt-000000007.pt.tmp-r1").write_bytes(b"torn")  # what a crash of run r1 left
    (d / "ckpt-000000007.pt.tmp-r2").write_bytes(b"a concurrent run's")
    assert [p.name for p in checkpoint.remove_temporaries(d, "r1")] == ["ckpt-000000007.pt.tmp-r1"]
    assert sorted(p.name for p in d.iterdir()) == ["ckpt-000000007.pt.tmp-r2"]


# --- atomic final outputs ------------------------------------------------------------------------------
def test_a_write_that_fails_half_way_leaves_the_old_file_whole_and_no_temporary(tmp_path):
    target = tmp_path / "model.pt"
    atomic_write(target, b"old weights")
    with pytest.raises(RuntimeError):
        with atomic_file(target) as fh:
            fh.write(b"new wei")
            raise RuntimeError("crash mid-write")
    assert target.read_bytes() == b"old weights" and sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]


def test_report_and_summary_writers_never_truncate_the_old_file(tmp_path, monkeypatch):
    """A crash between writing and syncing: the old summary stays whole (in place it was truncated)."""
    from flowtrain.train.report import write_summary

    (tmp_path / "summary.json").write_text(json.dumps({"old": True}))

    def crash(fd):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError, match="disk gone"):
        write_summary(tmp_path, {"new": list(range(10))})
    monkeypatch.undo()
    assert json.loads((tmp_path / "summary.json").read_text()) == {"old": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


# --- the batch command -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def synthetic(shared_data) -> str:
    return shared_data.regression_dataset(rows=1200)


def _batch(dataset: str, out: Path, *extra: str) -> list[str]:
    return ["batch", "--dataset", dataset, "--out", str(out), "--no-progress", "--dropout", "0",
            "--batch-size", "128", "--threads", "1", "--hidden", "8", *extra]


def test_batch_refuses_to_mix_runs_in_one_out_and_resume_continues_only_its_own_run(synthetic, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_batch(synthetic, out, "--epochs", "2")) == 0
    first_ckpts = sorted(p.name for p in (out / "checkpoints").glob("ckpt-*.pt"))
    report = (out / "report.md").read_text()
    capsys.readouterr()
    # another run into the same --out: refused, nothing touched
    assert main(_batch(synthetic, out, "--epochs", "1", "--lr", "0.01")) == 2
    err = capsys.readouterr().err
    assert f"--out {out} holds a flowtrain run with other options" in err and "--lr" in err, err
    assert (out / "report.md").read_text() == report
    assert sorted(p.name for p in (out / "checkpoints").glob("ckpt-*.pt")) == first_ckpts
    from flowtrain.train.rundir.marker import read_marker

    marker = read_marker(out)
    assert marker["status"] == "complete"
    # --resume continues this run only: a stale temporary of this run goes, a concurrent run's stays
    (out / "checkpoints" / f"ckpt-000000099.pt.tmp-{marker['run_id']}").write_bytes(b"torn")
    (out / "checkpoints" / "ckpt-000000099.pt.tmp-another").write_bytes(b"theirs")
    assert main(_batch(synthetic, out, "--epochs", "3", "--resume")) == 0
    assert "resumed from " + first_ckpts[-1] in capsys.readouterr().out
    assert read_marker(out)["run_id"] == marker["run_id"] and read_marker(out)["status"] == "complete"
    assert sorted(p.name for p in (out / "checkpoints").glob("*.tmp*")) == ["ckpt-000000099.pt.tmp-another"]


def test_a_failed_rerun_never_leaves_the_old_report_beside_new_results(synthetic, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_batch(synthetic, out, "--epochs", "1")) == 0
    (out / "notes.txt").write_text("mine")
    # replace the run with one that fails in training (a metric a regression does not have)
    assert main(_batch(synthetic, out, "--epochs", "1", "--select-by", "auc", "--overwrite")) == 2
    assert "--select-by auc" in capsys.readouterr().err
    for name in ("report.md", "summary.json", "model.pt", "fit.json", "config.json"):
        assert not (out / name).exists(), name
    from flowtrain.train.rundir.marker import read_marker

    assert read_marker(out)["status"] == "failed"  # never marked complete: failed, with the error
    assert (out / "notes.txt").read_text() == "mine"


# --- #28 item 4: links and files flowtrain did not write ------------------------------------------------
def _files(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_a_rerun_never_deletes_through_a_symlinked_bundle(synthetic, tmp_path, capsys):
    """The probe: run, `rm -rf r/bundle; ln -s ~/victim r/bundle`, rerun with the same options."""
    import shutil

    victim = tmp_path / "victim"
    (victim / "sub").mkdir(parents=True)
    (victim / "thesis.tex").write_text("years of work")
    (victim / "sub" / "data.csv").write_text("a,b\n1,2\n")
    (victim / "bundle.json").write_text("{}")
    before = _files(victim)
    out = tmp_path / "r"
    assert main(_batch(synthetic, out, "--epochs", "1")) == 0
    shutil.rmtree(out / "bundle")
    (out / "bundle").symlink_to(victim)
    capsys.readouterr()
    assert main(_batch(synthetic, out, "--epochs", "1")) == 2
    err = capsys.readouterr().err
    assert f"bundle -> {victim} is a symbolic link" in err and "deleted nothing" in err, err
    assert _files(victim) == before
    assert (out / "model.pt").exists() and (out / "bundle").is_symlink()


def test_a_users_file_in_a_runs_bundle_is_never_deleted(synthetic, tmp_path, capsys):
    out = tmp_path / "r"
    assert main(_batch(synthetic, out, "--epochs", "1")) == 0
    (out / "bundle" / "notes.md").write_text("mine")
    capsys.readouterr()
    assert main(_batch(synthetic, out, "--epochs", "1")) == 2
    err = capsys.readouterr().err
    assert "bundle.json does not list (notes.md)" in err, err
    assert main(_batch(synthetic, out, "--epochs", "2", "--resume")) == 2  # said before training, not after
    assert "--resume: --out: its bundle/" in capsys.readouterr().err
    assert (out / "bundle" / "notes.md").read_text() == "mine" and (out / "model.pt").exists()


def test_a_symlinked_dataset_is_never_rewritten_or_deleted(tmp_path, capsys):
    """The ETL's dataset/ replaced by a link to another dataset: the rerun refuses, the target stays as it was."""
    import numpy as np

    rng = np.random.default_rng(1)
    x = rng.normal(size=300)
    csv = tmp_path / "data.csv"
    csv.write_text("x,y\n" + "".join(f"{v:.5f},{2 * v:.5f}\n" for v in x))
    args = ["batch", "--input", str(csv), "--label", "y", "--task", "regression", "--numeric", "x", "--epochs", "1",
            "--threads", "1", "--no-progress", "--hidden", "8", "--batch-size", "64"]
    elsewhere = tmp_path / "elsewhere"
    assert main([*args, "--out", str(elsewhere)]) == 0
    out = tmp_path / "r"
    assert main([*args, "--out", str(out)]) == 0
    import shutil

    shutil.rmtree(out / "dataset")
    (out / "dataset").symlink_to(elsewhere / "dataset")
    before = _files(elsewhere / "dataset")
    capsys.readouterr()
    assert main([*args, "--out", str(out)]) == 2
    assert f"dataset -> {elsewhere / 'dataset'} is a symbolic link" in capsys.readouterr().err
    assert _files(elsewhere / "dataset") == before


def test_a_rerun_deletes_only_the_files_the_run_recorded(tmp_path):
    from flowtrain.train.rundir.marker import RunDirError, read_marker
    from flowtrain.train.rundir.rules import mark_complete, prepare_run_dir

    out = tmp_path / "run"
    prepare_run_dir(out, {"epochs": 1})
    (out / "report.md").write_text("the run's")
    mark_complete(out)
    assert read_marker(out)["files"] == ["report.md"]
    (out / "summary.json").write_text("a user's file under a run file's name, written after the run")
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "rank-0.log").write_text("not flowtrain's")
    (out / "workers").symlink_to(victim)
    with pytest.raises(RunDirError, match=r"workers -> .*victim is a symbolic link"):
        prepare_run_dir(out, {"epochs": 1})
    assert (out / "report.md").exists() and (victim / "rank-0.log").exists()
    (out / "workers").unlink()
    prepare_run_dir(out, {"epochs": 1})
    assert not (out / "report.md").exists()
    assert (out / "summary.json").read_text().startswith("a user's file")


# --- #29 item 3: a failed run is recorded, and the corrected rerun replaces it ---------------------------------
def test_a_failed_run_records_failed_and_the_corrected_rerun_replaces_it_without_overwrite(tmp_path, capsys):
    from flowtrain.train.rundir.marker import read_marker

    csv = tmp_path / "data.csv"
    csv.write_text("amount,y\n" + "".join(f"{i / 10:.2f},{i % 3 / 10:.2f}\n" for i in range(200)))
    args = ["batch", "--input", str(csv), "--label", "y", "--task", "regression", "--epochs", "1", "--threads", "1",
            "--no-progress", "--hidden", "8", "--out", str(tmp_path / "r")]
    assert main([*args, "--numeric", "amout"]) == 2
    capsys.readouterr()
    marker = read_marker(tmp_path / "r")
    assert marker["status"] == "failed" and "amout" in marker["error"], marker
    assert main([*args, "--numeric", "amount"]) == 0
    printed = capsys.readouterr().out
    lines = [ln for ln in printed.splitlines() if "replaced flowtrain's own failed run" in ln]
    assert len(lines) == 1 and marker["run_id"] in lines[0] and "amout" in lines[0], printed
    assert read_marker(tmp_path / "r")["status"] == "complete"


def test_a_failed_run_that_left_a_model_is_still_replaced_only_with_overwrite(tmp_path):
    from flowtrain.train.rundir.marker import RunDirError
    from flowtrain.train.rundir.rules import mark_failed, prepare_run_dir

    out = tmp_path / "run"
    run = prepare_run_dir(out, {"epochs": 1})
    checkpoint.save(out / "checkpoints", 5, {"w": torch.zeros(1)}, run_id=run.run_id)
    mark_failed(out, run.run_id, RuntimeError("worker died"))
    with pytest.raises(RunDirError, match="other options"):
        prepare_run_dir(out, {"epochs": 2})
    assert prepare_run_dir(out, {"epochs": 2}, overwrite=True).note


# --- #28 item 13: a killed run's spill ---------------------------------------------------------------------------
def test_the_spill_a_killed_etl_left_is_removed_by_the_next_run_of_the_same_out(tmp_path):
    from flowtrain.train.rundir.rules import prepare_run_dir

    out = tmp_path / "run"
    prepare_run_dir(out, {"epochs": 1})
    spill = out / "dataset.spill-0123456789ab"  # what SIGKILL during the ETL leaves
    (spill / "raw").mkdir(parents=True)
    (spill / "a.arrows").write_bytes(b"batches")
    (spill / "raw" / "b.arrows").write_bytes(b"batches")
    mine = out / "dataset.spill-mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("not a spill file")
    prepare_run_dir(out, {"epochs": 1})
    assert not spill.exists()
    assert (mine / "notes.txt").exists()  # not flowtrain's spill: it stays


# --- #28 item 10: rewrites are atomic ------------------------------------------------------------------------
def test_the_metrics_log_truncation_on_resume_never_truncates_in_place(tmp_path, monkeypatch):
    from flowtrain.train.metrics import MetricsLog

    log = MetricsLog(tmp_path / "metrics.jsonl")
    for step in (1, 2, 3):
        log.write({"step": step, "loss": 1.0 / step})
    before = (tmp_path / "metrics.jsonl").read_text()

    def crash(fd):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError, match="disk gone"):
        log.truncate_after(1)
    monkeypatch.undo()
    assert (tmp_path / "metrics.jsonl").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
    log.truncate_after(1)
    assert [r["step"] for r in log.read()] == [1]


def test_the_stream_ledger_rewrite_on_resume_is_atomic_and_survives_a_torn_line(tmp_path, monkeypatch):
    from flowtrain.train.stream.sinks import Ledger

    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text("".join(json.dumps({"version": v, "partition": 0, "offset": v}) + "\n" for v in (1, 2, 3))
                      + '{"version": 4, "parti')  # a crash in the middle of an append
    before = ledger.read_text()
    kept = Ledger(ledger, kept=True)

    def crash(fd):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError, match="disk gone"):
        kept.drop_after(2)
    monkeypatch.undo()
    assert ledger.read_text() == before and sorted(p.name for p in tmp_path.iterdir()) == ["ledger.jsonl"]
    kept.drop_after(2)
    assert [json.loads(line)["version"] for line in ledger.read_text().splitlines()] == [1, 2]


# --- #29 item 9: `stream train --out` follows the run-directory rules ------------------------------------------
def test_stream_train_out_has_a_marker_and_refuses_a_foreign_or_another_runs_directory(tmp_path):
    import subprocess
    import sys

    from flowtrain.train.rundir.marker import read_marker

    def train(out: Path, *extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "flowtrain.cli", "stream", "train", "--bootstrap", "127.0.0.1:1",
                               "--connect-timeout", "1", "--dataset", str(tmp_path / "ds"), "--out", str(out),
                               *extra], capture_output=True, text=True, timeout=120,
                              cwd=Path(__file__).resolve().parents[2])

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    proc = train(mine)
    assert proc.returncode == 2 and f"--out {mine} is not empty (thesis.tex) and is not a flowtrain run" in \
        proc.stderr, proc.stderr
    assert sorted(p.name for p in mine.iterdir()) == ["thesis.tex"]  # not even a config.json
    out = tmp_path / "run"
    proc = train(out, "--hidden", "8")  # a new run: its marker first (then no broker answers)
    assert "no Kafka broker answered" in proc.stderr, proc.stderr
    marker = read_marker(out)
    assert marker["command"] == "stream train" and marker["options"]["hidden"] == [8]
    proc = train(out, "--hidden", "16")
    assert proc.returncode == 2 and "holds a flowtrain stream train run with other options (--hidden: [8] in the " \
                                    "run, [16] now)" in proc.stderr, proc.stderr
    proc = train(out, "--hidden", "8", "--idle-exit", "5")  # the same run again (the budget may change): continues
    assert "no Kafka broker answered" in proc.stderr and read_marker(out)["run_id"] == marker["run_id"]


def test_resume_never_writes_or_prunes_through_a_symlinked_checkpoints_directory(tmp_path):
    from flowtrain.train.rundir.marker import RunDirError
    from flowtrain.train.rundir.rules import prepare_run_dir

    out = tmp_path / "run"
    run = prepare_run_dir(out, {"epochs": 1})
    victim = tmp_path / "victim"
    checkpoint.save(victim, 5, {"w": torch.zeros(1)}, run_id=run.run_id)
    (out / "checkpoints").symlink_to(victim)
    with pytest.raises(RunDirError, match=r"--resume: in .*, checkpoints -> .*victim is a symbolic link"):
        prepare_run_dir(out, {"epochs": 2}, resume=True)
    assert sorted(p.name for p in victim.iterdir()) == ["ckpt-000000005.pt", "ckpt-000000005.sha256"]

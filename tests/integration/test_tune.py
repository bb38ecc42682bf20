"""``flowtrain tune`` (issue 46 item 3): an Optuna study of ``flowtrain batch`` runs on one ETL'd dataset, two trials
at once in their own processes and run directories, killed with SIGKILL mid-study and resumed from the same
storage: the finished trials kept, the killed one marked failed and retried with its parameters; the best trial's
run, bundle and the report."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import optuna  # the dev install has it (pyproject's dev extra): a missing Optuna fails, never skips
import pytest

pytestmark = pytest.mark.timeout(420)

SEARCH = "lr=1e-3:3e-2:log,width=8:32:int,ensemble=1|2"


def _table(path: Path) -> Path:
    """600 rows with a non-linear signal: y = sin(3 a) + b^2 + noise."""
    rng = np.random.default_rng(0)
    a, b, c = rng.normal(size=(3, 600))
    y = np.sin(3 * a) + b ** 2 + 0.1 * rng.normal(size=600)
    path.write_text("a,b,c,y\n" + "\n".join(f"{x:.5f},{v:.5f},{w:.5f},{t:.5f}" for x, v, w, t in zip(a, b, c, y)))
    return path


def _command(table: Path, out: Path, trials: int) -> list[str]:
    return [sys.executable, "-m", "flowtrain.cli", "tune", "--input", str(table), "--label", "y", "--numeric", "a,b,c",
            "--out", str(out), "--trials", str(trials), "--parallel", "2", "--search", SEARCH, "--steps", "60",
            "--eval-every", "10", "--pruner", "none", "--heartbeat", "1", "--no-progress"]


def _study(out: Path):
    return optuna.load_study(study_name="flowtrain", storage=f"sqlite:///{out / 'study.db'}")


def _trial_processes(out: Path) -> list[int]:
    """Live processes whose command line names the study's directory (its trials' flowtrain batch runs)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if b"flowtrain.cli\0batch" in cmd and str(out).encode() in cmd:
                pids.append(int(proc.name))
    return pids


def test_a_study_killed_mid_trial_resumes_from_its_storage(tmp_path):
    from optuna.trial import TrialState

    table, out = _table(tmp_path / "t.csv"), tmp_path / "study"
    proc = subprocess.Popen(_command(table, out, 4), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:  # one trial done, another one running
            time.sleep(0.5)
            if not (out / "study.db").exists():
                continue
            try:
                trials = _study(out).get_trials(deepcopy=False)
            except Exception:  # noqa: BLE001 - the study is being created
                continue
            states = [t.state for t in trials]
            running = [t for t in trials if t.state == TrialState.RUNNING]
            # mid-trial: the running trials have their parameters drawn (one may still start before the kill)
            all_drawn = all(len(t.params) == len(SEARCH.split(",")) for t in running)
            if TrialState.COMPLETE in states and running and all_drawn:
                break
        assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
        proc.send_signal(signal.SIGKILL)  # the study's process only: its trials must die with it
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    gone = time.monotonic() + 20
    while _trial_processes(out) and time.monotonic() < gone:
        time.sleep(0.2)
    assert _trial_processes(out) == []  # no trial outlives the study (PR_SET_PDEATHSIG)
    before = {t.number: t for t in _study(out).get_trials(deepcopy=False)}
    killed = [n for n, t in before.items() if t.state == TrialState.RUNNING]
    done_before = [n for n, t in before.items() if t.state == TrialState.COMPLETE]
    assert killed and done_before

    again = subprocess.run(_command(table, out, 4), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "marked failed, retried with their parameters" in again.stdout
    after = {t.number: t for t in _study(out).get_trials(deepcopy=False)}
    for n in done_before:  # finished trials are kept as they were
        assert after[n].state == TrialState.COMPLETE and after[n].value == before[n].value
    for n in killed:
        assert after[n].state == TrialState.FAIL
        retries = [t for t in after.values() if t.system_attrs.get("failed_trial") == n]
        drawn = after[n].params  # all of them; or part, when the kill came while a new trial drew its own
        assert len(retries) == 1 and {k: retries[0].params.get(k) for k in drawn} == drawn
        assert retries[0].state == TrialState.COMPLETE, again.stdout[-3000:] + again.stderr[-3000:]
    complete = [t for t in after.values() if t.state == TrialState.COMPLETE]
    assert len(complete) == 4
    dirs = [t.user_attrs["run_dir"] for t in after.values()]
    assert len(set(dirs)) == len(dirs)  # every trial its own run directory
    overlapping = [(a, b) for a in complete for b in complete if a.number < b.number
                   and a.datetime_start < b.datetime_complete and b.datetime_start < a.datetime_complete]
    assert overlapping, "two trials ran at once (--parallel 2)"
    for t in complete:
        summary = json.loads((Path(t.user_attrs["run_dir"]) / "summary.json").read_text())
        assert summary["valid_best"]["rmse"] == pytest.approx(t.value)
    best = json.loads((out / "best.json").read_text())["best"]
    assert best["value"] == min(t.value for t in complete)
    assert (out / "best" / "bundle" / "bundle.json").exists()
    report = (out / "tune_report.md").read_text()
    assert "## Best trial" in report and "## Trials" in report and f"(retry of {killed[0]})" in report

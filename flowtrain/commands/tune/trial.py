"""One trial of ``flowtrain tune``: a ``flowtrain batch`` process on the study's dataset, its validation curve
reported to Optuna's pruner while it runs, its best validation metric the objective.

Each trial runs in its own process and its own run directory, ``<out>/trials/<study>-<number>`` (a trial number is
never reused in a study, and a directory that exists is never reused: the trial fails instead). The process dies
with the thread that started it (``PR_SET_PDEATHSIG``), so a ``kill -9`` of the study leaves no trial running; it
is its own process group, stopped as one when pruned or past ``--trial-timeout``. Its output goes to
``<run>.log`` beside the run directory.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from flowtrain.commands.tune.space import Dimension, trial_flags
from flowtrain.errors import FlowtrainError
from flowtrain.local.processes import die_with_parent
from flowtrain.train.rundir.files import RunFiles

#: Seconds between two reads of a running trial's metrics.jsonl.
POLL_S = 0.5


class TrialFailed(FlowtrainError):
    """A trial's run ended with an error (the study goes on; the trial is marked failed)."""


def _stop_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM to the trial's process group, SIGKILL after ``grace_s``."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class _Curve:
    """The validation lines a running trial has written to its metrics.jsonl, read as they come."""

    def __init__(self, path: Path, metric: str):
        self.path, self.metric, self.offset = path, metric, 0

    def new(self) -> list[tuple[int, float]]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                chunk = fh.read()
        except FileNotFoundError:
            return []
        end = chunk.rfind(b"\n")
        if end < 0:
            return []
        self.offset += end + 1
        points = []
        for line in chunk[:end].splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            value = row.get(self.metric)
            if row.get("kind") == "valid" and row.get("model", "model") == "model" and isinstance(value, (int, float)):
                points.append((int(row["step"]), float(value)))
        return points


@dataclass
class TrialRunner:
    """The study's objective: ``runner(trial)`` runs one trial and returns its validation metric."""

    out: Path
    dataset: Path
    study: str
    metric: str
    space: list[Dimension]
    fixed: list[str]
    options: dict
    timeout: float | None = None
    env: dict = field(default_factory=dict)  # more environment for the trials' processes (MLflow's parent run)
    python: list[str] = field(default_factory=lambda: [sys.executable, "-m", "flowtrain.cli"])

    def __call__(self, trial) -> float:
        import optuna

        params = {d.name: d.sample(trial) for d in self.space}
        run_dir = self.out / "trials" / f"{self.study}-{trial.number:04d}"
        if run_dir.exists():  # never another trial's (or an earlier study's) directory
            raise TrialFailed(f"trial {trial.number}: its run directory {run_dir} exists already (a study of the "
                              f"same name in another storage?); use another --study-name or --out")
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        trial.set_user_attr("run_dir", str(run_dir))
        cmd = [*self.python, "batch", "--no-progress", "--dataset", str(self.dataset), "--out", str(run_dir),
               *self.fixed, *trial_flags(params, self.options)]
        trial.set_user_attr("command", " ".join(cmd[len(self.python) - 1:]))
        log = run_dir.with_name(run_dir.name + ".log")
        t0 = time.monotonic()
        with open(log, "wb") as fh:
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, **self.env}, preexec_fn=die_with_parent(signal.SIGKILL))
        curve = _Curve(RunFiles(run_dir).metrics, self.metric)
        try:
            while True:
                done = proc.poll() is not None
                for step, value in curve.new():
                    trial.report(value, step)
                    if trial.should_prune():
                        _stop_group(proc)
                        trial.set_user_attr("seconds", time.monotonic() - t0)
                        raise optuna.TrialPruned(f"validation {self.metric} {value:.4f} at step {step}")
                if done:
                    break
                if self.timeout is not None and time.monotonic() - t0 > self.timeout:
                    _stop_group(proc)
                    raise TrialFailed(f"trial {trial.number}: stopped after --trial-timeout {self.timeout:g} s")
                time.sleep(POLL_S)
        except BaseException:
            if proc.poll() is None:
                _stop_group(proc)
            raise
        trial.set_user_attr("seconds", time.monotonic() - t0)
        if proc.returncode:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
            raise TrialFailed(f"trial {trial.number}: flowtrain batch exited with {proc.returncode}"
                              + (f": {tail[0]}" if tail else "") + f" (log: {log})")
        summary = json.loads(RunFiles(run_dir).summary.read_text())
        value = (summary.get("valid_best") or {}).get(self.metric)
        if not isinstance(value, (int, float)) or value != value:
            raise TrialFailed(f"trial {trial.number}: the run has no validation {self.metric}")
        test = summary["test"]["model"].get(self.metric)
        trial.set_user_attr("test", test if isinstance(test, (int, float)) else None)
        choice = summary.get("model_choice") or {}
        trial.set_user_attr("chosen", choice.get("chosen"))
        return float(value)

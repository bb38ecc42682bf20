"""One run per run directory at a time (h6 item 1): two runs started at the same moment into the same --out were
not locked against each other; now the second is a one-line error naming the directory and the running pid. And
the whole `flowtrain stream` job's trainer follows the run-directory rules its standalone command follows."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from flowtrain.train.rundir.marker import RunDirError, read_marker
from flowtrain.train.rundir.rules import mark_complete, prepare_run_dir, prepare_stream_dir

pytestmark = pytest.mark.timeout(300)

OPTIONS = {"epochs": 1, "input": ["x.csv"], "label": "y"}

# A run that takes the directory, says so, and holds it until stdin closes (or it is killed).
HOLDER = """
import json, sys
from flowtrain.train.rundir.marker import RunDirError
from flowtrain.train.rundir.rules import mark_complete, prepare_run_dir, prepare_stream_dir
out, kind = sys.argv[1], sys.argv[2]
try:
    if kind == "stream":
        run = prepare_stream_dir(out, {"dataset": "d", "features_topic": "f"})
    else:
        run = prepare_run_dir(out, {"epochs": 1, "input": ["x.csv"], "label": "y"})
except RunDirError as err:
    print(json.dumps({"error": str(err)}), flush=True)
    sys.exit(3)
print(json.dumps({"run_id": run.run_id}), flush=True)
sys.stdin.read()
if kind != "stream":
    mark_complete(out)
"""


def _holder(out: Path, kind: str = "batch") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", HOLDER, str(out), kind], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def _first_line(proc: subprocess.Popen) -> dict:
    return json.loads(proc.stdout.readline())


def _stop(proc: subprocess.Popen) -> int:
    try:
        proc.stdin.close()
    except OSError:
        pass
    try:
        return proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_two_runs_started_at_the_same_moment_into_one_out_one_runs_the_other_names_its_pid(tmp_path):
    out = tmp_path / "run"
    procs = [_holder(out), _holder(out)]
    try:
        lines = [_first_line(p) for p in procs]
    finally:
        codes = [_stop(p) for p in procs]
    won = [i for i, line in enumerate(lines) if "run_id" in line]
    assert len(won) == 1, lines
    winner, loser = procs[won[0]], procs[1 - won[0]]
    error = lines[1 - won[0]]["error"]
    assert error.startswith(f"--out {out} is in use by another flowtrain run (pid {winner.pid} on host "), error
    assert "wait for it to end (or stop it), or choose another --out" in error
    assert codes[1 - won[0]] == 3 and codes[won[0]] == 0 and loser.pid != winner.pid
    marker = read_marker(out)
    assert marker["status"] == "complete" and marker["run_id"] == lines[won[0]]["run_id"] and "pid" not in marker


def test_a_run_in_progress_holds_its_out_until_it_completes_or_is_killed(tmp_path):
    out = tmp_path / "run"
    holder = _holder(out)
    try:
        first = _first_line(holder)
        assert read_marker(out)["pid"] == holder.pid
        with pytest.raises(RunDirError, match=rf"is in use by another flowtrain run \(pid {holder.pid} on host"):
            prepare_run_dir(out, OPTIONS)  # same options: it would have replaced the running run's files
        with pytest.raises(RunDirError, match=rf"pid {holder.pid}"):
            prepare_run_dir(out, OPTIONS, overwrite=True)
        with pytest.raises(RunDirError, match=rf"pid {holder.pid}"):
            prepare_stream_dir(out, {"dataset": "d"})
        assert read_marker(out)["run_id"] == first["run_id"] and read_marker(out)["status"] == "running"
        os.kill(holder.pid, signal.SIGKILL)  # a killed run's lock goes with it
        holder.wait(timeout=60)
    finally:
        _stop(holder)
    run = prepare_run_dir(out, OPTIONS)  # the same options again: the crashed run is replaced
    assert run.run_id != first["run_id"] and read_marker(out)["pid"] == os.getpid()
    mark_complete(out)  # lets go: another process may take it
    again = _holder(out)
    try:
        assert "run_id" in _first_line(again)
    finally:
        assert _stop(again) == 0


def test_a_stream_trainer_holds_its_out_for_its_life(tmp_path):
    out = tmp_path / "stream"
    holder = _holder(out, "stream")
    try:
        _first_line(holder)
        with pytest.raises(RunDirError, match=rf"--out {out} is in use by another flowtrain run \(pid {holder.pid}"):
            prepare_stream_dir(out, {"dataset": "d", "features_topic": "f"})
    finally:
        _stop(holder)
    assert prepare_stream_dir(out, {"dataset": "d", "features_topic": "f"}).resumed  # the holder ended


def test_the_whole_stream_jobs_trainer_follows_the_run_directory_rules(tmp_path):
    """Before, only `flowtrain stream train` applied them: the whole job wrote config.json and its logs into a
    directory that was not flowtrain's, and ran beside a trainer already running in its --out."""
    import flowtrain

    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    code = flowtrain.stream(out=str(foreign), bootstrap="127.0.0.1:1")
    assert code == 2 and sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]

    out = tmp_path / "stream"
    holder = _holder(out, "stream")
    try:
        _first_line(holder)
        err = subprocess.run([sys.executable, "-m", "flowtrain.cli", "stream", "--out", str(out), "--bootstrap",
                              "127.0.0.1:1"], capture_output=True, text=True, timeout=240)
    finally:
        _stop(holder)
    assert err.returncode == 2, err.stderr
    assert f"flowtrain stream: --out {out} is in use by another flowtrain run (pid {holder.pid}" in err.stderr
    assert sorted(p.name for p in out.iterdir()) == ["run.json"]  # no config.json, no logs beside the trainer's

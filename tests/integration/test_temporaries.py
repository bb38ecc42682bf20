"""Temporaries (#22 item 6): a terminated ETL removes its own .tmp-/.spill-/.parts- files and no one
else's; the local launcher removes the work directory it made under /tmp."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
pytestmark = pytest.mark.timeout(300)

_ETL = textwrap.dedent("""
    import sys
    from connectors.dataset_spec import FeatureSpec
    from flowtrain.local.runners import pipeline_options
    from pipelines.tabular.pipeline import run_tabular_etl

    csv, ds, dead = sys.argv[1:]
    run_tabular_etl([csv], FeatureSpec(label="y", numeric=["x"], categorical=["c"]), dataset_path=ds,
                    dead_letters_path=dead, options=pipeline_options("batch"))
""")


def _ours(base: Path) -> list[str]:
    return sorted(p.name for p in base.iterdir() if p.name.startswith(("ds.tmp-", "ds.spill-", "dead.jsonl.parts-",
                                                                       "dead.jsonl.tmp-", "beam-temp-")))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_terminated_etl_removes_its_temporaries_and_keeps_a_concurrent_jobs(tmp_path, sig):
    csv = tmp_path / "in.csv"
    with open(csv, "w") as fh:
        fh.write("x,c,y\n")
        for i in range(400_000):
            fh.write(f"{i * 0.001:.3f},{'abc'[i % 3]},{i % 11}\n" if i % 1000 else "oops,a,1\n")
    others = ["ds.spill-concurrent0", "ds.tmp-concurrent00", "dead.jsonl.parts-concurrent", "beam-temp-dead.jsonl-x"]
    for name in others:  # another job's, started before this one: never ours to delete
        (tmp_path / name).mkdir()
        (tmp_path / name / "part").write_text("theirs")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", _ETL, str(csv), str(tmp_path / "ds"), str(tmp_path / "dead.jsonl")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 200
        while not set(_ours(tmp_path)) - set(others):  # the ETL has written a temporary of its own
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the ETL wrote no temporary file"
            time.sleep(0.02)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + sig, err[-3000:]
    assert _ours(tmp_path) == sorted(others), err[-3000:]
    assert all((tmp_path / name / "part").read_text() == "theirs" for name in others)
    assert not (tmp_path / "ds").exists()


def test_the_launcher_removes_the_work_directory_it_made(tmp_path, monkeypatch):
    from flowtrain.parallel.launch import spawn

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where mkdtemp makes /tmp/flowtrain-workers-*
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    pids = tmp_path / "pids"
    pids.mkdir()
    spawn(2, "tests.launch_jobs:collective_loop_job", {"pids": str(pids), "beat_every": [0.1, 0.1], "seconds": 0.2},
          failure_timeout_s=60)
    assert (pids / "rank-0.pid").exists()
    assert list(scratch.iterdir()) == []
    given = tmp_path / "given"  # a work directory the caller gave: its logs stay for the caller
    spawn(2, "tests.launch_jobs:collective_loop_job", {"pids": str(pids), "beat_every": [0.1, 0.1], "seconds": 0.2},
          failure_timeout_s=60, workdir=given)
    assert (given / "rank-0.log").exists()

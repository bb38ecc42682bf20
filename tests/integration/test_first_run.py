"""A fast first run: the batch demo provisions only the venv; Kafka jars and Prism come on first use.

``make demo`` must not fetch the Kafka jars (mvn) or build Prism (go): the batch job uses
neither. ``make test`` still provisions both up front (the suite needs them).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]  # the repository


@pytest.mark.timeout(60)
def test_make_demo_provisions_only_the_venv_and_make_test_provisions_everything():
    make = shutil.which("make")
    assert make, "make is needed to check the Makefile's targets"

    def plan(target: str) -> str:
        proc = subprocess.run([make, "-n", target], cwd=REPO, capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    assert "flowtrain batch" in plan("demo")
    assert "flowtrain.local.provision" not in plan("demo")
    assert "flowtrain.local.provision" in plan("test")


@pytest.mark.slow  # the Makefile test above is the default check of the same capability
@pytest.mark.timeout(300)
def test_the_batch_job_runs_without_maven_go_or_a_provisioned_cache(tmp_path):
    """ETL + training on a small CSV with an empty cache and a PATH holding neither mvn nor go."""
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.standard_normal(600)
    lines = ["x,c,y"] + [f"{v:.4f},{'ab'[i % 2]},{v * 2 + (i % 2) + rng.normal() * 0.1:.4f}" for i, v in enumerate(x)]
    (tmp_path / "data.csv").write_text("\n".join(lines) + "\n")
    cache, bare = tmp_path / "cache", tmp_path / "bin"
    bare.mkdir()
    env = {**os.environ, "FLOWTRAIN_CACHE": str(cache), "PATH": str(bare)}
    proc = subprocess.run([sys.executable, "-m", "flowtrain.cli", "batch", "--no-progress", "--input",
                           str(tmp_path / "data.csv"), "--label", "y", "--numeric", "x", "--categorical", "c",
                           "--epochs", "1", "--out", str(tmp_path / "run")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert (tmp_path / "run" / "report.md").exists()
    made = {p.name for p in cache.iterdir()} if cache.exists() else set()
    assert not made & {"kafka", "prism"}, made  # nothing provisioned for the batch job

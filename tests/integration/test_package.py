"""The package as users get it: a wheel built from the repository, installed into a clean virtual
environment (nothing from the development venv), runs `flowtrain --version` and `flowtrain batch` on a
small CSV. Catches a runtime dependency that only an extra or the dev venv provided, package data
left out of the wheel, and a module that imports the source tree's bench/ or tests/."""
from __future__ import annotations

import csv
import os
import random
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(cmd, **kw):
    result = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert result.returncode == 0, f"{cmd}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.mark.timeout(900)
def test_wheel_in_a_clean_venv_runs_the_batch_job(tmp_path):
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(ROOT)], timeout=300)
    wheel = next(dist.glob("flowtrain-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.startswith("flowtrain-")}
    assert tops == {"flowtrain", "pipelines", "connectors"}, tops  # bench/ and tests/ stay in the source tree
    assert "flowtrain/local/kafka/pom.xml" in names

    venv = tmp_path / "venv"
    uv = Path(sys.executable).with_name("uv")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    _run([str(uv), "venv", "-q", "--python", sys.executable, str(venv)], env=env, timeout=120)
    _run([str(uv), "pip", "install", "-q", "--python", str(venv / "bin" / "python"), "-c", str(ROOT / "constraints.txt"),
          str(wheel)], env=env, timeout=600)

    work = tmp_path / "work"  # not the repository: nothing importable from the source tree
    work.mkdir()
    rng = random.Random(0)
    with open(work / "houses.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["sqft", "rooms", "city", "price"])
        for _ in range(400):
            sqft, rooms, city = rng.uniform(40, 200), rng.randint(1, 6), rng.choice(["a", "b", "c"])
            w.writerow([f"{sqft:.1f}", rooms, city, f"{3 * sqft + 10 * rooms + {'a': 0, 'b': 50, 'c': 90}[city]:.1f}"])
    flowtrain = str(venv / "bin" / "flowtrain")
    version = _run([flowtrain, "--version"], cwd=work, env=env, timeout=60).stdout
    assert "flowtrain" in version and "0." in version, version
    _run([flowtrain, "batch", "--input", "houses.csv", "--label", "price", "--numeric", "sqft,rooms",
          "--categorical", "city", "--out", "runs/houses", "--steps", "60"], cwd=work, env=env, timeout=600)
    assert (work / "runs" / "houses" / "report.md").exists()
    assert (work / "runs" / "houses" / "model.pt").exists()

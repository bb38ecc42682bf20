"""Issue 48 item 6: imports sit at the modules' heads, and the command line stays light by importing each
command's work (``flowtrain.commands.<job>``) only when it runs, its options (``*_options``) at once.

So building the parser (every ``--help``) imports no torch, and the stream pipeline's process (Beam and Kafka, no
model) imports none either: a module that needs torch is imported only by the jobs that train or score."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "sklearn", "scipy", "matplotlib", "optuna", "mlflow")


def _imported(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys\nprint(' '.join(sorted(sys.modules)))"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return set(out.stdout.split())


@pytest.mark.parametrize("code", [
    "from flowtrain.cli.main import build_parser\nbuild_parser()",
    "import flowtrain.commands.stream.job",                   # every stream process's entry
    "import flowtrain.commands.stream.pipeline",              # the stream pipeline's process
])
def test_the_parser_and_the_stream_pipeline_import_no_torch(code):
    heavy = sorted(m for m in _imported(code) if m.split(".")[0] in HEAVY)
    assert not heavy, f"{code!r} imports {heavy[:10]}"


def test_the_jobs_import_no_extra_until_asked():
    """``flowtrain[mlflow]`` and ``flowtrain[tune]`` are extras: every job module but their own imports without them
    (``--mlflow`` and ``flowtrain tune`` import them when asked)."""
    commands = ROOT / "flowtrain" / "commands"
    own = {"mlflow_tracking", "tune.run"}
    jobs = sorted(".".join(p.relative_to(commands).with_suffix("").parts) for p in commands.rglob("*.py")
                  if p.stem != "__init__")
    jobs = [j for j in jobs if j not in own]
    assert "batch.job" in jobs and "stream.train" in jobs, jobs
    extras = sorted(m for m in _imported("\n".join(f"import flowtrain.commands.{j}" for j in jobs))
                    if m.split(".")[0] in ("mlflow", "optuna", "lightgbm"))
    assert not extras, f"the job modules import {extras[:10]}"


def test_import_flowtrain_imports_no_beam_and_no_torch():
    """The Python API imports each job on first use: ``import flowtrain`` takes a few hundredths of a second."""
    heavy = sorted(m for m in _imported("import flowtrain") if m.split(".")[0] in (*HEAVY, "apache_beam", "pyarrow"))
    assert not heavy, f"import flowtrain imports {heavy[:10]}"

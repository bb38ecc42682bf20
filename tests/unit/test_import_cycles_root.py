"""Issue 48 item 6: the root package and ``flowtrain.commands`` are inside the import contracts. A module of flowtrain
that imports the package's API back (``flowtrain/__init__.py`` imports the commands), or a command step that imports
its job back (``batch.etl -> batch.job``), breaks ``lint-imports``; one run over a copy of the tree with both planted.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_root_import_and_a_commands_cycle_break_the_contracts(tmp_path):
    for pkg in ("bench", "flowtrain", "pipelines", "connectors"):
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    with open(tmp_path / "flowtrain" / "train" / "bundle.py", "a") as fh:
        fh.write("\n\ndef _version():\n    import flowtrain\n    return flowtrain.__version__\n")
    with open(tmp_path / "flowtrain" / "commands" / "batch" / "etl.py", "a") as fh:
        fh.write("\n\ndef _cycle():\n    from flowtrain.commands.batch import job\n    return job\n")
    lint = Path(sys.executable).with_name("lint-imports")
    run = subprocess.run([str(lint), "--no-cache"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    out = " ".join(run.stdout.split())
    assert run.returncode == 1 and "Broken contracts" in out, out[-3000:]
    broken = out.split("Broken contracts", 1)[1]
    assert "flowtrain.train.bundle is not allowed to import flowtrain" in broken, broken[-3000:]
    cycle = "No cycles are allowed in flowtrain.commands.batch"  # lint-imports names one edge of the two to remove
    assert cycle in broken and (".etl -> .job" in broken or ".job -> .etl" in broken), broken[-3000:]

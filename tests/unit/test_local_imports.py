"""Issue 30 item 8: function-local imports only for heavy optional dependencies, with a count that may only
go down; and the import-linter contracts inside ``pipelines.stream`` and ``pipelines.serving`` catch a cycle.

A function-local import (an ``import``/``from`` statement inside a function or method) hides a dependency
from the module's head and from readers, and is how import cycles hide. It is fine for the heavy optional
dependencies in ``ALLOWED`` (importing them costs seconds or needs an extra installed). Every other one is
counted per package (the directory of the module, dotted) and compared with
``tests/unit/local_imports_baseline.json``: a package over its number fails; under it, lower the number.

Refresh the baseline (only ever to smaller numbers) with::

    .venv/bin/python tests/unit/test_local_imports.py --write-baseline
"""
from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("bench", "flowtrain", "pipelines", "connectors")
BASELINE = Path(__file__).with_name("local_imports_baseline.json")

#: Heavy optional dependencies a function may import (the module and its submodules).
ALLOWED = (
    "apache_beam", "grpc",                           # Beam and its portability layer (seconds to import)
    "torch.distributed",                             # process groups, RPC, pipelining: CLI paths stay light
    "torch.utils.tensorboard", "tensorboard",        # the TensorBoard writer
    "fsspec", "s3fs", "gcsfs", "adlfs",              # object store backends
    "sklearn", "scipy", "matplotlib",                # evaluation, reports, figures
    "confluent_kafka", "fastavro", "google.protobuf",  # optional Kafka client and event formats
    "pyarrow.parquet", "pyarrow.dataset", "pyarrow.csv", "pyarrow.json", "pyarrow.fs", "pyarrow.orc",
    "pyarrow.flight", "pyarrow.compute",             # pyarrow's heavy parts (not pyarrow itself)
    "palmerpenguins",                                # a benchmark's data set
    "optuna", "mlflow", "lightgbm",                  # extras: flowtrain tune, --mlflow, bench quality's trees
)


def _allowed(module: str) -> bool:
    return any(module == a or module.startswith(a + ".") for a in ALLOWED)


def local_imports() -> dict[str, list[str]]:
    """``{package: ["path:line: module", ...]}`` of the function-local imports not in ``ALLOWED``."""
    found: dict[str, list[str]] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT)
            package = ".".join(rel.parent.parts)
            try:
                tree = ast.parse(path.read_text(), str(path))
            except FileNotFoundError:  # moved away while the tree was listed (a checkout being edited)
                continue
            stack = [(tree, False)]
            while stack:
                node, in_function = stack.pop()
                for child in ast.iter_child_nodes(node):
                    if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                        if isinstance(child, ast.Import):
                            modules = [a.name for a in child.names]
                        elif child.level:  # relative: inside this package, never a heavy dependency
                            modules = ["." * child.level + (child.module or "")]
                        else:
                            modules = [child.module or ""]
                        if not all(_allowed(m) for m in modules):
                            found.setdefault(package, []).append(f"{rel.as_posix()}:{child.lineno}: "
                                                                 f"{', '.join(modules)}")
                    stack.append((child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                           ast.Lambda))))
    return found


def counts() -> dict[str, int]:
    return dict(sorted(Counter({pkg: len(v) for pkg, v in local_imports().items()}).items()))


def test_function_local_imports_only_go_down():
    baseline = json.loads(BASELINE.read_text())["counts"]
    found = local_imports()
    over = [f"{pkg}: {len(lines)} function-local imports, the baseline allows {baseline.get(pkg, 0)}:\n  "
            + "\n  ".join(sorted(lines)) for pkg, lines in sorted(found.items()) if len(lines) > baseline.get(pkg, 0)]
    assert not over, ("function-local imports went up (import at the module's head; only the heavy optional "
                      "dependencies in ALLOWED may be imported inside a function):\n" + "\n".join(over))


def test_the_local_import_count_sees_nested_and_ignores_allowed(tmp_path, monkeypatch):
    pkg = tmp_path / "connectors"
    pkg.mkdir()
    (pkg / "m.py").write_text("import json\n\n\ndef f():\n    import os\n    from sklearn import metrics\n"
                              "    def g():\n        from connectors import paths\n\n\nclass C:\n"
                              "    def h(self):\n        import torch.distributed as dist\n        import torch\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGES", ("connectors",))
    assert counts() == {"connectors": 3}  # os, connectors.paths, torch; not json (module head), sklearn, dist


def test_import_contracts_inside_pipelines_stream_and_serving_catch_a_cycle(tmp_path):
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    lint = Path(sys.executable).with_name("lint-imports")

    def run() -> subprocess.CompletedProcess:
        return subprocess.run([str(lint), "--no-cache"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                              env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})

    kept = run()
    assert kept.returncode == 0, kept.stdout[-3000:] + kept.stderr[-2000:]
    with open(tmp_path / "pipelines" / "stream" / "events.py", "a") as fh:  # a hidden cycle, function-local
        fh.write("\n\ndef _cycle():\n    from pipelines.stream import pipeline\n    return pipeline\n")
    with open(tmp_path / "pipelines" / "serving" / "commit.py", "a") as fh:
        fh.write("\n\ndef _cycle():\n    from pipelines.serving import scoring\n    return scoring\n")
    broken = run()
    out = " ".join(broken.stdout.split())
    assert broken.returncode == 1, out[-3000:]
    assert "Broken contracts" in out, out[-3000:]
    listed = out.split("Broken contracts", 1)[1]
    for contract in ("inside pipelines.stream", "inside pipelines.serving", "no import cycles inside these packages"):
        assert contract in listed, (contract, out[-3000:])


if __name__ == "__main__":
    if sys.argv[1:] != ["--write-baseline"]:
        sys.exit("usage: tests/unit/test_local_imports.py --write-baseline")
    new = counts()
    old = json.loads(BASELINE.read_text())["counts"] if BASELINE.exists() else {}
    up = {pkg: (old.get(pkg, 0), n) for pkg, n in new.items() if old and n > old.get(pkg, 0)}
    if up:
        sys.exit(f"function-local imports went up, {up} (package: (baseline, now)); remove them first")
    BASELINE.write_text(json.dumps({"total": sum(new.values()), "counts": new}, indent=1) + "\n")
    print(f"{BASELINE}: {sum(new.values())} function-local imports outside ALLOWED in {len(new)} packages")

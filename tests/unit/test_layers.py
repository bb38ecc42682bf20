"""The repository's own rules on imports, beside the import-linter contracts in pyproject.toml
(`lint-imports`: bench -> flowtrain -> pipelines -> connectors, only flowtrain's command line imports
pipelines): no module imports a private name (leading underscore) of another top-level package, and no
module is an alias that re-points ``sys.modules`` at another."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("connectors", "pipelines", "flowtrain", "bench")


def _modules():
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            yield pkg, path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(), str(path))


def test_no_module_imports_a_private_name_of_another_package():
    bad = []
    for pkg, rel, tree in _modules():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.level == 0):
                continue
            top = node.module.split(".")[0]
            if top not in PACKAGES or top == pkg:
                continue
            private = [a.name for a in node.names if a.name.startswith("_")]
            private += [p for p in node.module.split(".")[1:] if p.startswith("_") and p != "__init__"]
            if private:
                bad.append(f"{rel}:{node.lineno}: imports private {', '.join(private)} of {node.module}")
    assert not bad, "\n".join(bad)


def test_no_alias_modules():
    bad = [rel for _, rel, tree in _modules()
           if any(isinstance(n, ast.Assign) and any(ast.unparse(t).startswith("sys.modules[") for t in n.targets)
                  for n in ast.walk(tree))]
    assert not bad, f"alias modules (a moved module is moved; update the imports instead): {bad}"


def test_import_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]


def test_test_module_basenames_are_unique():
    """tests/ has no __init__.py, so pytest imports each test file by its basename: two files of one name in
    different folders stop the whole collection ("import file mismatch") on a clean clone."""
    seen: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        seen.setdefault(path.name, []).append(path.relative_to(ROOT).as_posix())
    dupes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not dupes, f"test files sharing a basename (rename one): {dupes}"

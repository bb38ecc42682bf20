"""Every third-party module the code imports is installed by the project's own files: a fresh ``make install``
(``pip install -c constraints.txt -e '.[test,demo]'``) gets what ``tests/`` and ``bench/`` import, and the
product's modules import only what ``pyproject.toml`` declares (its dependencies or an extra). ``bench features``
imported DuckDB, installed by hand in the development venv only: a clean clone's bench smoke failed on it.

Declared = the requirements of the installed ``flowtrain`` (``make`` reinstalls it whenever ``pyproject.toml``
changes) and, through the installed distributions, everything they require in turn."""
from __future__ import annotations

import ast
import importlib.metadata as md
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
OURS = {"flowtrain", "pipelines", "connectors", "bench", "tests", "__future__"}
#: What ``make install`` installs (the Makefile's ``.[test,demo]``).
INSTALLED_EXTRAS = {"test", "demo"}


def _requirements(extras: set[str]) -> list[Requirement]:
    """flowtrain's own requirements with ``extras`` (the installed metadata: pyproject.toml as last installed)."""
    found = []
    for line in md.distribution("flowtrain").requires or []:
        req = Requirement(line)
        if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras | {""}):
            found.append(req)
    return found


def _closure(extras: set[str]) -> set[str]:
    """The distributions ``flowtrain[extras]`` brings, by canonical name."""
    seen: set[tuple[str, frozenset]] = set()
    todo = [(r.name, frozenset(r.extras)) for r in _requirements(extras)]
    while todo:
        name, wanted = todo.pop()
        if (canonicalize_name(name), wanted) in seen:
            continue
        seen.add((canonicalize_name(name), wanted))
        try:
            requires = md.distribution(name).requires or []
        except md.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker and not any(req.marker.evaluate({"extra": e}) for e in wanted | {""}):
                continue
            todo.append((req.name, frozenset(req.extras)))
    return {name for name, _ in seen}


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


def _undeclared(folders: tuple[str, ...], declared: set[str]) -> list[str]:
    providers = md.packages_distributions()
    bad = []
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            siblings = {p.stem for p in path.parent.glob("*.py")}  # a test module importing its neighbour by name
            for module in sorted(_imports(path) - OURS - siblings - set(sys.stdlib_module_names)):
                dists = {canonicalize_name(d) for d in providers.get(module, [])}
                if not dists & declared:
                    bad.append(f"{path.relative_to(ROOT)}: import {module} (from {', '.join(sorted(dists)) or 'nothing'}"
                               f" installed)")
    return bad


def test_what_the_tests_and_benches_import_is_installed_by_make_install():
    bad = _undeclared(("tests", "bench"), _closure(INSTALLED_EXTRAS))
    assert not bad, ("not installed by `make install` (add it to the test extra in pyproject.toml and pin it in "
                     "constraints.txt):\n" + "\n".join(bad))


def test_what_the_product_imports_is_declared_in_pyproject():
    extras = set(md.metadata("flowtrain").get_all("Provides-Extra") or [])
    bad = _undeclared(("flowtrain", "pipelines", "connectors"), _closure(extras))
    assert not bad, "imported but not declared (a dependency or an extra in pyproject.toml):\n" + "\n".join(bad)

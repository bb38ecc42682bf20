"""What the docs tell users to run names code that exists: every ``python -m MODULE`` / ``-m MODULE`` in
the README and docs/ is an importable module, and every ``package.module:function`` target names a
function of that module (a renamed module once left the torchrun line of docs/parallelism.md stale)."""
from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OURS = ("flowtrain", "pipelines", "connectors", "bench", "tests")


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_every_module_the_docs_run_exists():
    bad = []
    for doc in _docs():
        for module in re.findall(r"-m\s+([A-Za-z_][\w.]*)", doc.read_text()):
            if module.split(".")[0] in OURS and importlib.util.find_spec(module) is None:
                bad.append(f"{doc.relative_to(ROOT)}: -m {module}")
    assert not bad, "\n".join(bad)


def test_every_worker_target_the_docs_name_exists():
    bad = []
    for doc in _docs():
        for module, name in re.findall(r"\b((?:flowtrain|pipelines|connectors)(?:\.\w+)+):(\w+)", doc.read_text()):
            try:
                found = hasattr(importlib.import_module(module), name)
            except ImportError:
                found = False
            if not found:
                bad.append(f"{doc.relative_to(ROOT)}: {module}:{name}")
    assert not bad, "\n".join(bad)


def _index_from_readme() -> str:
    """docs/index.md (the site's home) is the README with its links made relative to docs/."""
    s = (ROOT / "README.md").read_text()
    s = re.sub(r"\]\(docs/([^)]+)\)", r"](\1)", s)
    s = s.replace("(see `LICENSE`)", "(the repository's `LICENSE`)")
    return s.replace("The documentation is a mkdocs site: `mkdocs serve` (with the test extra installed) or read\n"
                     "`docs/` directly. ", "")


def test_the_sites_home_page_is_the_readme():
    assert (ROOT / "docs" / "index.md").read_text() == _index_from_readme(), (
        "docs/index.md differs from README.md: run `python tests/unit/test_docs_commands.py` to write it again")


if __name__ == "__main__":  # write docs/index.md from README.md
    (ROOT / "docs" / "index.md").write_text(_index_from_readme())


def test_every_bench_the_docs_run_is_registered():
    """``flowtrain bench NAME`` in the docs is a bench the command knows (``bench features`` was documented with its
    table but not registered: the command refused it)."""
    from flowtrain.cli.bench import BENCHMARKS

    bad = []
    for doc in _docs():
        for name in re.findall(r"flowtrain bench ([a-z][\w-]*)", doc.read_text()):
            if name not in BENCHMARKS and name != "all":
                bad.append(f"{doc.relative_to(ROOT)}: flowtrain bench {name}")
    assert not bad, "\n".join(bad)

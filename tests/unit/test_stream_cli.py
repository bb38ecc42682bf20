"""The streaming command line's structure: no import cycle between its modules, each part's --help its own."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CLI = ROOT / "flowtrain" / "cli"


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every ``from X import names`` in the file, function-local ones included."""
    tree = ast.parse(path.read_text())
    return [(node.module or "", [a.name for a in node.names]) for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)]


def test_the_scorer_cli_does_not_import_the_stream_cli_and_nobody_imports_its_privates():
    score = _imports(CLI / "score.py")
    assert not [m for m, _ in score if m == "flowtrain.cli.stream"], "score.py imports flowtrain.cli.stream"
    for name in ("stream.py", "score.py", "stream_status.py", "stream_inputs.py"):
        private = [(m, n) for m, names in _imports(CLI / name) for n in names
                   if m.startswith("flowtrain.cli.") and n.startswith("_")]
        assert not private, f"{name} imports private names {private}"

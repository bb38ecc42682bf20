"""The README onboards a new user (issue 29 item 10): who flowtrain is for in one sentence, the pip
route beside the clone route, a run-directory listing that names everything a real run writes
(checked against a tiny `flowtrain batch`), and what `predict` returns."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def _section(md: str, title: str) -> str:
    return md.split(f"## {title}", 1)[1].split("\n## ", 1)[0]


def test_readme_says_who_flowtrain_is_for_in_one_sentence_and_gives_the_pip_route_beside_the_clone_route():
    md = _readme()
    first = md.split("\n\n")[1]  # the paragraph under the title
    assert first.startswith("For ") and first.count(". ") == 0 and first.rstrip().endswith("."), first
    install = _section(md, "Install, and the commands to remember")
    assert re.search(r"^pip install -c constraints\.txt \. ", install, flags=re.M)
    assert "make demo" in install


def test_readme_run_directory_listing_names_everything_a_real_batch_run_writes(tmp_path):
    from flowtrain.cli.main import main

    rng = np.random.default_rng(0)
    n = 300
    x = rng.normal(size=n)
    y = (x + rng.normal(scale=0.5, size=n) > 0).astype(int)
    lines = ["x,c,y"] + [f"{a:.4f},{rng.choice(['a', 'b'])},{b}" for a, b in zip(x, y)]
    lines.append("not-a-number,a,1")  # a dead letter, so dead_letters.jsonl has a line
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n")
    assert main(["batch", "--threads", "1", "--no-progress", "--input", str(tmp_path / "t.csv"), "--label", "y",
                 "--task", "classification", "--numeric", "x", "--categorical", "c", "--steps", "20",
                 "--out", str(tmp_path / "run")]) == 0
    listing = re.search(r"```\nruns/houses/\n(.*?)```", _readme(), flags=re.S).group(1)
    named = set(re.findall(r"[\w.*]+/?", listing))
    written = sorted(p.name + ("/" if p.is_dir() else "") for p in (tmp_path / "run").iterdir())
    missing = [w for w in written if w not in named and not (w.endswith(".png") and "*.png" in named)]
    assert not missing, f"the README's run-directory listing lacks {missing}"
    for name in ("model.pt", "dead_letters.jsonl", "bundle/", "report.md"):
        assert name in written and name in named


def test_readme_says_what_predict_returns():
    use = _section(_readme(), "Use the model: `flowtrain predict`, bundles, the Python API")
    text = " ".join(use.split())
    assert "one row per input row" in text
    assert "`pred_`" in text and "the model version" in text
    assert "dead_letters.jsonl` with the reason" in text and ".metrics.json`" in text
    assert "returns what it was given (a pandas DataFrame, an Arrow table, a list of dicts)" in text

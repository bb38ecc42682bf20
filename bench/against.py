"""``python -m bench.against CHECKOUT BENCH``: a benchmark of this checkout against the same benchmark of a previous
release, interleaved.

Each round runs BENCH once (``run(repeats=1)``) in CHECKOUT (a ``git worktree`` of the previous release, imported
first through ``PYTHONPATH``) and then once in this checkout, each in a process of its own; after ``--rounds``
rounds (at least 3) every table row's rate (the first ``.../s`` column) is the median of its rounds, and the ratio
is this checkout's over the previous release's. The bench's own anchor rows run in both, so a ratio far from 1.0 on
an anchor row says the machine drifted::

    git worktree add /tmp/old 5b6e827
    python -m bench.against /tmp/old predict --rounds 3
    python -m bench.against /tmp/old dataparallel --rounds 3
    python -m bench.against /tmp/old predict --rounds 3 --set scales='[1]'    # a keyword of the bench's run()

BENCH is a module of ``bench`` whose ``run(out_dir=..., repeats=...)`` writes its table as JSON (``bench.table``):
``dataparallel``, ``predict``. A row is matched by its text cells (a renamed row, e.g. a model's label, shows as
two rows with one side empty).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.table import markdown_table
from bench.timing import MIN_REPEATS, median

__all__ = ["BENCHES", "main", "run_once"]

#: The benchmarks this compares (their ``run`` takes ``out_dir`` and ``repeats`` and reports one rate column).
BENCHES = ("dataparallel", "predict")
HERE = Path(__file__).resolve().parent.parent

# One run of the bench in the checkout the child starts in (its ``PYTHONPATH``); one repeat: the rounds are the
# repeats, so the bench's own minimum is lifted in that child only.
_CHILD = """
import json, sys
import bench.timing
bench.timing.MIN_REPEATS = 1
module = __import__("bench." + sys.argv[1], fromlist=["run"])
keywords = {k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(sys.argv[3]).items()}
module.run(out_dir=sys.argv[2], repeats=1, **keywords)
"""


def run_once(checkout: Path, bench: str, out_dir: Path, timeout_s: float = 3600,
             keywords: dict | None = None) -> dict[tuple, float]:
    """One run of ``bench`` in ``checkout`` (``keywords``: more of its ``run()``'s arguments, lists as tuples):
    each table row's text cells -> its rate."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    done = subprocess.run([sys.executable, "-c", _CHILD, bench, str(out_dir), json.dumps(keywords or {})],
                          cwd=checkout, env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise SystemExit(f"bench against: {bench} failed in {checkout} (exit {done.returncode}):\n"
                         f"{done.stderr[-2000:]}")
    table = json.loads((out_dir / f"{bench}.json").read_text())
    rate = next((i for i, h in enumerate(table["headers"]) if h.endswith("/s")), None)
    if rate is None:
        raise SystemExit(f"bench against: {bench}'s table has no rate column (.../s): {table['headers']}")
    return {tuple(c for c in row[:rate] if isinstance(c, str)): float(row[rate]) for row in table["rows"]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkout", type=Path, help="the previous release's checkout (git worktree add DIR COMMIT)")
    ap.add_argument("bench", choices=BENCHES)
    ap.add_argument("--rounds", type=int, default=MIN_REPEATS, help="interleaved rounds (>= 3); medians reported")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help="a keyword of the bench's run(), the same on both sides (e.g. steps=150, scales='[1]')")
    a = ap.parse_args(argv)
    keywords = {}
    for item in a.set:
        key, _, value = item.partition("=")
        try:
            keywords[key] = json.loads(value)
        except ValueError:
            raise SystemExit(f"--set {item}: give KEY=JSON (steps=150, scales='[1]', models='[\"demo\"]')") from None
    if a.rounds < MIN_REPEATS:
        raise SystemExit(f"--rounds {a.rounds}: a benchmark reports the median of at least {MIN_REPEATS} interleaved "
                         f"runs; pass --rounds {MIN_REPEATS} or more")
    if not (a.checkout / "bench" / f"{a.bench}.py").is_file():
        raise SystemExit(f"bench against: {a.checkout} has no bench/{a.bench}.py: pass a checkout of flowtrain "
                         f"(git worktree add {a.checkout} COMMIT)")
    rates: dict[tuple, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="flowtrain-bench-against-") as work:
        for r in range(a.rounds):
            for side, checkout in (("previous", a.checkout.resolve()), ("this", HERE)):
                out = Path(work) / f"{side}-{r}"
                for key, value in run_once(checkout, a.bench, out, keywords=keywords).items():
                    rates.setdefault(key, {"previous": [], "this": []})[side].append(value)
                print(f"bench against: {a.bench} round {r + 1}/{a.rounds}, {side} done", file=sys.stderr, flush=True)
    rows = []
    for key, sides in rates.items():
        old, new = (median(sides[s]) if sides[s] else None for s in ("previous", "this"))
        rows.append((" / ".join(key), f"{old:,.0f}" if old else "-", f"{new:,.0f}" if new else "-",
                     f"{new / old:.3f}" if old and new else "-",
                     "; ".join(", ".join(f"{v:,.0f}" for v in sides[s]) for s in ("previous", "this"))))
    print(markdown_table(["row", f"{a.checkout.name} (previous)", "this checkout", "this / previous",
                          "rounds (previous; this)"], rows))
    print(f"\nEach rate the median of {a.rounds} interleaved rounds (previous, then this checkout, per round).")


if __name__ == "__main__":
    main()

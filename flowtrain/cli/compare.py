"""``flowtrain compare RUN RUN...``: options, test metrics with intervals and validation curves of batch runs
side by side (``flowtrain.commands.compare``)."""
from __future__ import annotations

import argparse
import time


def register(sub) -> None:
    p = sub.add_parser(
        "compare", help="compare batch runs: options, test metrics with intervals, validation curves in one PNG",
        description="Reads the run directories of `flowtrain batch` runs and prints a table of the options that "
                    "differ and the test metrics with their 95% bootstrap intervals; writes compare.md, "
                    "compare.json and compare.png (the validation curves overlaid) to --out.")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories of `flowtrain batch` (two or more)")
    p.add_argument("--out", default=None, help="where to write compare.md, compare.json and compare.png "
                                               "(default runs/compare-<time>)")
    p.set_defaults(func=_compare)


def _compare(args: argparse.Namespace) -> int:
    from flowtrain.commands.compare import compare

    result = compare(args.runs, args.out or f"runs/compare-{time.strftime('%Y%m%d-%H%M%S')}")
    print(result["markdown"])
    print("\nwritten: " + ", ".join(result["files"]))
    return 0

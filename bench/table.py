"""Printing a benchmark's measurements as a Markdown table (pasted as-is into the README)."""
from __future__ import annotations

import json
import platform
import time
from collections.abc import Sequence
from pathlib import Path


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    def fmt(v):
        if isinstance(v, int) and not isinstance(v, bool):
            return f"{v:,}"
        if isinstance(v, float):
            return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.0f}"
        return str(v)

    cells = [[fmt(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
                     + [line(r) for r in cells])


def report(name: str, headers: Sequence[str], rows: Sequence[Sequence], notes: Sequence[str] = (),
           out_dir: str | None = None) -> str:
    text = "\n".join([f"### bench {name} ({time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()})",
                      "", markdown_table(headers, rows), "", *notes])
    print(text, flush=True)
    if out_dir:
        path = Path(out_dir)
        path.mkdir(parents=True, exist_ok=True)
        (path / f"{name}.md").write_text(text + "\n")
        (path / f"{name}.json").write_text(json.dumps({"headers": list(headers), "rows": [list(r) for r in rows]},
                                                      default=str))
    return text

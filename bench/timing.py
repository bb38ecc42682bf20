"""Interleaved repeated measurements and their medians: how every benchmark times its cases.

A busy machine drifts (other jobs, thermal limits, the page cache), so cases are never timed in
blocks: repeat ``r`` runs every case once, in the same order, before repeat ``r + 1`` starts.
A benchmark reports the **median** of at least ``MIN_REPEATS`` runs (the number a user sees
again on the same machine); the best run may stay as an extra column.

    runs = interleaved({"anchor": lambda: time_it(anchor), "ours": lambda: time_it(ours)}, repeats=3)
    median(runs["ours"])                  # seconds
    median(runs["ours"], key=rate)        # any measurement: key picks the number
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

__all__ = ["MIN_REPEATS", "check_repeats", "interleaved", "median", "median_rows", "best", "spread", "time_it",
           "repeats_note"]

#: The fewest repeats a reported median may come from.
MIN_REPEATS = 3

R = TypeVar("R")


def check_repeats(repeats: int) -> int:
    if repeats < MIN_REPEATS:
        raise SystemExit(f"--repeats {repeats}: a benchmark reports the median of at least {MIN_REPEATS} "
                         f"interleaved runs; pass --repeats {MIN_REPEATS} or more")
    return repeats


def interleaved(cases: Mapping[str, Callable[[], R]], *, repeats: int = MIN_REPEATS,
                warmup: Sequence[str] = (), on_run: Callable[[str, int, R], None] | None = None
                ) -> dict[str, list[R]]:
    """Run every case once per repeat, cases in order inside a repeat; returns case -> results.

    ``warmup``: cases to run once, untimed, before the first repeat (a first pipeline of a process
    pays one-time imports). ``on_run(case, repeat, result)`` is called after each run (progress).
    """
    check_repeats(repeats)
    for name in warmup:
        cases[name]()
    results: dict[str, list[R]] = {name: [] for name in cases}
    for r in range(repeats):
        for name, run in cases.items():
            result = run()
            results[name].append(result)
            if on_run is not None:
                on_run(name, r, result)
    return results


def _values(runs: Sequence[Any], key: Callable[[Any], float] | None) -> list[float]:
    if not runs:
        raise ValueError("no runs to summarize")
    return [float(key(r) if key else r) for r in runs]


def median(runs: Sequence[Any], key: Callable[[Any], float] | None = None) -> float:
    """The median of the runs' numbers (``key(run)``, or the runs themselves)."""
    return float(statistics.median(_values(runs, key)))


def best(runs: Sequence[Any], key: Callable[[Any], float] | None = None, *, higher_is_better: bool = False
         ) -> float:
    """The best run: the least time, or with ``higher_is_better`` the greatest rate."""
    values = _values(runs, key)
    return max(values) if higher_is_better else min(values)


def spread(runs: Sequence[Any], key: Callable[[Any], float] | None = None) -> tuple[float, float]:
    values = _values(runs, key)
    return min(values), max(values)


def median_rows(rounds: Sequence[Sequence[Sequence[Any]]]) -> list[tuple]:
    """Table rows from repeated rounds of the same rows: each numeric cell the median over the
    rounds, any other cell (a label, an empty cell) as in the first round."""
    if not rounds:
        raise ValueError("no rounds to summarize")
    out = []
    for i, first in enumerate(rounds[0]):
        cells = []
        for j, cell in enumerate(first):
            values = [r[i][j] for r in rounds]
            numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
            cells.append((type(cell)(statistics.median(values)) if isinstance(cell, int) and
                          all(isinstance(v, int) for v in values) else float(statistics.median(values)))
                         if numeric else cell)
        out.append(tuple(cells))
    return out


def time_it(fn: Callable[[], Any]) -> float:
    """Seconds ``fn()`` takes."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def repeats_note(repeats: int) -> str:
    return f"median of {repeats} interleaved runs"


def measure_child(cmd: list[str], *, log, answer, timeout_s: float, what: str) -> tuple[dict, float]:
    """Run a benchmark child process; return (the last JSON line it printed, its own peak RSS in MiB).

    ``wait4`` reaps the child and gives its own rusage (ru_maxrss in KiB), so the peak RSS is the
    child's alone. A child that runs over ``timeout_s`` is killed; a non-zero exit raises with its log.
    """
    import json
    import os
    import subprocess
    import time
    from pathlib import Path

    with open(log, "wb") as err, open(answer, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=Path(__file__).resolve().parent.parent)
    deadline = time.monotonic() + timeout_s
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
            break
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise TimeoutError(f"{what} ran over {timeout_s:.0f} s; log {log}")
        time.sleep(0.05)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{Path(log).read_text()[-3000:]}")
    return json.loads(Path(answer).read_text().strip().splitlines()[-1]), usage.ru_maxrss / 1024

"""``python -m tests.bench_smoke_child SPEC.json RESULTS.json``: run `flowtrain bench NAME ARGS...` for each
``{"name": ..., "args": [...]}`` of SPEC one after another in this one process (torch, Beam and the benches imported
once, not once per bench), each through the command line's ``main`` with one round allowed
(``bench.timing.MIN_REPEATS`` lifted to 1 in this process only, as ``bench.against`` does).

After each bench RESULTS holds, per name: its exit status, seconds, what it printed and, when it raised, the
traceback; ``running`` names the bench in progress (what a timeout interrupted). A bench that fails does not stop
the next one. Used by tests/integration/test_bench_smoke.py, with the tiny preset (tests/bench_preset.py)."""
from __future__ import annotations

import contextlib
import io
import json
import sys
import time
import traceback
from pathlib import Path

import bench.timing
from flowtrain.cli.main import main as flowtrain_main


class _Tee(io.TextIOBase):
    """What a bench prints: kept, and shown as it goes (the test's log when it fails)."""

    def __init__(self, *streams):
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()


def run_one(name: str, args: list[str]) -> dict:
    printed, error, t0 = io.StringIO(), None, time.monotonic()
    try:
        with contextlib.redirect_stdout(_Tee(sys.stdout, printed)):
            code = flowtrain_main(["bench", name, *args])
    except SystemExit as stop:  # a bench's one-line refusal (argparse, a check)
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        error = None if stop.code in (0, None) else str(stop.code)
    except Exception:  # noqa: BLE001 - recorded for the test to show; the next bench still runs
        code, error = 1, traceback.format_exc()
    return {"code": code, "seconds": round(time.monotonic() - t0, 1), "stdout": printed.getvalue(), "error": error}


def main(spec_path: str, results_path: str) -> int:
    bench.timing.MIN_REPEATS = 1  # a smoke run: one round of each measurement
    results_file = Path(results_path)
    results: dict = {"running": None, "benches": {}}
    for entry in json.loads(Path(spec_path).read_text()):
        results["running"] = entry["name"]
        results_file.write_text(json.dumps(results))
        print(f"\n=== flowtrain bench {entry['name']} {' '.join(entry['args'])}", flush=True)
        results["benches"][entry["name"]] = run_one(entry["name"], entry["args"])
        print(f"=== flowtrain bench {entry['name']}: exit {results['benches'][entry['name']]['code']} in "
              f"{results['benches'][entry['name']]['seconds']} s", flush=True)
    results["running"] = None
    results_file.write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))

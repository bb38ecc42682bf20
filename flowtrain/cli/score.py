"""``flowtrain stream --score`` (all three halves as child processes) and the scorer's live line.

Its options are fields of ``flowtrain.commands.stream`` (``ScoreOptions``); Beam, torch and Kafka load only when
a command runs.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from flowtrain.cli.stream_status import JOB_PART_ENV


def serving_status(out: Path) -> dict:
    """Serving version (of the newest prediction), online accuracy and counts from the status files."""
    from pipelines.flights.status import read_status

    prefix = str(out / "score-status.json")
    totals = {"predictions": 0, "labelled": 0, "correct": 0, "version": None, "rejected": 0, "events": 0,
              "dead_letters": 0}
    newest = -1.0
    for data in read_status(prefix, "predictions"):
        for k in ("predictions", "labelled", "correct"):
            totals[k] += data.get(k, 0)
        if data.get("version") is not None and data["time"] > newest:
            newest, totals["version"] = data["time"], data["version"]
    for data in read_status(prefix, "featurize"):
        totals["events"] += data.get("events", 0)
        totals["dead_letters"] += data.get("dead_letters", 0)
    for data in read_status(prefix, "versions"):
        totals["rejected"] = max(totals["rejected"], data.get("rejected_count", len(data.get("rejected", []))))
    totals["accuracy"] = totals["correct"] / totals["labelled"] if totals["labelled"] else None
    return totals


def serving_line(out: Path) -> str:
    s = serving_status(out)
    version = "-" if s["version"] is None else f"v{s['version']}"
    acc = "-" if s["accuracy"] is None else f"{s['accuracy']:.3f}"
    rejected = f" | rejected versions {s['rejected']}" if s["rejected"] else ""
    return f"serving {version} | online acc {acc} ({s['labelled']:,} labelled){rejected}"


def run_all(args, beam_args: list[str]) -> int:
    """``flowtrain stream --score``: feature pipeline, online trainer and scorer as child processes,
    one live line; Ctrl-C stops all three cleanly."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from flowtrain.cli.stream_status import (
        CHILD_ARGS,
        live_line,
        process_states,
        serve_stream_status,
        stop_stream_status,
    )

    procs = {}  # --metrics-port: this process serves the whole job's /metrics and status page
    status = serve_stream_status(args, process_states(procs), title="flowtrain stream")
    common = [a for a in sys.argv[2:] if a not in ("pipeline", "train", "score", "--local-kafka", "--score")]
    common += CHILD_ARGS
    base = [sys.executable, "-m", "flowtrain.cli", "stream"]
    from flowtrain.local.processes import supervise

    last = [(time.monotonic(), 0)]

    def report() -> None:
        line, last[0] = live_line(args, out, last[0])
        print(f"{line} | {serving_line(out)}", flush=True)

    os.environ[JOB_PART_ENV] = "1"  # the parts inherit it: this job wrote config.json
    try:  # children that end with this process; SIGINT/SIGTERM/SIGHUP stop them (SIGINT: each stops its
        # runner / writes its checkpoint), SIGKILL after 60 s
        codes = supervise({half: (base + [half] + common, out / log) for half, log in (
            ("pipeline", "pipeline.log"), ("train", "trainer.log"), ("score", "scorer.log"))},
            report=report, procs=procs)
    finally:
        stop_stream_status(status)
        os.environ.pop(JOB_PART_ENV, None)
    print(f"stream: stopped ({', '.join(f'{half} {code}' for half, code in codes.items())}); logs in {out}")
    return 0 if all(code == 0 for code in codes.values()) else 1  # a half failing on its way out fails

"""``flowtrain stream [pipeline|train|score]`` as a job: one part in this process, or the whole job (the feature
pipeline and the online trainer, with ``score`` the scorer too) as supervised child processes
(``flowtrain.local.processes.supervise``) with one live line.

``run_stream(job)`` takes a whole ``StreamJob`` (``flowtrain.commands.stream.options``) and, with ``half``, runs that part
only (``part_of``). It prepares the run directory (``config.json``), starts the project's broker with
``local_kafka``, checks the brokers, picks the runner (``flowtrain.local.runners.pick_runner``) and returns the exit
code. Ctrl-C / SIGTERM / SIGHUP stop it cleanly (a final checkpoint, a cancelled pipeline).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Collection, Sequence
from dataclasses import fields
from pathlib import Path

from connectors.atomic import atomic_write
from connectors.fields import build, options_of, to_config
from connectors.kafka import summarize_reconnects
from connectors.secrets import redact
from flowtrain.commands.stream.options import HALVES, StreamJob, with_dataset_topics
from flowtrain.commands.stream.replay import check_brokers
from flowtrain.commands.stream.status import (
    live_line,
    process_states,
    serve_stream_status,
    serving_line,
    stop_stream_status,
    with_stream_status,
)
from flowtrain.local.kafka import BrokerError, LocalKafka
from flowtrain.local.processes import StopSignals, supervise
from flowtrain.local.runners import RunnerError, pick_runner
from flowtrain.train.rundir.files import RunFiles, usable_dir

#: Set in the environment of the parts a whole ``flowtrain stream`` job starts: the job wrote ``config.json``.
JOB_PART_ENV = "FLOWTRAIN_STREAM_JOB_PART"
#: The child processes of a whole job (a part, its log file), in start order; ``score`` only with ``--score``.
PARTS = {"pipeline": "pipeline.log", "train": "trainer.log", "score": "scorer.log"}


def part_of(job: StreamJob, half: str | None):
    """``job`` with its topics named after the dataset, or with ``half`` that part's options only
    (``HALVES``); every option of ``job`` is checked either way."""
    job = with_dataset_topics(job)
    if not half:
        return job
    mine = {o.name for o in options_of(HALVES[half])}
    return build(HALVES[half], {k: v for k, v in to_config(job).items() if k in mine})


def given_options(job) -> set[str]:
    """The options of ``job`` that differ from their defaults (what a Python caller set)."""
    return {f.name for f in fields(job) if getattr(job, f.name) != f.default}


def run_stream(job: StreamJob, beam_args: Sequence[str] = (), *, half: str | None = None,
               given: Collection[str] | None = None) -> int:
    """Run ``job`` (with ``half``: that part only) until it ends or is stopped; returns the exit code.
    ``given``: the options the user set (default: those that differ from their defaults)."""
    from flowtrain.train.rundir.rules import prepare_stream_dir  # torch: only where a part runs

    job = with_dataset_topics(job)
    part = part_of(job, half)
    given = given_options(job) if given is None else set(given)
    command = "flowtrain stream" + (f" {half}" if half else "")
    summarize_reconnects()  # kafka-python's reconnect warnings: one line when an outage starts, one when it ends
    in_job = bool(os.environ.get(JOB_PART_ENV))  # a part of a whole job: the job wrote its config.json
    try:
        usable_dir(job.out)
        if half is None or (half == "train" and not in_job):  # the run-directory rules (run.json, one run at
            # a time): the whole job's trainer follows them as the standalone one does (the job holds the lock)
            prepare_stream_dir(job.out, to_config(part if half else part_of(job, "train")))
    except ValueError as err:
        print(f"{command}: {err}", file=sys.stderr)
        return 2
    if not in_job:
        _write_config(part, Path(job.out))
    if job.local_kafka:
        try:
            LocalKafka(port=int(job.bootstrap.rsplit(":", 1)[1])).start()
        except (BrokerError, ValueError) as err:
            print(f"flowtrain stream: --local-kafka on {job.bootstrap}: {err}", file=sys.stderr)
            return 2
    check_brokers(job, command)
    picked = list(beam_args)
    if half != "train":  # --runner flink / --flink-master as Beam options, for every pipeline below
        try:
            picked = pick_runner(job.runner, job.flink_master, beam_args)
        except RunnerError as err:
            raise SystemExit(f"flowtrain stream: {err}") from None
    if half == "pipeline":
        return with_stream_status(job, "pipeline", lambda: _run_pipeline(part, picked))
    if half == "train":
        return with_stream_status(job, "trainer", lambda: _run_trainer(part, given))
    if half == "score":
        return with_stream_status(job, "scorer", lambda: _run_scorer(part, picked))
    return _run_parts(job, beam_args, [p for p in PARTS if p != "score" or job.score], given)


def _run_pipeline(job, beam_args: list[str]) -> int:
    """The feature pipeline (``flowtrain.commands.stream.pipeline``); Ctrl-C / SIGTERM cancel it."""
    from flowtrain.commands.stream.pipeline import run_stream_pipeline

    # SIGINT/SIGTERM/SIGHUP: cancel the pipeline (installed before the runner starts; the caller's handlers back at
    # the end: `flowtrain.stream(...)` in a program, or a test in pytest's process, keeps its Ctrl-C)
    with StopSignals() as stop:
        return run_stream_pipeline(job, beam_args, should_stop=stop.is_set)


def _run_scorer(job, beam_args: list[str]) -> int:
    """The scorer (``flowtrain.commands.stream.score``); Ctrl-C / SIGTERM cancel it."""
    from flowtrain.commands.stream.score import run_score

    with StopSignals() as stop:  # SIGINT/SIGTERM/SIGHUP: cancel the pipeline (as _run_pipeline)
        return run_score(job, beam_args, should_stop=stop.is_set)


def _run_trainer(job, given: Collection[str]) -> int:
    """The online trainer (``flowtrain.commands.stream.train``). Ctrl-C / SIGTERM stop it with a final
    checkpoint: the handlers are installed here, the trainer only polls ``should_stop``."""
    from flowtrain.commands.stream.train import run_stream_train
    from flowtrain.parallel.launch import WorkerFailure
    from flowtrain.train.jobs import stream_summary_line

    try:
        with StopSignals() as stop:  # SIGINT/SIGTERM/SIGHUP: a final checkpoint, then the end (as _run_pipeline)
            summary = run_stream_train(job, given=given, should_stop=stop.is_set)
    except ValueError as err:  # a clash with --init-weights, the features topic is missing, no loadable
        # checkpoint, weights do not fit
        print(f"flowtrain stream train: {err}", file=sys.stderr)
        return 2
    except WorkerFailure as err:
        print(f"flowtrain stream train: {err}", file=sys.stderr)
        return 1
    if summary is not None:
        print(stream_summary_line(summary), flush=True)
    return 0


def _write_config(job, out: Path) -> None:
    """``<out>/config.json``: every option of the run (secrets redacted), a valid ``--config`` of the command."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(RunFiles(out).config, json.dumps(redact(to_config(job)), indent=1) + "\n")


def _run_parts(job: StreamJob, beam_args: Sequence[str], parts: list[str], given: Collection[str]) -> int:
    """The whole job: ``parts`` as supervised child processes (``flowtrain stream PART``, each with the job's
    options through a private file descriptor, never its command line or a file left behind), a live line every few seconds; Ctrl-C stops all
    cleanly. 0 when every part ended cleanly (stopped, or by itself: the trainer's --idle-exit)."""
    out = Path(job.out)
    out.mkdir(parents=True, exist_ok=True)
    procs: dict = {}  # --metrics-port: this process serves the whole job's /metrics and status page
    status = serve_stream_status(job, process_states(procs), title="flowtrain stream")
    options = {k: v for k, v in to_config(job).items() if k in given or k.endswith("topic")}
    options.update(local_kafka=False, score=False, metrics_port=0)  # the parent serves the port, started the broker
    # the options may hold secrets: a private file (0600) deleted at once, its content kept by an open descriptor the
    # parts inherit and read as /dev/fd/N; a SIGKILL of this process leaves no file behind
    fd, path = tempfile.mkstemp(prefix="flowtrain-stream-", suffix=".json")
    try:
        os.unlink(path)
        os.write(fd, json.dumps(options).encode())
    except BaseException:
        os.close(fd)
        raise
    config = f"/dev/fd/{fd}"
    passthrough = ["--", *beam_args] if beam_args else []
    base = [sys.executable, "-m", "flowtrain.cli", "stream"]
    last = [(time.monotonic(), 0)]

    def report() -> None:
        line, last[0] = live_line(job, out, last[0])
        print(f"{line} | {serving_line(out)}" if "score" in parts else line, flush=True)

    names = {"train": "trainer"} if "score" not in parts else {}  # the parts' names on the status page
    try:  # children that end with this process; SIGINT/SIGTERM/SIGHUP stop them (SIGINT: each stops its
        # runner / writes its checkpoint), SIGKILL after 60 s. JOB_PART_ENV: this job wrote config.json
        codes = supervise({names.get(p, p): (base + [p, "--config", config] + passthrough, out / PARTS[p])
                           for p in parts}, report=report, procs=procs, env={**os.environ, JOB_PART_ENV: "1"},
                          pass_fds=(fd,))
    finally:
        stop_stream_status(status)
        os.close(fd)
    print(f"stream: stopped ({', '.join(f'{p} {code}' for p, code in codes.items())}); logs in {out}")
    return 0 if all(code == 0 for code in codes.values()) else 1  # a part failing on its way out fails

"""The one driver of a streaming Beam job (the feature pipeline's, ``stream.pipeline``, and the scorer's,
``stream.score``).

``drive(build, ...)`` clears the part's status files of an earlier run, builds the Beam pipeline on the runner that
``beam_args`` pick, runs it, writes the runner's own counts (Beam Metrics) to ``<out>/<part>-metrics.json`` every 5 s
and watches it until ``should_stop()`` (then cancels it) or the runner ends; the Kafka clients are closed after.
``registry_ready`` waits for a schema registry as the job waits for brokers; ``not_committed`` says, after a stop
with the brokers gone, which offsets a restart reads again.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import apache_beam as beam

from connectors.atomic import atomic_write
from connectors.kafka import brokers_unreachable, close_all_clients
from flowtrain.local.runners import beam_counters, pipeline_options, watch_pipeline
from pipelines.stream.formats import wait_for_registry
from pipelines.stream.status import clear_status


def registry_ready(registry: str | None, *, what: str, should_stop: Callable[[], bool]) -> bool:
    """True when there is no ``--schema-registry`` or it answers; False (said) when stopped while waiting for it."""
    if registry and not wait_for_registry(registry, what=what, should_stop=should_stop):
        print(f"{what}: stopped while waiting for the schema registry; nothing was read", flush=True)
        return False
    return True


def drive(build: Callable[[beam.Pipeline], None], *, what: str, out: Path, part: str, namespace: str,
          beam_args: Sequence[str], should_stop: Callable[[], bool], started: str) -> tuple[str, int]:
    """Run the streaming pipeline that ``build`` adds its steps to (printing ``started`` once it runs) until
    ``should_stop()`` or the runner ends: ``(the runner's final state, the exit code)``; ``watch_pipeline`` says
    what a failed or uncancellable job did. ``namespace``: the Beam Metrics namespace of the part's counters."""
    clear_status(str(out / f"{part}-status.json"))  # counters of an earlier run: the summary counts this run's
    p = beam.Pipeline(options=pipeline_options("streaming", list(beam_args)))
    build(p)
    result = p.run()
    print(started, flush=True)

    def save_metrics() -> None:  # the runner's own counts (Beam Metrics) every 5 s, beside the status files
        counts = beam_counters(result, namespace)
        atomic_write(out / f"{part}-metrics.json", json.dumps({"namespace": namespace, "counters": counts}))

    try:
        return watch_pipeline(result, p.options, should_stop, what=what, every=save_metrics)
    finally:
        close_all_clients()


def not_committed(what: str, bootstrap: str, kafka_config: dict, *, topic: str, group: str, again: str) -> None:
    """After a stop: when the brokers do not answer, say that the offsets read since the group's last commit were
    not committed (a stop is honoured whatever Kafka does) and what a restart does with them (``again``)."""
    unreachable = brokers_unreachable(bootstrap, client_config=kafka_config)
    if unreachable:
        print(f"{what}: not committed: {unreachable} at the stop: the offsets of {topic} read since group {group}'s "
              f"last commit; {again}", file=sys.stderr, flush=True)

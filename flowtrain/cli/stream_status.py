"""``--metrics-port``: what ``flowtrain stream`` (any half, or all) shows on Prometheus ``/metrics``
and its live status page (``flowtrain.observe.server``).

``StreamSampler(args, halves)`` makes one snapshot a second from what the job already leaves:

- the pipeline's and the scorer's per-instance counters (acknowledged by Kafka, summed):
  events, rows, unlabelled, dead letters, micro-batches, feature messages, predictions;
- the trainer's status file (step, version, rows trained, loss) and its ``metrics.jsonl``
  (the newest prequential metrics);
- Kafka itself: the lag of the pipeline's consumer group per raw partition (end offset minus
  committed offset), the dead-letter topic (counts by reason, the newest letters: read
  incrementally from its start), the model-updates topic (every published version, its time:
  freshness) and the scorer's accepted and rejected versions with their reasons.
"""
from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from flowtrain.commands.kafka_options import kafka_config
from flowtrain.commands.stream_pipeline import pipeline_totals

#: Distinct dead-letter reasons kept as label values; more are counted as "(other reasons)".
MAX_REASONS = 50
#: Newest dead letters and model versions shown on the page.
NEWEST = 20
#: Records read from a topic per snapshot at most (the rest the next second).
READ_PER_SAMPLE = 5000


class TopicTail:
    """Reads a topic from its start, a bounded number of records per call (no consumer group)."""

    def __init__(self, bootstrap: str, topic: str, cfg: dict):
        self.bootstrap, self.topic, self.cfg = bootstrap, topic, cfg
        self.consumer = None

    def read(self) -> list:
        from kafka import TopicPartition

        from connectors.kafka import new_consumer

        if self.consumer is None:
            consumer = new_consumer(self.bootstrap, self.cfg, group_id=None, enable_auto_commit=False,
                                    consumer_timeout_ms=100)
            parts = consumer.partitions_for_topic(self.topic)
            if not parts:  # not created yet: try again next time
                consumer.close()
                return []
            consumer.assign([TopicPartition(self.topic, p) for p in sorted(parts)])
            consumer.seek_to_beginning()
            self.consumer = consumer
        records = []
        polled = self.consumer.poll(timeout_ms=50, max_records=READ_PER_SAMPLE)
        for batch in polled.values():
            records.extend(batch)
        return records

    def close(self) -> None:
        if self.consumer is not None:
            from connectors.kafka import close_client

            close_client(self.consumer)
            self.consumer = None


def _header(record, name: str) -> str | None:
    for key, value in record.headers or []:
        if key == name:
            return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)
    return None


class StreamSampler:
    """One snapshot of a streaming job (the schema of ``flowtrain.observe.server``) per call."""

    def __init__(self, args, halves: Callable[[], dict[str, str]]):
        self.args, self.halves = args, halves
        self.out = Path(args.out)
        self.cfg = kafka_config(args.kafka_config, args.kafka_config_file)
        self.lag_consumer = None
        self.letters = TopicTail(args.bootstrap, args.dead_letter_topic, self.cfg)
        self.updates = TopicTail(args.bootstrap, args.updates_topic, self.cfg)
        self.reasons: dict[str, int] = {}
        self.newest_letters: deque = deque(maxlen=NEWEST)
        self.published: dict[int, dict] = {}

    def __call__(self) -> dict:
        halves = self.halves()
        states = set(halves.values())
        state = "running" if "running" in states else ("failed" if "failed" in states else "stopped")
        snap: dict = {"state": state, "halves": halves, "counters": {}}
        self._pipeline(snap)
        self._trainer(snap)
        self._scorer(snap)
        self._kafka(snap)
        return snap

    # --- files the halves write ---------------------------------------------------------------------
    def _pipeline(self, snap: dict) -> None:
        from pipelines.flights.status import read_status

        totals = {"events": 0, "rows": 0, "unlabelled": 0, "dead_letters": 0, "micro_batches": 0,
                  "feature_messages": 0}
        errors = []
        for data in read_status(str(self.out / "pipeline-status.json")):
            for key, source in (("events", "events"), ("rows", "rows"), ("unlabelled", "unlabelled"),
                                ("dead_letters", "dead_letters"), ("micro_batches", "batches"),
                                ("feature_messages", "messages")):
                totals[key] += int(data.get(source, 0) or 0)
            if data.get("error"):
                errors.append(data["error"])
        snap["counters"].update(totals)
        if errors:
            snap["errors"] = errors

    def _trainer(self, snap: dict) -> None:
        try:
            trainer = json.loads((self.out / "trainer-status.json").read_text())
        except (OSError, ValueError):
            trainer = {}
        if trainer:
            snap["trainer_step"] = trainer.get("step")
            snap["train_loss"] = trainer.get("loss")
            snap["counters"]["rows_trained"] = trainer.get("rows", 0)
            snap["counters"]["duplicate_rows_dropped"] = trainer.get("dropped_duplicates", 0)
        newest = None
        try:
            with open(self.out / "metrics.jsonl") as fh:
                for line in fh:
                    if '"prequential"' in line:
                        newest = line
        except OSError:
            pass
        if newest:
            try:
                record = json.loads(newest)
            except ValueError:
                record = {}
            snap["prequential"] = {k: v for k, v in record.items()
                                   if k not in ("kind", "step", "version", "time", "rows_trained", "rows")
                                   and isinstance(v, (int, float))}

    def _scorer(self, snap: dict) -> None:
        from pipelines.flights.status import read_status

        prefix = str(self.out / "score-status.json")
        predictions = latency_ms = 0
        bounds, buckets = None, None
        serving, newest = None, -1.0
        for data in read_status(prefix, "predictions"):
            predictions += int(data.get("predictions", 0) or 0)
            latency_ms += int(data.get("latency_ms_sum", 0) or 0)
            counts = data.get("latency_buckets")
            if counts and (bounds is None or data.get("latency_buckets_s") == bounds):
                bounds = data.get("latency_buckets_s")
                buckets = [a + int(b) for a, b in zip(buckets or [0] * len(counts), counts)]
            if data.get("version") is not None and data.get("time", 0) > newest:
                newest, serving = data["time"], data["version"]
        rejected = []
        for data in read_status(prefix, "versions"):
            rejected.extend(data.get("rejected") or [])
            if serving is None and data.get("version") is not None:
                serving = data["version"]
        if predictions or serving is not None or rejected:
            snap["counters"]["predictions"] = predictions
            snap["latency"] = {"count": predictions, "sum_s": latency_ms / 1000.0}
            if bounds and buckets and sum(buckets) == predictions:
                cumulative = [sum(buckets[:i + 1]) for i in range(len(bounds))]
                snap["latency"]["buckets"] = [[float(b), c] for b, c in zip(bounds, cumulative)]
            snap["serving_version"] = serving
            snap["rejected_versions"] = rejected[-NEWEST:]

    # --- Kafka ------------------------------------------------------------------------------------
    def _kafka(self, snap: dict) -> None:
        try:
            snap["lag"] = self._lag()
        except Exception as err:  # noqa: BLE001 - the broker may be briefly away: the page says so
            snap["sample_error"] = f"consumer lag: {type(err).__name__}: {err}"[:300]
        try:
            for record in self.letters.read():
                reason = _header(record, "reason") or "(no reason)"
                if reason not in self.reasons and len(self.reasons) >= MAX_REASONS:
                    reason = "(other reasons)"
                self.reasons[reason] = self.reasons.get(reason, 0) + 1
                payload = (record.value or b"")[:200].decode("utf-8", errors="replace")
                self.newest_letters.appendleft({"time": record.timestamp / 1000.0, "reason": reason,
                                                "source": _header(record, "source"), "payload": payload})
            for record in self.updates.read():
                try:
                    update = json.loads(record.value)
                    version = int(update["version"])
                except (ValueError, KeyError, TypeError):
                    continue
                self.published[version] = {"version": version, "time": float(update.get("time")
                                                                             or record.timestamp / 1000.0),
                                           "run_id": update.get("run_id")}
        except Exception as err:  # noqa: BLE001
            snap["sample_error"] = f"topics: {type(err).__name__}: {err}"[:300]
        snap["dead_letters_by_reason"] = dict(self.reasons)
        snap["dead_letters"] = list(self.newest_letters)
        if self.published:
            newest = max(self.published)
            snap["published_version"] = newest
            snap["freshness_s"] = max(0.0, time.time() - self.published[newest]["time"])
        versions = []
        serving = snap.get("serving_version")
        for version in sorted(self.published, reverse=True)[:NEWEST]:
            v = self.published[version]
            versions.append({**v, "state": "serving" if version == serving else "published"})
        for r in reversed(snap.pop("rejected_versions", [])):
            versions.append({"version": r.get("version"), "state": "rejected", "reason": r.get("reason")})
        snap["versions"] = versions

    def _lag(self) -> dict[str, int]:
        from kafka import TopicPartition

        from connectors.kafka import new_consumer

        if self.lag_consumer is None:
            self.lag_consumer = new_consumer(self.args.bootstrap, self.cfg, group_id=self.args.group_id,
                                             enable_auto_commit=False)
        consumer = self.lag_consumer
        parts = consumer.partitions_for_topic(self.args.raw_topic) or []
        tps = [TopicPartition(self.args.raw_topic, p) for p in sorted(parts)]
        if not tps:
            return {}
        ends = consumer.end_offsets(tps)
        return {str(tp.partition): max(0, ends[tp] - (consumer.committed(tp) or 0)) for tp in tps}

    def close(self) -> None:
        from connectors.kafka import close_client

        if self.lag_consumer is not None:
            close_client(self.lag_consumer)
            self.lag_consumer = None
        self.letters.close()
        self.updates.close()


def serve_stream_status(args, halves: Callable[[], dict[str, str]], *, title: str):
    """Start ``/metrics`` and the status page on 127.0.0.1:``args.metrics_port`` (None when 0: off);
    ``stop_stream_status`` ends it. A port in use is a ``FlowtrainError`` naming ``--metrics-port``."""
    from flowtrain.observe.server import start_status_server

    port = getattr(args, "metrics_port", 0)
    if not port:
        return None
    sampler = StreamSampler(args, halves)
    server = start_status_server(port, sampler, title=title)
    server.sampler = sampler
    print(f"{title}: metrics on {server.url}metrics, status page on {server.url}", flush=True)
    return server


def stop_stream_status(server) -> None:
    """Stop sampling and serving, close the sampler's Kafka clients."""
    if server is None:
        return
    server.stop()
    server.sampler.close()


#: Added to the command line of the halves a whole job starts: the parent serves the port.
CHILD_ARGS = ["--metrics-port", "0"]
#: Set in the environment of the parts a whole ``flowtrain stream`` job starts: the job wrote ``config.json``.
JOB_PART_ENV = "FLOWTRAIN_STREAM_JOB_PART"


def process_states(procs: dict) -> Callable[[], dict[str, str]]:
    """The halves' states from their processes (``procs``: half -> ``Popen``, filled in as they start)."""
    def states() -> dict[str, str]:
        return {half: "running" if proc.poll() is None else ("stopped" if proc.returncode == 0 else "failed")
                for half, proc in list(procs.items())}
    return states


def with_stream_status(args, half: str, run: Callable[[], int]) -> int:
    """``run()`` (one half of the job, in this process) with ``/metrics`` and the page on ``--metrics-port``."""
    server = serve_stream_status(args, lambda: {half: "running"}, title=f"flowtrain stream {half}")
    try:
        return run()
    finally:
        stop_stream_status(server)


# --- the live line a whole job prints each second ---------------------------------------------------------
def live_line(args, out: Path, last: tuple[float, int]) -> tuple[str, tuple[float, int]]:
    """The pipeline's and the trainer's progress in one line; ``last``: (time, events) of the previous line."""
    pipe = pipeline_totals(out)  # what Kafka acknowledged, summed over the pipeline's DoFn instances
    try:
        trainer = json.loads((out / "trainer-status.json").read_text())
    except (OSError, ValueError):
        trainer = {}
    now = time.monotonic()
    rate = (pipe["events"] - last[1]) / max(now - last[0], 1e-9)
    lag = raw_lag(args)
    loss = trainer.get("loss")
    line = (f"events/s {rate:8,.0f} | lag {lag if lag is not None else '?':>7} | step {trainer.get('step', 0):6} "
            f"| loss {loss if loss is None else f'{loss:.4f}'} | unlabelled {pipe['unlabelled']:,} "
            f"| dead letters {pipe['dead_letters']:,}")
    return line, (now, pipe["events"])


def raw_lag(args) -> int | None:
    """Events on the raw topic the pipeline's consumer group has not committed (None: unknown)."""
    try:
        from kafka import TopicPartition

        from connectors.kafka import close_client, new_consumer

        consumer = new_consumer(args.bootstrap, kafka_config(args.kafka_config, args.kafka_config_file),
                                group_id=args.group_id)
        try:
            tps = [TopicPartition(args.raw_topic, p) for p in consumer.partitions_for_topic(args.raw_topic) or []]
            ends = consumer.end_offsets(tps)
            return sum(ends[tp] - (consumer.committed(tp) or 0) for tp in tps)
        finally:
            close_client(consumer)
    except Exception:  # noqa: BLE001 - the live line must not stop the job
        return None

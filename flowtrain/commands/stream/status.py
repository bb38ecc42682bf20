"""What a running ``flowtrain stream`` job shows: with ``--metrics-port`` (any half, or all) Prometheus
``/metrics`` and its live status page (``flowtrain.observe.server``); a whole job's live line (``live_line``,
``serving_line``).

``StreamSampler(args, halves)`` makes one snapshot a second from what the job already leaves:

- the pipeline's and the scorer's per-instance counters (acknowledged by Kafka, summed):
  events, rows, unlabelled, dead letters, micro-batches, feature messages, predictions;
- the trainer's status file (step, version, rows trained, loss) and its ``metrics.jsonl``
  (the newest prequential metrics);
- Kafka itself: the lag of the pipeline's consumer group per raw partition (end offset minus
  committed offset), the dead-letter topic (counts by reason, the newest letters: read
  incrementally from its start), the model-updates topic (``UpdateRecords``: every published
  version that verifies, its time: freshness) and the scorer's accepted and rejected versions with
  their reasons. With an update key (``--update-key-file``, ``$FLOWTRAIN_UPDATE_KEY``) only records
  signed with it count as published; a record that fails (unsigned, forged, malformed, a replay) is
  listed as rejected with its reason and counted (``rejected_updates``), never as a version. Without
  a key nothing can be verified: well-formed records count, as the scorer believes them, marked
  ``published (unsigned)``.
"""
from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from kafka import TopicPartition

from connectors.deadletter import reason_kind
from connectors.kafka import KafkaUnavailable, close_client, new_consumer, topic_end_offsets, topic_partitions
from connectors.model_updates import RejectedUpdate, UpdateKeySource, check_record
from flowtrain.commands.kafka_options import kafka_config
from flowtrain.commands.stream.pipeline import pipeline_totals
from flowtrain.observe.server import start_status_server
from flowtrain.train.rundir.files import RunFiles
from pipelines.serving.drift import DRIFT_REFERENCE, window_report
from pipelines.stream.status import read_status

#: Distinct dead-letter reasons kept as label values; more are counted as "(other reasons)".
MAX_REASONS = 50
#: Newest dead letters and model versions shown on the page.
NEWEST = 20
#: Records read from a topic per snapshot at most (the rest the next second).
READ_PER_SAMPLE = 5000
#: Seconds the status page and the live line wait for a topic's partitions before they say the brokers do not
#: answer (kafka-python's own wait has no bound: the page, and the job's stop, would hang with the brokers gone).
KAFKA_WAIT_S = 5.0


class TopicTail:
    """Reads a topic from its start, a bounded number of records per call (no consumer group)."""

    def __init__(self, bootstrap: str, topic: str, cfg: dict):
        self.bootstrap, self.topic, self.cfg = bootstrap, topic, cfg
        self.consumer = None

    def read(self) -> list:
        if self.consumer is None:
            consumer = new_consumer(self.bootstrap, self.cfg, group_id=None, enable_auto_commit=False,
                                    consumer_timeout_ms=100)
            try:
                parts = topic_partitions(consumer, self.topic, timeout_s=KAFKA_WAIT_S)
            except BaseException:
                close_client(consumer)
                raise
            if not parts:  # not created yet: try again next time
                close_client(consumer)
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
            close_client(self.consumer)
            self.consumer = None


class UpdateRecords:
    """The model-updates topic as the page shows it: versions that verify (``check_record`` with the
    key, versions of a run moving forward) and rejected records with their reasons.

    ``add(where, value, timestamp_ms)`` takes one record; ``published_version()`` is the version
    published last (its signed ``sequence``, else the Kafka timestamp), not the largest number
    (versions are numbered per trainer run)."""

    def __init__(self, key: bytes | None, key_error: str | None = None):
        self.key, self.key_error = key, key_error  # key_error: a key is configured but cannot be read
        self.published: dict[tuple[str, int], dict] = {}  # (run id, version) -> {version, run_id, time, order}
        self.rejected: deque = deque(maxlen=NEWEST)  # newest last: {version, published_at, reason}
        self.rejected_count = 0
        self._newest: dict[str, tuple[int, str | None]] = {}  # run -> (version, sha256) read last

    def add(self, where: str, value: bytes | None, timestamp_ms: int) -> None:
        if self.key_error is not None:  # nothing verifies; never believed unsigned instead
            self._reject(where, None, f"cannot be verified: {self.key_error}")
            return
        try:
            rec = check_record(value, self.key)
        except RejectedUpdate as err:
            self._reject(where, None, str(err))
            return
        newest = self._newest.get(rec.run_id)
        if newest is not None and rec.version <= newest[0]:
            if (rec.version, rec.sha256) != newest:  # (the same version again: a producer's retry)
                self._reject(where, rec.version, f"not newer than version {newest[0]} of its run "
                                                  f"{rec.run_id or '(unnamed)'} (a replayed or stale record)")
            return
        self._newest[rec.run_id] = (rec.version, rec.sha256)
        at_ms = rec.sequence if rec.sequence is not None else int(timestamp_ms)
        partition, offset = (int(x) for x in where.rsplit("/", 2)[1:])
        self.published[(rec.run_id, rec.version)] = {"version": rec.version, "run_id": rec.run_id,
                                                     "time": at_ms / 1000.0, "order": (at_ms, partition, offset)}
        if len(self.published) > 10 * NEWEST:  # the oldest are never shown
            for k in sorted(self.published, key=lambda k: self.published[k]["order"])[:NEWEST]:
                del self.published[k]

    def _reject(self, where: str, version: int | None, reason: str) -> None:
        self.rejected.append({"version": version, "published_at": where, "reason": reason})
        self.rejected_count += 1

    def newest(self) -> dict | None:
        return max(self.published.values(), key=lambda v: v["order"]) if self.published else None

    def versions(self, serving: int | None, scorer_rejected: list[dict], serving_run: str | None = None) -> list[dict]:
        """Newest first: published versions (``published``, ``published (unsigned)`` without a key, or
        ``serving``), then rejected records (this page's and the scorer's, once each), with their reasons."""
        state = "published" if self.key is not None else "published (unsigned)"
        out = []
        for v in sorted(self.published.values(), key=lambda v: v["order"], reverse=True)[:NEWEST]:
            out.append({"version": v["version"], "run_id": v["run_id"], "time": v["time"],
                        "state": "serving" if v["version"] == serving and serving_run in (None, v["run_id"])
                        else state})
        seen = set()
        for r in [*reversed(self.rejected), *reversed(scorer_rejected)]:  # this page's reason first
            where = r.get("published_at")
            if where is not None and where in seen:
                continue
            seen.add(where)
            out.append({"version": r.get("version"), "state": "rejected", "reason": r.get("reason"),
                        "published_at": where})
            if len(seen) >= NEWEST:
                break
        return out


def update_records(args) -> UpdateRecords:
    """``UpdateRecords`` with the job's update key (``--update-key-file`` or the environment); a key
    that is configured but cannot be read verifies nothing (the command itself says why)."""
    source = UpdateKeySource.from_options(getattr(args, "update_key_file", None))
    try:
        return UpdateRecords(source.load() if source is not None else None)
    except ValueError as err:
        return UpdateRecords(None, key_error=str(err))


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
        self.update_records = update_records(args)

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
        totals = {"events": 0, "rows": 0, "unlabelled": 0, "dead_letters": 0, "micro_batches": 0,
                  "feature_messages": 0}
        errors = []
        for data in read_status(str(RunFiles(self.out).pipeline_status)):
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
            trainer = json.loads(RunFiles(self.out).trainer_status.read_text())
        except (OSError, ValueError):
            trainer = {}
        if trainer:
            snap["trainer_step"] = trainer.get("step")
            snap["train_loss"] = trainer.get("loss")
            snap["counters"]["rows_trained"] = trainer.get("rows", 0)
            snap["counters"]["duplicate_rows_dropped"] = trainer.get("dropped_duplicates", 0)
        newest = None
        try:
            with open(RunFiles(self.out).metrics) as fh:
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
        prefix = str(RunFiles(self.out).score_status)
        predictions = latency_ms = 0
        bounds, buckets = None, None
        serving, newest = None, -1.0
        unseen: dict[str, int] = {}
        by_version: dict[str, int] = {}
        for data in read_status(prefix, "predictions"):
            predictions += int(data.get("predictions", 0) or 0)
            for version, n in (data.get("versions") or {}).items():
                by_version[str(version)] = by_version.get(str(version), 0) + int(n or 0)
            for column, n in (data.get("unseen") or {}).items():
                unseen[column] = unseen.get(column, 0) + int(n or 0)
            latency_ms += int(data.get("latency_ms_sum", 0) or 0)
            counts = data.get("latency_buckets")
            if counts and (bounds is None or data.get("latency_buckets_s") == bounds):
                bounds = data.get("latency_buckets_s")
                buckets = [a + int(b) for a, b in zip(buckets or [0] * len(counts), counts)]
            if data.get("version") is not None and data.get("time", 0) > newest:
                newest, serving = data["time"], data["version"]
                snap["serving_run"] = data.get("run_id")
        rejected, rejected_count, announced = [], 0, None
        for data in read_status(prefix, "versions"):
            rejected.extend(data.get("rejected") or [])
            rejected_count = max(rejected_count, int(data.get("rejected_count", 0) or 0))
            if serving is None and data.get("version") is not None:
                serving = data["version"]
            if data.get("version") is not None and (announced is None or (data.get("announced_at") or 0) >
                                                    (announced.get("announced_at") or 0)):
                announced = data
        snap["scorer_rejected_count"] = rejected_count
        if by_version:
            snap["predictions_by_version"] = by_version
        if announced is not None:
            snap.update(serving_lag(announced, serving, snap.get("serving_run")))
        if predictions or serving is not None or rejected:
            snap["counters"]["predictions"] = predictions
            snap["unseen"] = unseen
            snap["latency"] = {"count": predictions, "sum_s": latency_ms / 1000.0}
            if bounds and buckets and sum(buckets) == predictions:
                cumulative = [sum(buckets[:i + 1]) for i in range(len(bounds))]
                snap["latency"]["buckets"] = [[float(b), c] for b, c in zip(bounds, cumulative)]
            snap["serving_version"] = serving
            snap["rejected_versions"] = rejected[-NEWEST:]

        drift = window_report(prefix, str(self.out / DRIFT_REFERENCE))  # the instances' windows, compared
        if drift is not None:
            snap["drift"] = drift

    # --- Kafka ------------------------------------------------------------------------------------
    def _kafka(self, snap: dict) -> None:
        try:
            snap["lag"] = self._lag()
        except Exception as err:  # noqa: BLE001 - the broker may be briefly away: the page says so
            snap["sample_error"] = f"consumer lag: {type(err).__name__}: {err}"[:300]
        try:
            for record in self.letters.read():
                reason = _header(record, "reason") or "(no reason)"
                kind = reason_kind(reason)  # counted by kind ("broken JSON"); the newest letters keep the reason
                if kind not in self.reasons and len(self.reasons) >= MAX_REASONS:
                    kind = "(other reasons)"
                self.reasons[kind] = self.reasons.get(kind, 0) + 1
                payload = (record.value or b"")[:200].decode("utf-8", errors="replace")
                self.newest_letters.appendleft({"time": record.timestamp / 1000.0, "reason": reason,
                                                "source": _header(record, "source"), "payload": payload})
            for record in self.updates.read():  # only what verifies counts (UpdateRecords)
                self.update_records.add(f"{record.topic}/{record.partition}/{record.offset}", record.value,
                                        record.timestamp)
        except Exception as err:  # noqa: BLE001
            snap["sample_error"] = f"topics: {type(err).__name__}: {err}"[:300]
        snap["dead_letters_by_reason"] = dict(self.reasons)
        snap["dead_letters"] = list(self.newest_letters)
        updates = self.update_records
        newest = updates.newest()
        if newest is not None:
            snap["published_version"] = newest["version"]
            snap["freshness_s"] = max(0.0, time.time() - newest["time"])
        rejected = max(updates.rejected_count, snap.pop("scorer_rejected_count", 0))
        if rejected:
            snap["counters"]["rejected_updates"] = rejected
        snap["versions"] = updates.versions(snap.get("serving_version"), snap.pop("rejected_versions", []),
                                            snap.pop("serving_run", None))

    def _lag(self) -> dict[str, int]:
        if self.lag_consumer is None:
            self.lag_consumer = new_consumer(self.args.bootstrap, self.cfg, group_id=self.args.group_id,
                                             enable_auto_commit=False)
        consumer = self.lag_consumer
        try:
            ends = topic_end_offsets(consumer, self.args.raw_topic, timeout_s=KAFKA_WAIT_S)
        except KafkaUnavailable:  # a new consumer next time (closing this one ends its wait)
            close_client(consumer)
            self.lag_consumer = None
            raise
        return {str(tp.partition): max(0, end - (consumer.committed(tp) or 0)) for tp, end in ends.items()}

    def close(self) -> None:
        if self.lag_consumer is not None:
            close_client(self.lag_consumer)
            self.lag_consumer = None
        self.letters.close()
        self.updates.close()


def serve_stream_status(args, halves: Callable[[], dict[str, str]], *, title: str):
    """Start ``/metrics`` and the status page on 127.0.0.1:``args.metrics_port`` (None when 0: off);
    ``stop_stream_status`` ends it. A port in use is a ``FlowtrainError`` naming ``--metrics-port``."""
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
        trainer = json.loads(RunFiles(out).trainer_status.read_text())
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
    """Events on the raw topic the pipeline's consumer group has not committed (None: unknown, e.g. the brokers
    did not answer within ``KAFKA_WAIT_S`` seconds)."""
    try:
        wait_ms = int(KAFKA_WAIT_S * 1000)
        consumer = new_consumer(args.bootstrap, kafka_config(args.kafka_config, args.kafka_config_file),
                                group_id=args.group_id, bootstrap_timeout_ms=wait_ms)
        try:
            ends = topic_end_offsets(consumer, args.raw_topic, timeout_s=KAFKA_WAIT_S)
            return sum(end - (consumer.committed(tp, timeout_ms=wait_ms) or 0) for tp, end in ends.items())
        finally:
            close_client(consumer)
    except Exception:  # noqa: BLE001 - the live line must not stop the job
        return None


def serving_lag(announced: dict, serving: int | None, serving_run: str | None, now: float | None = None) -> dict:
    """The scorer's serving lag: the newest version a scorer instance announced (its ``versions`` status: version,
    run id, when it found it) against the version the newest predictions carry. In versions (0 when they are the
    same; the announced run's number minus the served one within a run, 1 across runs) and in seconds since the
    announcement while they differ (0 when the newest predictions carry it)."""
    version, at = announced.get("version"), float(announced.get("announced_at") or 0.0)
    out = {"announced_version": version}
    if serving is None or version is None:
        return out
    same_run = serving_run is None or serving_run == announced.get("run_id")
    behind = serving != version or not same_run
    out["serving_lag_versions"] = (max(0, int(version) - int(serving)) if same_run else 1) if behind else 0
    out["serving_lag_s"] = max(0.0, (time.time() if now is None else now) - at) if behind and at else 0.0
    return out


def serving_status(out: Path) -> dict:
    """Serving version (of the newest prediction), online accuracy and counts from the scorer's status files."""
    prefix = str(RunFiles(out).score_status)
    totals = {"predictions": 0, "labelled": 0, "correct": 0, "version": None, "rejected": 0, "events": 0,
              "dead_letters": 0}
    newest = -1.0
    for data in read_status(prefix, "predictions"):
        for k in ("predictions", "labelled", "correct"):
            totals[k] += data.get(k, 0)
        totals["dead_letters"] += data.get("dead_letters", 0)  # predictions that could not be written
        if data.get("version") is not None and data["time"] > newest:
            newest, totals["version"] = data["time"], data["version"]
    for data in read_status(prefix, "featurize"):
        totals["events"] += data.get("events", 0)
        totals["dead_letters"] += data.get("dead_letters", 0)
        for name, n in (data.get("id_fallbacks") or {}).items():  # events scored with an ID's fallback vector
            fallbacks = totals.setdefault("id_fallbacks", {})
            fallbacks[name] = fallbacks.get(name, 0) + n
    for data in read_status(prefix, "versions"):
        totals["rejected"] = max(totals["rejected"], data.get("rejected_count", len(data.get("rejected", []))))
    totals["accuracy"] = totals["correct"] / totals["labelled"] if totals["labelled"] else None
    return totals


def serving_line(out: Path) -> str:
    """The scorer's part of a whole job's live line (``stream --score``)."""
    s = serving_status(out)
    version = "-" if s["version"] is None else f"v{s['version']}"
    acc = "-" if s["accuracy"] is None else f"{s['accuracy']:.3f}"
    rejected = f" | rejected versions {s['rejected']}" if s["rejected"] else ""
    return f"serving {version} | online acc {acc} ({s['labelled']:,} labelled){rejected}"

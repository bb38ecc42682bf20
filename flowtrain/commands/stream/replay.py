"""``flowtrain replay`` as a job: a table's rows (or the demo's events, or a generated click stream) as events
into a Kafka topic, every one acknowledged (``connectors.kafka.produce``).

``run_replay(job)`` takes a ``ReplayJob`` (``flowtrain.commands.stream.options``), prints the command's lines and returns
the counts. A bad input is a ``FlowtrainError`` naming it; no broker, or an event Kafka did not acknowledge,
ends the process with a one-line message (as the command does).
"""
from __future__ import annotations

import dataclasses
import json
import random
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa

from connectors.dataset import read_manifest
from connectors.dataset_spec import FeatureSpec
from connectors.deadletter import reason_kind
from connectors.kafka import (
    KafkaUnavailable,
    ProduceError,
    ensure_topic,
    new_sender,
    retry_kafka,
    summarize_reconnects,
    topic_config,
)
from connectors.kafka import check_brokers as reachable
from flowtrain.commands.dead_letter_bound import check_dead_letters
from flowtrain.commands.kafka_options import kafka_config
from flowtrain.commands.stream.inputs import raw_partitions
from flowtrain.commands.stream.options import ReplayJob, with_dataset_topics
from flowtrain.errors import FlowtrainError
from pipelines.features.transactions import generate_transactions
from pipelines.ids.clicks import generate_clicks
from pipelines.presets import default_preset
from pipelines.stream.events import ParseBounds, event_schema
from pipelines.stream.featurize import StreamFeaturizer
from pipelines.stream.formats import event_format
from pipelines.stream.replay import (
    MALFORMED_KINDS,
    drop_label,
    event_keys,
    kafka_timestamps,
    malform_event,
    order_by_time,
    read_files,
    table_events,
)


def run_replay(job: ReplayJob) -> dict:
    """Produce ``job``'s events; returns ``{"events", "unlabelled", <malformed kind>: n, ..., "seconds"}``."""
    job = with_dataset_topics(job)  # --topic from --dataset
    summarize_reconnects()  # kafka-python's reconnect warnings: one line when an outage starts, one when it ends
    cfg = kafka_config(job.kafka_config, job.kafka_config_file)
    if job.generate:  # a synthetic stream, written as a table and replayed like --input
        if job.input:
            raise FlowtrainError("--generate makes the events: leave out --input")
        if job.generate == "transactions":
            job = dataclasses.replace(job, input=(_generated_transactions(job),), label=job.label or "fraud",
                                      key_column=job.key_column or "card")
        else:
            job = dataclasses.replace(job, input=(_generated_clicks(job),), label=job.label or "clicked")
    try:
        events, kinds, oldest_ms, label = _table_events(job) if job.input else (*_preset_events(job), None, None)
    except FlowtrainError:
        raise  # its own exit status (3: too many dead letters)
    except ValueError as err:
        raise FlowtrainError(str(err)) from None
    check_brokers(job, "flowtrain replay")
    # Records stamped with past event times: a topic this creates keeps them whatever their age
    # (retention.ms -1); an existing topic must keep them until they are read.
    ensure_topic(job.bootstrap, job.topic, partitions=job.partitions, client_config=cfg,
                 replication_factor=job.replication_factor,
                 config={"retention.ms": "-1"} if oldest_ms is not None else None)
    if oldest_ms is not None:
        retention = _retention_ms(job.bootstrap, job.topic, cfg)
        if retention is not None and retention >= 0 and oldest_ms < time.time() * 1000 - retention:
            raise FlowtrainError(
                f"--time-column stamps records with times as old as "
                f"{time.strftime('%Y-%m-%d', time.gmtime(oldest_ms / 1000))}, but topic {job.topic!r} deletes "
                f"records older than its retention.ms {retention:,} before anyone reads them; replay into a new "
                f"topic (created with retention.ms -1), set the topic's retention.ms to -1, or leave --time-column out")
    # a dead broker of a cluster still in the metadata may be asked first: retried on the others
    partitions = retry_kafka(lambda: raw_partitions(job.bootstrap, job.topic, cfg), f"the partitions of {job.topic!r}")
    sender = new_sender(job.client, job.bootstrap, cfg, what="flowtrain replay")
    counts = {"events": 0, "unlabelled": 0, **{k: 0 for k in kinds}}
    t0 = time.monotonic()
    try:
        for value, key, timestamp_ms, kind in events:
            partition = None if key is not None else counts["events"] % partitions  # no key: round robin
            sender.send(job.topic, value, key, timestamp_ms=timestamp_ms, partition=partition)
            counts["events"] += 1
            if kind:
                counts[kind] += 1
            if job.rate:
                ahead = counts["events"] / job.rate - (time.monotonic() - t0)
                if ahead > 0:
                    time.sleep(ahead)
        sender.confirm()  # every event acknowledged by Kafka before it is counted
    except ProduceError as err:
        raise SystemExit(f"flowtrain replay: {err}") from None
    except (ValueError, RuntimeError) as err:  # an event its --event-format schema cannot hold, a registry error
        if job.event_format == "json":
            raise
        raise SystemExit(f"flowtrain replay: {err}") from None
    finally:
        sender.close()
    took = time.monotonic() - t0
    bad = {k: counts[k] for k in kinds if counts[k]}
    if job.input and label is None:  # no label column known: unlabelled events cannot be told from the others
        counts["unlabelled"] = None
    unlabelled = "" if not job.input else f"; unlabelled: {counts['unlabelled']:,}" if label is not None else \
        "; unlabelled: not counted (no --label or --dataset names the label column)"
    print(f"replay: {counts['events']:,} events to {job.topic} in {took:.1f} s "
          f"({counts['events'] / max(took, 1e-9):,.0f}/s, {job.client}); malformed: {bad or 'none'}{unlabelled}")
    return {**counts, "seconds": took}


def check_brokers(job, command: str) -> None:
    """No broker at ``job.bootstrap``: one line naming it, within ``--connect-timeout`` (not a traceback)."""
    try:
        reachable(job.bootstrap, timeout_s=job.connect_timeout,
                  client_config=kafka_config(job.kafka_config, job.kafka_config_file))
    except KafkaUnavailable as err:
        raise SystemExit(f"{command}: {err}") from None


def _preset_events(job: ReplayJob):
    """The default dataset preset's events (the demo's, ``pipelines.presets``): (value, key, timestamp, malformed
    kind) per event, as ever."""
    for name in ("time_column", "key_column", "label", "dataset", "max_event_bytes"):
        if getattr(job, name) is not None:
            raise ValueError(f"--{name.replace('_', '-')} is for --input FILES (the demo's events have their own)")
    if job.unlabelled:
        raise ValueError("--unlabelled is for --input FILES")
    preset = default_preset()
    if preset.replay is None:
        raise ValueError(f"dataset preset {preset.name!r} has no events to replay: give your files with --input")
    replay = preset.replay()
    encode = _encoder(job, replay.schema, preset.name)
    return _replayed(job, replay.rows, replay.malformed_kinds, replay.malform, encode=encode), replay.malformed_kinds


def _generated_clicks(job: ReplayJob) -> str:
    """--generate clicks: the events as a CSV (and truth.csv beside it) in --generate-out or a temporary directory."""
    import pyarrow.csv as pacsv

    n = job.limit if job.limit is not None else 100_000
    out = Path(job.generate_out) if job.generate_out else Path(tempfile.mkdtemp(prefix="flowtrain-clicks-"))
    out.mkdir(parents=True, exist_ok=True)
    table, truth = generate_clicks(n + job.skip, seed=job.seed)
    pacsv.write_csv(table, out / "clicks.csv")
    pacsv.write_csv(pa.table({"time": table.column("time"), "p_click": pa.array(truth)}), out / "truth.csv")
    print(f"replay: generated {table.num_rows:,} click events ({len(set(table.column('user').to_pylist())):,} users) "
          f"into {out / 'clicks.csv'}, true click probabilities in {out / 'truth.csv'}", flush=True)
    return str(out / "clicks.csv")


def _generated_transactions(job: ReplayJob) -> str:
    """--generate transactions: card payments (transactions.csv, keyed by card when replayed) and the merchants'
    versioned risk tiers (merchants.csv, for --join merchants.csv:merchant:valid_from) in --generate-out or a
    temporary directory; ``--out-of-order S``: delivered up to S seconds late, in arrival order."""
    import pyarrow.csv as pacsv

    n = job.limit if job.limit is not None else 100_000
    out = Path(job.generate_out) if job.generate_out else Path(tempfile.mkdtemp(prefix="flowtrain-transactions-"))
    out.mkdir(parents=True, exist_ok=True)
    txns, merchants = generate_transactions(n + job.skip, delay_s=float(job.out_of_order),
                                            seed=job.seed)
    pacsv.write_csv(txns, out / "transactions.csv")
    pacsv.write_csv(merchants, out / "merchants.csv")
    frauds = int(np.asarray(txns.column("fraud")).sum())
    print(f"replay: generated {txns.num_rows:,} card payments ({frauds:,} fraud) into {out / 'transactions.csv'}, "
          f"the merchants' risk tiers in {out / 'merchants.csv'}", flush=True)
    return str(out / "transactions.csv")


def _table_events(job: ReplayJob):
    """--input FILES: (value, key, timestamp, kind) per row, in event-time order; kind is a
    malformed kind, "unlabelled" or None."""
    spec = manifest = None
    if job.dataset:
        try:
            manifest = read_manifest(job.dataset)
            spec = FeatureSpec.from_dict(manifest["spec"])
        except Exception as err:  # noqa: BLE001 - not a dataset, or one without a spec
            raise ValueError(f"--dataset {job.dataset}: not a `flowtrain batch` dataset with a spec "
                             f"({type(err).__name__}: {str(err)[:200]})") from None
    label = job.label or (spec.label if spec else None)
    if job.unlabelled and not label:
        raise ValueError("--unlabelled needs the label column: --label COL or --dataset DIR")
    table = read_files(list(job.input))
    for name, col in (("--key-column", job.key_column), ("--label", job.label)):
        if col and col not in table.column_names:
            raise ValueError(f"{name} {col!r} is not a column of {' '.join(job.input)}; it has "
                             f"{', '.join(table.column_names)}")
    if label not in table.column_names and label is not None:  # the dataset's label: events may lack it
        print(f"replay: {' '.join(job.input)} has no column {label!r} (the label of --dataset {job.dataset}): every "
              f"event is unlabelled (scored, not trained on)", flush=True)
    table, times = order_by_time(table, job.time_column, spec.time_format if spec else None)
    schema = event_schema(spec) if spec else None
    if job.event_format != "json" and schema is None:
        raise ValueError(f"--event-format {job.event_format} needs --dataset DIR (its spec gives the events' "
                         f"schema)")
    _check_rows(job, table, manifest)  # --max-dead-letter-fraction: before anything is sent
    encode = _encoder(job, schema, Path(job.dataset).resolve().name if job.dataset else "Event")
    kinds = tuple(k for k in MALFORMED_KINDS if k != "event too large" or job.max_event_bytes)
    bounds = ParseBounds(max_event_bytes=job.max_event_bytes) if job.max_event_bytes else ParseBounds()

    def malformed(event, kind, rng):
        return malform_event(event, kind, rng, schema, bounds)

    rows = event_keys(table_events(table), job.key_column)
    oldest = None if times is None or not np.isfinite(times).any() else float(np.nanmin(times))
    return _replayed(job, rows, kinds, malformed, label=label, times=times, encode=encode), kinds, oldest, label


def _check_rows(job: ReplayJob, table: pa.Table, manifest: dict | None) -> None:
    """With ``--max-dead-letter-fraction``: the rows whose events the stream would make dead letters (its own
    featurizer, ``StreamFeaturizer``, on the events as JSON: the event checks and the batch ETL's feature checks),
    counted before any event is sent; over the fraction, a ``DeadLettersError`` (exit status 3) and nothing sent."""
    if job.max_dead_letter_fraction is None:
        return
    if manifest is None:
        raise ValueError("--max-dead-letter-fraction needs --dataset DIR (the stream's checks come from its spec and "
                         "statistics)")
    featurizer = StreamFeaturizer.from_manifest(manifest)
    bounds = ParseBounds(max_event_bytes=job.max_event_bytes) if job.max_event_bytes else ParseBounds()
    reasons: Counter = Counter()
    events = table_events(table)
    while chunk := [json.dumps(e).encode() for _, e in zip(range(10_000), events)]:
        out = featurizer.featurize_payloads(chunk, [("replay", 0, i) for i in range(len(chunk))], bounds)
        reasons.update(reason_kind(d.reason) for d in out.dead_letters)
    check_dead_letters(table.num_rows, sum(reasons.values()), job.max_dead_letter_fraction,
                       what=f"rows of {' '.join(job.input)}", where=f"nothing was sent to {job.topic}",
                       reasons="; ".join(f"{r} ({n:,})" for r, n in reasons.most_common(3)))


def _encoder(job: ReplayJob, schema, record: str):
    """event dict -> record value in --event-format (with --schema-registry: registered under TOPIC-value)."""
    if job.event_format == "json" and not job.schema_registry and not job.schema_file:
        return lambda event: json.dumps(event).encode()
    fmt = event_format(job.event_format, schema, schema_file=job.schema_file, registry=job.schema_registry,
                       subject=f"{job.topic}-value", record=record)
    return fmt.encode


def _replayed(job: ReplayJob, rows, kinds, malform, *, label=None, times=None, encode=None):
    """(value, key, Kafka timestamp, kind) per (event, key) row after --skip, up to --limit: --malformed F of
    them malformed (the kinds in turn, by ``malform(event, kind, rng)``), --unlabelled F without their label;
    kind is the malformed kind, "unlabelled" (dropped, or a row whose ``label`` is missing) or None. One seeded
    generator: the same flags, the same events."""
    rng = random.Random(job.seed)
    done = made = 0
    for i, (event, key) in enumerate(rows):
        if i < job.skip:
            continue
        if job.limit is not None and done >= job.limit:
            return
        kind = None
        if job.malformed and rng.random() < job.malformed:
            kind = kinds[made % len(kinds)]
            made += 1
            value = malform(event, kind, rng)
        else:
            if job.unlabelled and rng.random() < job.unlabelled:
                event, kind = drop_label(event, label), "unlabelled"
            elif label is not None and event.get(label) is None:  # the row has no label: so is its event
                kind = "unlabelled"
            value = encode(event) if encode is not None else json.dumps(event).encode()
        done += 1
        yield value, key, kafka_timestamps(times, i), kind


def _retention_ms(bootstrap: str, topic: str, cfg: dict) -> int | None:
    """The topic's retention.ms as the broker applies it; None when it does not say."""
    value = topic_config(bootstrap, topic, "retention.ms", client_config=cfg)
    try:
        return int(value)
    except (TypeError, ValueError):  # an old broker or client: the check is skipped
        return None


"""bench kafka: ReadFromKafka in a Beam pipeline vs raw Kafka consumer loops (the anchors).

One run: produce N records (~100-byte values) across 3 partitions to a real broker, then read
them all back
  (a)  with kafka-python's batched ``poll(max_records=5000)`` loop (the fair anchor),
  (a2) with kafka-python's per-record iterator (``for record in consumer``),
  (a3) with confluent-kafka's ``consume(5000)`` loop (librdkafka; when it is installed),
  (b)  with ``ReadFromKafka(stop="end")`` on the local batch runner, one element per record,
  (b1) the same with ``batch_records=5000`` (one list per fetched chunk),
  (b2, b3) both again with ``client="confluent"``,
  (b0) the per-record pipeline over an empty topic (its start-up), and
  (c)  Arrow-batched messages (1000 rows each) decoded to record batches.
Goals: (b)/(a) >= 0.7 and (b1)/(a2) >= 1.5. Medians of interleaved repeats after an untimed
warm-up pipeline.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import time
import uuid

import apache_beam as beam
import numpy as np
import pyarrow as pa
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import NewTopic

from bench.table import report
from bench.timing import MIN_REPEATS, best, check_repeats, interleaved, median, repeats_note
from connectors.arrow import DecodeArrow, encode_batch
from connectors.kafka import ReadFromKafka
from flowtrain.local.runners import pipeline_options
from flowtrain.local.tools import free_port

#: Records per element of the batched reads (b1, b3) and per poll of the raw batched loops.
BATCH = 5000


#: kafka-python settings of every client of the run (security, from --kafka-config-file); {} for the local broker.
CLIENT: dict = {}


def _topic(bootstrap: str, partitions: int) -> str:
    name = f"bench-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, **CLIENT)
    admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)])
    admin.close()
    return name


def produce_records(bootstrap: str, n: int, partitions: int = 3, value_bytes: int = 100) -> tuple[str, int]:
    topic = _topic(bootstrap, partitions)
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks=1, linger_ms=20, batch_size=512 * 1024,
                             compression_type=None, **CLIENT)
    payload = b"x" * value_bytes
    total = 0
    for i in range(n):
        key = str(i).encode()
        producer.send(topic, key=key, value=payload, partition=i % partitions)
        total += len(key) + len(payload)
    producer.flush()
    producer.close()
    return topic, total


def produce_arrow(bootstrap: str, n: int, rows_per_message: int = 1000, partitions: int = 3) -> tuple[str, int]:
    topic = _topic(bootstrap, partitions)
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks=1, linger_ms=20, batch_size=1024 * 1024,
                             max_request_size=8 * 1024 * 1024, **CLIENT)
    total = 0
    rng = np.random.default_rng(0)
    for m, lo in enumerate(range(0, n, rows_per_message)):
        k = min(rows_per_message, n - lo)
        batch = pa.RecordBatch.from_pydict({
            "id": np.arange(lo, lo + k, dtype=np.int64),
            **{f"f{j}": rng.standard_normal(k).astype(np.float32) for j in range(20)}})
        body = encode_batch(batch)
        producer.send(topic, value=body, partition=m % partitions)
        total += len(body)
    producer.flush()
    producer.close()
    return topic, total


def _python_consumer(bootstrap: str, topic: str, partitions: int, **cfg):
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, group_id=None,
                             fetch_max_wait_ms=100, max_partition_fetch_bytes=4 * 1024 * 1024, **CLIENT, **cfg)
    tps = [TopicPartition(topic, p) for p in range(partitions)]
    consumer.assign(tps)
    consumer.seek_to_beginning()
    return consumer, tps


def raw_consumer(bootstrap: str, topic: str, partitions: int = 3) -> tuple[int, float]:
    """kafka-python's batched fetch: ``poll(max_records=5000)`` until every partition's end."""
    t0 = time.perf_counter()
    consumer, tps = _python_consumer(bootstrap, topic, partitions, max_poll_records=5000)
    end = consumer.end_offsets(tps)
    count = 0
    while any(consumer.position(tp) < end[tp] for tp in tps):
        for records in consumer.poll(timeout_ms=500, max_records=5000).values():
            count += len(records)
    consumer.close()
    return count, time.perf_counter() - t0


def raw_iterator(bootstrap: str, topic: str, partitions: int = 3) -> tuple[int, float]:
    """kafka-python's per-record iterator, as its documentation consumes: ``for record in consumer``."""
    t0 = time.perf_counter()
    consumer, tps = _python_consumer(bootstrap, topic, partitions, consumer_timeout_ms=5000)
    total = sum(consumer.end_offsets(tps).values()) - sum(consumer.beginning_offsets(tps).values())
    count = 0
    if total:
        for _record in consumer:
            count += 1
            if count >= total:
                break
    consumer.close()
    return count, time.perf_counter() - t0


def raw_confluent(bootstrap: str, topic: str, partitions: int = 3) -> tuple[int, float]:
    """confluent-kafka (librdkafka): ``consume(5000)`` until every partition's end."""
    from confluent_kafka import Consumer, KafkaError
    from confluent_kafka import TopicPartition as CTopicPartition

    from connectors.kafka import confluent_config

    t0 = time.perf_counter()
    consumer = Consumer({**confluent_config(bootstrap, CLIENT), "group.id": "bench", "enable.auto.commit": False,
                         "enable.partition.eof": True, "fetch.wait.max.ms": 100,
                         "fetch.queue.backoff.ms": 10})  # the default 1000 ms stalls each queue refill
    # Explicit start offsets, as ReadFromKafka resolves them: librdkafka's OFFSET_BEGINNING
    # lookup alone waits ~0.5 s before the first fetch.
    starts = [consumer.get_watermark_offsets(CTopicPartition(topic, p), timeout=10)[0] for p in range(partitions)]
    consumer.assign([CTopicPartition(topic, p, start) for p, start in enumerate(starts)])
    count, at_end = 0, set()
    while len(at_end) < partitions:
        # What librdkafka holds at once, else wait for a first message (consume(n, timeout) alone
        # would wait for all n records or the whole timeout at the end of the log).
        msgs = consumer.consume(5000, 0) or consumer.consume(1, 0.5)
        for msg in msgs:
            err = msg.error()
            if err is None:
                count += 1
            elif err.code() == KafkaError._PARTITION_EOF:
                at_end.add(msg.partition())
            else:
                raise RuntimeError(f"confluent consume: {err}")
    consumer.close()
    return count, time.perf_counter() - t0


def _with_cpu(case):
    """case() -> (count, seconds) becomes -> (count, seconds, CPU seconds of this process)."""
    def run():
        cpu0 = time.process_time()
        count, seconds = case()
        return count, seconds, time.process_time() - cpu0
    return run


class _CountRows(beam.DoFn):
    rows = beam.metrics.Metrics.counter("bench", "rows")

    def process(self, element):
        self.rows.inc(element.num_rows if isinstance(element, pa.RecordBatch) else
                      len(element) if isinstance(element, list) else 1)


def beam_read(bootstrap: str, topic: str, *, arrow: bool = False, **read_options) -> tuple[int, float]:
    t0 = time.perf_counter()
    p = beam.Pipeline(options=pipeline_options("batch"))
    records = p | ReadFromKafka(bootstrap, topic, stop="end", consumer_config=CLIENT, **read_options)
    if arrow:
        records, _errs = records | DecodeArrow()
    _ = records | beam.ParDo(_CountRows())
    result = p.run()
    result.wait_until_finish()
    seconds = time.perf_counter() - t0
    counters = result.metrics().query(beam.metrics.MetricsFilter().with_name("rows"))["counters"]
    return sum(c.committed for c in counters), seconds


def run(bootstrap: str | None = None, records: int = 200_000, out_dir: str | None = "bench/results",
        repeats: int = MIN_REPEATS) -> str:
    import tempfile

    from flowtrain.local.kafka import LocalKafka

    check_repeats(repeats)
    confluent = importlib.util.find_spec("confluent_kafka") is not None
    broker = None
    if bootstrap is None:
        broker = LocalKafka(port=free_port(), data_dir=tempfile.mkdtemp(prefix="flowtrain-bench-kafka-"))
        broker.start()
        bootstrap = broker.bootstrap
    try:
        topic, nbytes = produce_records(bootstrap, records)
        atopic, abytes = produce_arrow(bootstrap, records)
        empty, _ = produce_records(bootstrap, 0)
        cases = {"raw": lambda: raw_consumer(bootstrap, topic),
                 "iter": lambda: raw_iterator(bootstrap, topic),
                 "beam": lambda: beam_read(bootstrap, topic),
                 "batched": lambda: beam_read(bootstrap, topic, batch_records=BATCH),
                 "empty": lambda: beam_read(bootstrap, empty),
                 "arrow": lambda: beam_read(bootstrap, atopic, arrow=True)}
        if confluent:
            cases.update({"craw": lambda: raw_confluent(bootstrap, topic),
                          "cbeam": lambda: beam_read(bootstrap, topic, client="confluent"),
                          "cbatched": lambda: beam_read(bootstrap, topic, client="confluent", batch_records=BATCH)})
        # Warm-up, untimed: the first pipeline of a process pays Beam's one-time imports.
        runs = interleaved({name: _with_cpu(case) for name, case in cases.items()}, repeats=repeats,
                           warmup=["empty"])
    finally:
        if broker is not None:
            from connectors.kafka import close_all_clients

            close_all_clients()
            broker.stop(quiet=True)
    counts = {name: {n for n, _, _ in rs} for name, rs in runs.items()}
    expected = {name: {0 if name == "empty" else records} for name in cases}
    assert counts == expected, counts
    sec = {name: median(rs, key=lambda r: r[1]) for name, rs in runs.items()}
    fastest = {name: best(rs, key=lambda r: r[1]) for name, rs in runs.items()}
    cpu = {name: median(rs, key=lambda r: r[2]) for name, rs in runs.items()}
    poll_rate, iter_rate = records / sec["raw"], records / sec["iter"]

    def row(label, name, n, nbytes_):
        if not n:
            return (label, 0, sec[name], fastest[name], cpu[name], "-", "-", "-", "-")
        rate = n / sec[name]
        return (label, n, sec[name], fastest[name], cpu[name], rate, nbytes_ / sec[name] / 1e6, rate / poll_rate,
                rate / iter_rate)

    rows = [row("(a) kafka-python poll(max_records=5000) loop (anchor)", "raw", records, nbytes),
            row("(a2) kafka-python iterator loop", "iter", records, nbytes)]
    if confluent:
        rows.append(row("(a3) confluent-kafka consume(5000) loop", "craw", records, nbytes))
    rows += [row("(b) ReadFromKafka stop='end', per record", "beam", records, nbytes),
             row(f"(b1) ReadFromKafka batch_records={BATCH}", "batched", records, nbytes)]
    if confluent:
        rows += [row("(b2) ReadFromKafka client='confluent', per record", "cbeam", records, nbytes),
                 row(f"(b3) ReadFromKafka client='confluent', batch_records={BATCH}", "cbatched", records, nbytes)]
    rows += [row("(b0) the per-record pipeline on an empty topic", "empty", 0, 0),
             row("(c) Arrow messages (1000 rows) + DecodeArrow", "arrow", records, abytes)]
    steady = sec["raw"] / (sec["beam"] - sec["empty"]) if sec["beam"] > sec["empty"] else float("nan")
    notes = [f"{records} records of ~{nbytes // records} bytes over 3 partitions, FnApiRunner; seconds, records/s "
             f"and ratios from the {repeats_note(repeats)} after an untimed warm-up pipeline "
             f"(best run as an extra column).",
             f"Goals: (b)/(a) >= 0.7: {sec['raw'] / sec['beam']:.2f}; "
             f"(b1)/(a2) >= 1.5: {sec['iter'] / sec['batched']:.2f}"
             + (f"; with client='confluent' (b3)/(a2): {sec['iter'] / sec['cbatched']:.2f}." if confluent else "."),
             f"CPU s: CPU time of the reading process (all its threads; the broker's not counted), "
             f"steadier than wall time on a busy machine. By CPU: (b)/(a) {cpu['raw'] / cpu['beam']:.2f}, "
             f"(b1)/(a2) {cpu['iter'] / cpu['batched']:.2f}"
             + (f", (b3)/(a2) {cpu['iter'] / cpu['cbatched']:.2f}." if confluent else "."),
             f"(b) without its start-up (b0): {steady:.2f} of (a)."]
    if confluent:
        notes.append(f"confluent inside ReadFromKafka vs kafka-python inside it: per record "
                     f"{sec['beam'] / sec['cbeam']:.2f}x, batched {sec['batched'] / sec['cbatched']:.2f}x.")
    else:
        notes.append("confluent-kafka is not installed: rows (a3), (b2), (b3) left out "
                     "(pip install 'flowtrain[kafka-confluent]').")
    return report("kafka", ["reader", "records", "seconds", "best s", "CPU s", "records/s", "MB/s", "vs (a)",
                            "vs (a2)"],
                  rows, notes=notes, out_dir=out_dir)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--bootstrap", default=None, help="use this broker instead of starting one")
    ap.add_argument("--kafka-config-file", default=None, metavar="client.properties",
                    help="that broker's client properties (security.protocol, sasl.jaas.config, ssl.*; "
                         "see docs/secrets.md; default $FLOWTRAIN_KAFKA_CONFIG_FILE)")
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--repeats", type=int, default=MIN_REPEATS, help="interleaved runs (>= 3); medians reported")
    args = ap.parse_args(argv)
    from connectors.kafka.config import KafkaConfigError, load_client_properties

    properties = args.kafka_config_file or os.environ.get("FLOWTRAIN_KAFKA_CONFIG_FILE")
    try:
        CLIENT.update(load_client_properties(properties) if args.bootstrap and properties else {})
    except KafkaConfigError as err:
        raise SystemExit(f"flowtrain bench kafka: {err}") from None
    run(args.bootstrap, args.records, repeats=args.repeats)


if __name__ == "__main__":
    main()

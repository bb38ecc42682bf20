"""bench kafka: ReadFromKafka in a Beam pipeline vs a raw kafka-python consumer loop (the anchor).

One run: produce N records (~100-byte values) across 3 partitions to a real broker, then read
them all back (a) with a plain kafka-python consumer loop, (b) with ``ReadFromKafka(stop="end")``
on the local batch runner (and (b0), the same pipeline over an empty topic: its start-up), (c) as
Arrow-batched messages (1000 rows each) decoded to record batches. Prints records/s, MB/s and the
ratio (b)/(a) (goal >= 0.7): medians of interleaved repeats after an untimed warm-up pipeline.
"""
from __future__ import annotations

import argparse
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


def _topic(bootstrap: str, partitions: int) -> str:
    name = f"bench-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)])
    admin.close()
    return name


def produce_records(bootstrap: str, n: int, partitions: int = 3, value_bytes: int = 100) -> tuple[str, int]:
    topic = _topic(bootstrap, partitions)
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks=1, linger_ms=20, batch_size=512 * 1024,
                             compression_type=None)
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
                             max_request_size=8 * 1024 * 1024)
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


def raw_consumer(bootstrap: str, topic: str, partitions: int = 3) -> tuple[int, float]:
    t0 = time.perf_counter()
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, group_id=None,
                             fetch_max_wait_ms=100, max_poll_records=2000,
                             max_partition_fetch_bytes=4 * 1024 * 1024)
    tps = [TopicPartition(topic, p) for p in range(partitions)]
    consumer.assign(tps)
    consumer.seek_to_beginning()
    end = consumer.end_offsets(tps)
    count = 0
    while any(consumer.position(tp) < end[tp] for tp in tps):
        for records in consumer.poll(timeout_ms=500).values():
            count += len(records)
    consumer.close()
    return count, time.perf_counter() - t0


class _CountRows(beam.DoFn):
    rows = beam.metrics.Metrics.counter("bench", "rows")

    def process(self, element):
        self.rows.inc(element.num_rows if isinstance(element, pa.RecordBatch) else 1)


def beam_read(bootstrap: str, topic: str, *, arrow: bool = False) -> tuple[int, float]:
    t0 = time.perf_counter()
    p = beam.Pipeline(options=pipeline_options("batch"))
    records = p | ReadFromKafka(bootstrap, topic, stop="end")
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
    from flowtrain.local.kafka import LocalKafka, free_port
    import tempfile

    check_repeats(repeats)
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
                 "beam": lambda: beam_read(bootstrap, topic),
                 "empty": lambda: beam_read(bootstrap, empty),
                 "arrow": lambda: beam_read(bootstrap, atopic, arrow=True)}
        # Warm-up, untimed: the first pipeline of a process pays Beam's one-time imports.
        runs = interleaved(cases, repeats=repeats, warmup=["empty"])
    finally:
        if broker is not None:
            from connectors.kafka import close_all_clients

            close_all_clients()
            broker.stop(quiet=True)
    counts = {name: {n for n, _ in rs} for name, rs in runs.items()}
    assert counts == {"raw": {records}, "beam": {records}, "empty": {0}, "arrow": {records}}, counts
    sec = {name: median(rs, key=lambda r: r[1]) for name, rs in runs.items()}
    fastest = {name: best(rs, key=lambda r: r[1]) for name, rs in runs.items()}
    raw_rate = records / sec["raw"]

    def row(label, name, n, nbytes_):
        if not n:
            return (label, 0, sec[name], fastest[name], "-", "-", "-")
        return (label, n, sec[name], fastest[name], n / sec[name], nbytes_ / sec[name] / 1e6,
                (n / sec[name]) / raw_rate)

    rows = [row("(a) kafka-python consumer loop (anchor)", "raw", records, nbytes),
            row("(b) ReadFromKafka stop='end', FnApiRunner", "beam", records, nbytes),
            row("(b0) the same pipeline on an empty topic", "empty", 0, 0),
            row("(c) Arrow messages (1000 rows) + DecodeArrow", "arrow", records, abytes)]
    steady = sec["raw"] / (sec["beam"] - sec["empty"]) if sec["beam"] > sec["empty"] else float("nan")
    return report("kafka", ["reader", "records", "seconds", "best s", "records/s", "MB/s", "vs (a)"], rows,
                  notes=[f"{records} records of ~{nbytes // records} bytes over 3 partitions; seconds, records/s "
                         f"and ratios from the {repeats_note(repeats)} after an untimed warm-up pipeline "
                         f"(best run as an extra column); goal (b)/(a) >= 0.7.",
                         f"(b) without its start-up (b0): {steady:.2f} of (a)."],
                  out_dir=out_dir)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--bootstrap", default=None, help="use this broker instead of starting one")
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--repeats", type=int, default=MIN_REPEATS, help="interleaved runs (>= 3); medians reported")
    args = ap.parse_args(argv)
    run(args.bootstrap, args.records, repeats=args.repeats)


if __name__ == "__main__":
    main()

"""``--join kafka://TOPIC:KEY[:VALID_FROM]`` in the stream: the joined table is a (compacted) Kafka topic on the job's
brokers, one JSON object per record (a row of the table), and the topic updates it while the stream runs.

- At start the topic is read to its end offsets; its rows fix the joined columns and their types (an empty topic is
  refused: publish the table first).
- Records are kept as compaction keeps them: the newest record per Kafka key (a record without a key is identified
  by its row's KEY and VALID_FROM); a tombstone (a key with no value) deletes that row.
- Before each micro-batch's join the topic is polled (without waiting) and the table rebuilt if anything came.
- With VALID_FROM the join is as of each event's time, so a restart joins the same rows as long as each version
  reaches the topic before the events it applies to are joined. A version that comes later (its VALID_FROM at or
  before an event already joined) is a late update: counted (``late_updates``), named on stderr, and applied from
  then on. Without VALID_FROM the join is the key's row when the event is joined.
- A record that is not a JSON object of the table's columns (or whose values do not fit the columns' types) is
  rejected: counted (``rejected``) and named on stderr with its partition and offset; the table goes on without it.
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np
import pyarrow as pa
from kafka import TopicPartition

from connectors.kafka import close_client, new_consumer, retry_kafka, wait_for_partitions
from pipelines.features.asof import AsOfTable
from pipelines.features.columns import MISSING_TIME, time_micros
from pipelines.features.declare import TOPIC_SCHEME, DeclarationError, Join

#: How long the start waits for the topic's partitions and for its read up to the end offsets.
START_WAIT_S = 60.0
#: The most stderr lines about rejected records and late updates, per table (then only the counts grow).
MAX_NOTICES = 20


def is_topic(join: Join) -> bool:
    return join.table.startswith(TOPIC_SCHEME)


class TopicTable:
    """A join's table kept from a Kafka topic; ``lookup``/``take``/``columns`` as ``AsOfTable``'s."""

    def __init__(self, join: Join, bootstrap: str, kafka_config: dict | None = None, *,
                 time_format: str | None = None, wait_s: float = START_WAIT_S):
        self.join, self.time_format = join, time_format
        self.topic = join.table[len(TOPIC_SCHEME):]
        if not self.topic or "/" in self.topic:
            raise DeclarationError(f"--join {join.text}: expected kafka://TOPIC (a topic on the job's brokers)")
        self.where = f"--join {join.text}"
        config = {"fetch_max_wait_ms": 50, **(kafka_config or {})}
        consumer, parts, unavailable = wait_for_partitions(
            new_consumer(bootstrap, config, group_id=None), self.topic, wait_s=wait_s,
            reconnect=lambda: new_consumer(bootstrap, config, group_id=None))
        if unavailable is not None:
            raise ValueError(f"{self.where}: the partitions of topic {self.topic!r}: {unavailable}") from None
        if not parts:
            close_client(consumer)
            raise ValueError(f"{self.where}: topic {self.topic!r} does not exist on {bootstrap}; publish the table "
                             f"to it first (a compacted topic, one JSON object per row)")
        self.consumer = consumer
        tps = [TopicPartition(self.topic, p) for p in parts]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        self.rows: dict[str, dict] = {}  # the table's rows by KEY (and VALID_FROM)
        self.held: dict[bytes, str] = {}  # a Kafka key -> the row it wrote last
        self.owner: dict[str, bytes | None] = {}  # a row -> the Kafka key that wrote it
        self.rejected = self.late_updates = self.notices = 0
        self.joined_until = MISSING_TIME  # the latest event time joined so far
        self.schema: pa.Schema | None = None
        try:
            self._read_to_end(tps, wait_s)
        except BaseException:
            close_client(consumer)  # the job stops: its consumer with it
            raise
        if not self.rows:
            close_client(consumer)
            raise ValueError(f"{self.where}: topic {self.topic!r} holds no row of the table; publish the table to it "
                             f"first (one JSON object per row, with {', '.join(join.key)}"
                             f"{' and ' + join.valid_from if join.valid_from else ''})")
        try:
            first = pa.Table.from_pylist(list(self.rows.values()))
        except pa.ArrowException as err:
            close_client(consumer)
            raise ValueError(f"{self.where}: the rows of topic {self.topic!r} do not make one table (a column with "
                             f"values of two types?): {str(err).splitlines()[0]}") from None
        self.schema = pa.schema([f.with_type(pa.string()) if pa.types.is_null(f.type) else f for f in first.schema])
        self.table = self._build()
        self.columns = self.table.columns

    def _read_to_end(self, tps, wait_s: float) -> None:
        ends = retry_kafka(lambda: self.consumer.end_offsets(tps), f"end offsets of join topic {self.topic!r}")
        deadline, still = time.monotonic() + wait_s, 0
        at = [self.consumer.position(tp) for tp in tps]
        while not all(p >= ends[tp] for p, tp in zip(at, tps)):
            got = self._poll(500)
            before, at = at, [self.consumer.position(tp) for tp in tps]
            still = 0 if got or at != before else still + 1
            # offsets without records (transaction markers) can keep a position below its end: 5 polls (2.5 s) that
            # neither read a record nor moved a position mean there is nothing more to read (a slow fetch moves on)
            if still >= 5:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.where}: topic {self.topic!r} not read to its end in {wait_s:g} s")

    def _poll(self, timeout_ms: int) -> int:
        """Apply what the topic holds now; the number of records read."""
        n = 0
        for records in self.consumer.poll(timeout_ms=timeout_ms).values():
            for r in records:
                n += 1
                self._apply(r)
        return n

    def _apply(self, record) -> None:
        where = f"record at partition {record.partition} offset {record.offset}"
        if record.value is None:  # a tombstone: the row its key held is deleted
            identity = self.held.pop(record.key, None) if record.key is not None else None
            if identity is not None and self.owner.get(identity) == record.key:
                self.rows.pop(identity, None)
                self.owner.pop(identity, None)
            return
        try:
            row = self._row(record.value)
        except (ValueError, TypeError, pa.ArrowException) as err:
            self.rejected += 1
            self._notice(f"{where} rejected: {str(err).splitlines()[0][:300]}")
            return
        names = (*self.join.key, *([self.join.valid_from] if self.join.valid_from else ()))
        identity = json.dumps([row[c] for c in names], default=str)  # the table's row: KEY (and VALID_FROM)
        if record.key is not None:  # compaction's identity: this key's previous row is gone
            before = self.held.get(record.key)
            if before is not None and before != identity and self.owner.get(before) == record.key:
                self.rows.pop(before, None)
                self.owner.pop(before, None)
            self.held[record.key] = identity
        self.owner[identity] = record.key
        if self.join.valid_from and self.joined_until != MISSING_TIME and self._valid_from(row) <= self.joined_until:
            self.late_updates += 1
            self._notice(f"{where}: a version of {'+'.join(str(row[c]) for c in self.join.key)} valid from "
                         f"{row[self.join.valid_from]} came after events at or after that time were joined (they "
                         f"kept the version before it); applied from now on")
        self.rows[identity] = row

    def _row(self, value: bytes) -> dict:
        """A record's row, checked: a JSON object with the key (and a VALID_FROM that is a time), of the table's
        columns and types once it has started."""
        row = json.loads(value)
        if not isinstance(row, dict):
            raise ValueError(f"expected a JSON object (a row of the table), got {type(row).__name__}")
        missing = [c for c in (*self.join.key, *([self.join.valid_from] if self.join.valid_from else ()))
                   if row.get(c) is None]
        if missing:
            raise ValueError(f"no {', '.join(missing)}")
        if self.join.valid_from and self._valid_from(row) == MISSING_TIME:
            raise ValueError(f"{self.join.valid_from} {row[self.join.valid_from]!r} is not a time")
        if self.schema is not None:
            extra = sorted(set(row) - set(self.schema.names))
            if extra:
                raise ValueError(f"column(s) {', '.join(extra)} not in the table it started with "
                                 f"({', '.join(self.schema.names)}); restart the stream to take them")
            pa.Table.from_pylist([row], schema=self.schema)  # the values fit the columns' types
        return row

    def _valid_from(self, row: dict) -> int:
        return int(time_micros(pa.array([row[self.join.valid_from]]), self.time_format)[0])

    def _notice(self, text: str) -> None:
        self.notices += 1
        if self.notices <= MAX_NOTICES:
            print(f"{self.where}: topic {self.topic!r}: {text}", file=sys.stderr, flush=True)

    def _build(self) -> AsOfTable:
        table = pa.Table.from_pylist(list(self.rows.values()), schema=self.schema)
        return AsOfTable(self.join, table, time_format=self.time_format)

    def refresh(self) -> None:
        """The topic's new records applied (no wait), the table rebuilt if any came."""
        if self._poll(0):
            self.table = self._build()

    def lookup(self, keys: pa.Array, times: np.ndarray) -> np.ndarray:
        self.refresh()
        known = times[times != MISSING_TIME]
        if len(known):
            self.joined_until = max(self.joined_until, int(known.max()))
        return self.table.lookup(keys, times)

    def take(self, rows: np.ndarray) -> dict[str, pa.Array]:
        return self.table.take(rows)

    def close(self) -> None:
        close_client(self.consumer)

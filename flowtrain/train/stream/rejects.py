"""The online trainer's rejected feature messages: counted, on the dead-letter topic once, in the checkpoint.

A rejected message is sent to the dead-letter topic (``connectors.deadletter`` wire format: the
payload as value; ``source`` = ``<features topic>/<partition>/<offset>`` as key and header;
``reason`` header) and confirmed by Kafka before the trainer moves on. Its position moves past
it like any message's: into the next checkpoint, with the counts.

Exactly once across crashes: the trainer's positions come from its last checkpoint, so a
trainer that crashed after rejecting a message but before checkpointing past it reads the
message again. Each checkpoint therefore holds the dead-letter topic's end offsets as they
were just before it (``dead_letter_ends``; a run without a checkpoint yet keeps them in
``<run_dir>/trainer-input.json``); on restart the trainer reads the dead letters after those
offsets, and a message it finds there is counted again (the counts are the checkpoint's) but
not sent twice.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from kafka.errors import KafkaError

from connectors.deadletter import DeadLetter
from connectors.kafka import (
    KafkaDelivery,
    KafkaUnavailable,
    check_brokers,
    close_client,
    dead_letter_record,
    describe_error,
    ensure_topic,
    is_retriable,
    new_consumer,
    new_producer,
    topic_max_message_bytes,
    topic_partitions,
)

__all__ = ["InputRejects", "START_FILE", "StoppedWaiting"]

_log = logging.getLogger(__name__)

#: ``<run_dir>/trainer-input.json``: the dead-letter topic's end offsets when a run started without a checkpoint.
START_FILE = "trainer-input.json"


class StoppedWaiting(KafkaUnavailable):
    """A stop was requested while the brokers did not answer (``InputRejects.end_offsets``): raised on every replica
    at the same round; the text is the brokers' last error."""


class InputRejects:
    """One replica's rejected feature messages (its counts are summed over replicas at a checkpoint)."""

    def __init__(self, bootstrap: str, kafka_config: dict, *, features_topic: str, dead_letter_topic: str,
                 replication_factor: int | None = None):
        self.bootstrap, self.kafka_config = bootstrap, dict(kafka_config)
        self.features_topic, self.topic = features_topic, dead_letter_topic
        self.replication_factor = replication_factor
        self.counts: dict[str, int] = {}  # kind -> messages rejected (on rank 0: since the run began)
        self.pending: list[tuple[int, int, str]] = []  # (partition, offset, kind) since the last checkpoint
        self.already_sent: set[tuple[int, int]] = set()
        self.since: dict[int, int] | None = None  # dead-letter topic offsets to look for earlier sends from
        self._delivery: KafkaDelivery | None = None
        self._producer = None
        self._max_bytes: int | None = None
        self._progress: Callable[[], None] = lambda: None

    # --- state ------------------------------------------------------------------------------------------
    def restore(self, state: dict | None, run_dir: Path, *, is_main: bool) -> None:
        """From the checkpoint restored (``state``), else from a start file an earlier run left."""
        if state is not None:
            if is_main:  # the totals live on one replica so that summing replicas counts them once
                self.counts = {str(k): int(v) for k, v in (state.get("rejected") or {}).items()}
            ends = state.get("dead_letter_ends")
        else:
            start = run_dir / START_FILE
            ends = json.loads(start.read_text()).get("dead_letter_ends") if start.exists() else None
        self.since = {int(p): int(o) for p, o in ends.items()} if ends is not None else None

    def open(self, my_partitions: set[int], run_dir: Path, *, is_main: bool,
             progress: Callable[[], None] = lambda: None, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Create the topic if needed, note where a fresh run starts, and find what an earlier run sent
        (``progress`` is called while it waits on the brokers: the launcher's heartbeat)."""
        self._progress = progress
        if is_main:
            ensure_topic(self.bootstrap, self.topic, client_config=self.kafka_config,
                         replication_factor=self.replication_factor)
            progress()
        self._max_bytes = topic_max_message_bytes(self.bootstrap, self.topic, client_config=self.kafka_config)
        progress()
        if self.since is None:
            if is_main:
                _write_atomically(run_dir / START_FILE, {"dead_letter_topic": self.topic,
                                                         "dead_letter_ends": self.end_offsets(should_stop, progress)})
            return
        self.already_sent = self._sent_since(self.since, my_partitions)
        if self.already_sent:
            print(f"stream train: {len(self.already_sent)} feature message(s) were sent to {self.topic} before the "
                  f"restart; they are counted again, not sent again", flush=True)

    def end_offsets(self, should_stop: Callable[[], bool] = lambda: False,
                    progress: Callable[[], None] = lambda: None, *, ask: bool = True,
                    all_agree: Callable[[bool], bool] = lambda flag: flag) -> dict[int, int]:
        """The dead-letter topic's end offset per partition, now. While the brokers cannot answer (a
        lost quorum, no leader), it waits and asks again, as the Kafka clients do, saying so once and
        calling ``progress`` (the launcher's heartbeat); a stop requested meanwhile ends the wait with
        ``StoppedWaiting`` (the last checkpoint stands).

        With replicas, only the one with ``ask`` asks Kafka (``{}`` on the others) and every replica waits with
        it: each round (an ask is bounded: about 10 s) all call ``all_agree`` twice (``flowtrain.train.replicas``:
        did the brokers answer; is no replica asked to stop), so they all go on, or all raise ``StoppedWaiting``,
        at the same round: none is left waiting in a collective of the checkpoint that the others never reach."""
        waiting_since, reason = None, ""
        while True:
            ends = None
            if ask:
                try:
                    ends = self._ends_now()
                except (KafkaError, KafkaUnavailable) as err:
                    if not (is_retriable(err) or isinstance(err, KafkaUnavailable)):
                        raise
                    reason = describe_error(err)
            if all_agree(ends is not None or not ask):  # the asking replica has the ends
                if waiting_since is not None and ask:
                    print(f"stream train: the brokers answer again after {time.monotonic() - waiting_since:.0f} s",
                          flush=True)
                return ends if ask else {}
            if not all_agree(not should_stop()):
                raise StoppedWaiting(reason or "a stop was requested while waiting for the brokers")
            if waiting_since is None:
                waiting_since = time.monotonic()
                if ask:
                    print(f"stream train: the end of {self.topic} is not known ({reason}); waiting for the brokers",
                          flush=True)
            progress()
            time.sleep(1.0)

    def _ends_now(self) -> dict[int, int]:
        """One ask: the brokers first (within 5 s; kafka-python's metadata wait has no bound), then the topic's
        partitions (within 5 s) and their ends."""
        from kafka import TopicPartition

        consumer = None
        try:
            check_brokers(self.bootstrap, timeout_s=5.0, client_config=self.kafka_config, cached=False)
            consumer = new_consumer(self.bootstrap, self.kafka_config, group_id=None)
            parts = sorted(topic_partitions(consumer, self.topic, timeout_s=5.0))
            ends = consumer.end_offsets([TopicPartition(self.topic, p) for p in parts]) if parts else {}
            return {tp.partition: int(o) for tp, o in ends.items()}
        finally:
            if consumer is not None:
                close_client(consumer)

    def _sent_since(self, since: dict[int, int], mine: set[int]) -> set[tuple[int, int]]:
        """(partition, offset) of this replica's feature messages found on the topic after ``since``."""
        from kafka import TopicPartition

        consumer = new_consumer(self.bootstrap, self.kafka_config, group_id=None)
        prefix = f"{self.features_topic}/"
        found: set[tuple[int, int]] = set()
        try:
            tps = [TopicPartition(self.topic, p) for p in sorted(topic_partitions(consumer, self.topic))]
            ends = consumer.end_offsets(tps) if tps else {}
            todo = {tp: end for tp, end in ends.items() if end > since.get(tp.partition, 0)}
            if not todo:
                return found
            consumer.assign(list(todo))
            for tp in todo:
                consumer.seek(tp, since.get(tp.partition, 0))
            deadline = time.monotonic() + 120
            while todo and time.monotonic() < deadline:
                self._progress()
                for records in consumer.poll(timeout_ms=500).values():
                    for r in records:
                        source = (r.key or b"").decode("utf-8", errors="replace")
                        if source.startswith(prefix):
                            try:
                                partition, offset = (int(x) for x in source[len(prefix):].split("/"))
                            except ValueError:
                                continue
                            if partition in mine:
                                found.add((partition, offset))
                for tp in list(todo):
                    if consumer.position(tp) >= todo[tp]:
                        del todo[tp]
            if todo:
                raise RuntimeError(f"stream train: could not read the dead-letter topic {self.topic!r} back to "
                                   f"offsets {since} within 120 s")
            return found
        finally:
            close_client(consumer)

    def checkpointed(self) -> None:
        self.pending.clear()

    # --- rejecting ------------------------------------------------------------------------------------------
    def reject(self, partition: int, offset: int, payload, kind: str, reason: str) -> None:
        """Count the message and send it with its reason (once: not again after a restart)."""
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.pending.append((partition, offset, kind))
        source = f"{self.features_topic}/{partition}/{offset}"
        print(f"stream train: feature message {source} rejected ({kind}): {reason}", file=sys.stderr, flush=True)
        if (partition, offset) in self.already_sent:
            return
        if self._delivery is None:
            self._producer = new_producer(self.bootstrap, self.kafka_config)
            self._delivery = KafkaDelivery(self._producer, what=f"dead-lettering a feature message to {self.topic}")
        key, value, headers = dead_letter_record(DeadLetter(payload, source, reason), max_bytes=self._max_bytes)
        self._delivery.send(self.topic, value, key=key, headers=headers)
        self._delivery.confirm()  # delivered before the trainer moves past it

    def total(self) -> int:
        return sum(self.counts.values())

    def close(self) -> None:
        if self._producer is not None:
            close_client(self._producer, timeout=10)
            self._producer = self._delivery = None


def _write_atomically(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(data, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)

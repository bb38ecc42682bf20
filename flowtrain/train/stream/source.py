"""The online trainer's source: this replica's partitions of the features topic, read a message at a time.

Each replica's reading rank assigns its share of the feature partitions (``partition % replicas``)
and seeks each to the position its checkpoint recorded, else to the beginning: positions come
only from the checkpoint, never from Kafka's group offsets. Each message is checked against the
dataset (``flowtrain.train.stream.input``: what fails is rejected, a dead letter) and loses the
rows already trained: the exactly-once state is ``positions`` (feature partition -> next offset)
and ``seen`` (raw partition -> highest raw offset trained), both saved in each checkpoint.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch
from kafka import TopicPartition

from connectors.kafka import close_client, new_consumer, wait_for_partitions
from flowtrain.parallel.launch import heartbeat
from flowtrain.train.loader import TabularDataset
from flowtrain.train.stream.config import StreamTrainConfig
from flowtrain.train.stream.input import BadFeatureMessage, FeatureMessageCheck, RawTopicEnds, SourceCheck
from flowtrain.train.stream.rejects import InputRejects

#: Seconds the trainer waits at its start for the features topic (and for brokers that do not answer), and the
#: bound on each question about its partitions.
FEATURES_WAIT_S = 30.0
PARTITIONS_ASK_S = 5.0


class FeatureSource:
    """This replica's feature messages, checked, without rows already trained; and where it has got to."""

    def __init__(self, cfg: StreamTrainConfig, data: TabularDataset, *, reader: bool, replica: int, replicas: int,
                 should_stop: Callable[[], bool]):
        self.cfg, self.should_stop = cfg, should_stop
        # one rank of each replica (stage 0, tensor shard 0) reads that replica's feature partitions
        self.reader, self.replica, self.replicas = reader, replica, replicas
        self.positions: dict[int, int] = {}  # feature partition -> next offset
        self.seen: dict[int, int] = {}  # raw partition -> highest raw offset trained
        self.dropped = 0  # rows already trained, read again (the pipeline upstream is at least once)
        # every feature message is checked against the dataset (flowtrain.train.stream.input); what fails
        # is a dead letter with its reason, counted per kind in the checkpoint (flowtrain.train.stream.rejects)
        self.check = FeatureMessageCheck(data, max_decoded_bytes=cfg.max_decoded_bytes)
        # a row's source must exist on the raw topic: an impossible one never moves the seen-source state
        self.raw_ends = RawTopicEnds(cfg.kafka.bootstrap, cfg.kafka.config, cfg.topics.raw, should_stop=should_stop,
                                     progress=heartbeat) if cfg.topics.raw else None
        self.source_check = SourceCheck(self.raw_ends, raw_topic=cfg.topics.raw, max_gap=cfg.max_source_gap)
        self.consumer = None
        self.mine: list = []

    def restore(self, state: dict) -> None:
        """Positions and seen offsets from a checkpoint's ``state``."""
        self.positions = {int(k): int(v) for k, v in state["positions"].items()}
        self.seen = {int(k): int(v) for k, v in state["seen"].items()}

    def consumer_config(self) -> dict:
        return {"max_poll_records": 1, "fetch_max_wait_ms": 100, "max_partition_fetch_bytes": 16 * 1024 * 1024,
                **self.cfg.kafka.config}

    def open(self) -> set[int]:
        """Assign this replica's feature partitions, each at its position; returns their numbers."""
        cfg = self.cfg
        self.consumer = new_consumer(cfg.kafka.bootstrap, self.consumer_config(), group_id=None)
        parts = self.features_partitions()
        self.mine = [TopicPartition(cfg.topics.features, p) for p in parts
                     if self.reader and p % self.replicas == self.replica]
        if self.mine:
            self.consumer.assign(self.mine)
            for tp in self.mine:
                if tp.partition in self.positions:
                    self.consumer.seek(tp, self.positions[tp.partition])
                else:
                    self.consumer.seek_to_beginning(tp)
        return {tp.partition for tp in self.mine}

    def features_partitions(self) -> list[int]:
        """The features topic's partitions, waiting up to ``FEATURES_WAIT_S`` for the topic (the pipeline may create
        it just now) and for the brokers, each question within ``PARTITIONS_ASK_S`` (kafka-python's own metadata wait
        has no bound); a stop requested while the brokers do not answer ends the wait. A ``ValueError`` naming the
        brokers and the topic when they never answered, or saying the topic never appeared."""
        cfg = self.cfg
        self.consumer, parts, unavailable = wait_for_partitions(
            self.consumer, cfg.topics.features, wait_s=FEATURES_WAIT_S, ask_s=PARTITIONS_ASK_S,
            reconnect=lambda: new_consumer(cfg.kafka.bootstrap, self.consumer_config(), group_id=None),
            should_stop=self.should_stop, on_try=heartbeat)
        if unavailable is not None:  # a one-line error, as a missing topic is (the command says it so)
            raise ValueError(f"the partitions of features topic {cfg.topics.features!r} (asked for "
                             f"{FEATURES_WAIT_S:g} s): {unavailable}") from None
        if not parts:
            raise ValueError(f"features topic {cfg.topics.features!r} does not exist on {cfg.kafka.bootstrap}; start the "
                             f"stream pipeline first (flowtrain stream pipeline)")
        return parts

    def poll(self):
        """At most one feature message of this replica's partitions (None: none came within 200 ms)."""
        if not self.mine:  # more replicas than feature partitions: this one only takes part in the reduce
            if self.reader:  # (a rank of a grid that does not read waits in the collectives)
                time.sleep(0.2)
            return None
        polled = self.consumer.poll(timeout_ms=200)
        return next((m for records in polled.values() for m in records), None)

    def fresh_rows(self, msg, rejects: InputRejects):
        """The message's rows not trained yet, their sources and the message; None when it is rejected (a dead
        letter) or all its rows were trained. Its partition's position moves past it either way."""
        self.positions[msg.partition] = msg.offset + 1
        try:
            rows = self.check(msg.value)
            self.source_check(rows.src_partition, rows.src_offset, self.seen)
        except BadFeatureMessage as bad:
            rejects.reject(msg.partition, msg.offset, msg.value, bad.kind, str(bad))
            return None
        src_p, src_o = rows.src_partition, rows.src_offset
        fresh = unseen(src_p, src_o, self.seen)
        self.dropped += int((~fresh).sum())
        if not fresh.any():
            return None
        idx = torch.from_numpy(np.flatnonzero(fresh))
        return rows.split.take(idx), src_p[fresh], src_o[fresh], (msg.partition, msg.offset, msg.value)

    def trained(self, partitions: np.ndarray, offsets: np.ndarray) -> None:
        """Rows from these sources were trained: each raw partition's highest offset moves up."""
        for p in np.unique(partitions):  # a column at a time: one max per raw partition
            self.seen[int(p)] = max(self.seen.get(int(p), -1), int(offsets[partitions == p].max()))

    def close(self) -> None:
        if self.consumer is not None:
            close_client(self.consumer)
        if self.raw_ends is not None:
            self.raw_ends.close()


def unseen(partitions: np.ndarray, offsets: np.ndarray, seen: dict[int, int]) -> np.ndarray:
    """Rows whose source is past the highest offset already trained for its raw partition."""
    fresh = np.ones(len(offsets), dtype=bool)
    for p in np.unique(partitions):
        rows = partitions == p
        fresh[rows] = offsets[rows] > seen.get(int(p), -1)
    return fresh

"""The online trainer's sinks: where what it trained goes, on rank 0.

- ``VersionSink``: the model versions, each one's files (``flowtrain.train.published``: their own
  directory and retention) and then its record on the model-updates topic, which the scorers follow;
- ``Ledger`` (``--ledger``, a test hook): the sources trained and the messages rejected, per version;
- ``write_status``: ``<run_dir>/trainer-status.json`` (what the status page and the bench read).

The metrics log and its plot are ``flowtrain.train.metrics`` and ``flowtrain.train.prequential``.
"""
from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from connectors.atomic import atomic_write
from connectors.kafka import KafkaDelivery, KafkaWriteError, close_client, ensure_topic, new_producer
from connectors.model_updates import UpdateKeySource
from flowtrain.train.published import Publisher
from flowtrain.train.rundir.files import RunFiles
from flowtrain.train.stream.config import StreamTrainConfig

#: Seconds a stopping trainer waits for Kafka (its final checkpoint and version); a stop is never held
#: longer by brokers that do not answer.
STOP_KAFKA_S = 10.0


class VersionSink:
    """Rank 0's published model versions: the files, then the record on the updates topic, confirmed by Kafka."""

    def __init__(self, cfg: StreamTrainConfig, run_dir: Path, should_stop: Callable[[], bool]):
        self.cfg, self.should_stop = cfg, should_stop
        self.publisher = Publisher(run_dir, keep=cfg.keep_published,
                                   key_source=UpdateKeySource.from_options(cfg.update_key_file))
        self.producer = self.delivery = None

    def open(self) -> None:
        """The updates topic (created when missing) and a producer for it."""
        cfg = self.cfg
        ensure_topic(cfg.kafka.bootstrap, cfg.topics.updates, client_config=cfg.kafka.config,
                     replication_factor=cfg.kafka.replication_factor)
        self.producer = new_producer(cfg.kafka.bootstrap, cfg.kafka.config)
        self.delivery = KafkaDelivery(self.producer, what="publishing a model version")

    def publish(self, **version) -> None:
        """A version of the whole model (``Publisher.publish``'s arguments), then its record."""
        self._send(self.publisher.publish(**version))

    def publish_ids(self, payload, meta, **version) -> None:
        """A version of a model with ID tables: a snapshot or a delta (``Publisher.publish_ids``), then its record."""
        self._send(self.publisher.publish_ids(payload, meta, **version))

    def _send(self, record: dict) -> None:
        """The model version on the updates topic; a send Kafka does not acknowledge is an error, except
        while stopping: then it waits ``STOP_KAFKA_S`` at most and says the version was not published."""
        stopping = bool(self.should_stop())
        try:
            self.delivery.send(self.cfg.topics.updates, json.dumps(record).encode(),
                               key=str(record["version"]).encode())
            self.delivery.confirm(within_s=STOP_KAFKA_S if stopping else None)
        except KafkaWriteError as err:
            if not stopping:
                raise
            self.delivery.discard()
            print(f"stream train: not committed: version {record['version']} is checkpointed but was not published "
                  f"on {self.cfg.topics.updates} ({err}); scorers keep the previous version until the next one",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.producer is not None:
            close_client(self.producer, timeout=10)


class Ledger:
    """The audit ledger: one line per row trained (its source and step) and per feature message rejected, with
    the version whose checkpoint holds it. ``kept``: this process keeps one (``--ledger``, on rank 0)."""

    def __init__(self, path: Path, *, kept: bool):
        self.path, self.kept = path, kept

    def drop_after(self, version: int) -> None:
        """The ledger keeps only what belongs to the checkpoint restored (or nothing)."""
        if not (self.kept and self.path.exists()):
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line)["version"] <= version:
                    kept.append(line)
            except (ValueError, KeyError, TypeError):  # a line a crash tore in the middle of an append: no record
                continue
        # a new file renamed over the old one: a crash here leaves the old ledger whole, never a truncated one
        atomic_write(self.path, "".join(line + "\n" for line in kept))

    def append(self, version: int, trained: list, rejected: list) -> None:
        """``trained``: (raw partition, raw offset, step); ``rejected``: (feature partition, offset, kind)."""
        if not (trained or rejected):
            return
        with open(self.path, "a") as fh:
            for p, o, s in trained:  # s: the step that trained the row (a step's rows: replicas in rank order)
                fh.write(json.dumps({"version": version, "partition": int(p), "offset": int(o),
                                     "step": int(s)}) + "\n")
            for p, o, kind in rejected:  # feature messages (not raw sources) sent to the dead letters
                fh.write(json.dumps({"version": version, "rejected": {"partition": int(p), "offset": int(o)},
                                     "kind": kind}) + "\n")


def write_status(run_dir: Path, status: dict) -> None:
    """``<run_dir>/trainer-status.json``: ``status`` and the time."""
    path = RunFiles(run_dir).trainer_status
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({**status, "time": time.time()}, default=str))
    tmp.replace(path)

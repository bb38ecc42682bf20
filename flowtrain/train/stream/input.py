"""The online trainer's input check: a feature message is trained on only if the dataset says it can be.

A feature message (one Arrow IPC stream, as the stream pipeline writes it) must hold, for the
dataset the trainer was built for:

- ``num__<col>`` for every numeric column: a floating or integer type, no nulls, every value
  finite once it is a float32 (what the model reads) and inside the column's range standardized
  (the declared ``--numeric-range``, else the statistics' ``max_abs``: what the stream pipeline's
  feature code lets through);
- ``cat__<col>`` for every categorical column: an integer type, no nulls, every code in
  ``[0, vocabulary size]`` (0 is the out-of-vocabulary bucket);
- ``label``: a floating or integer type, no nulls, finite; for a classification a class index
  in ``[0, classes)``;
- ``src_partition`` and ``src_offset`` (where the row came from: the exactly-once ledger): an
  integer type, no nulls, ``>= 0``.

Each row's source must also be possible (``SourceCheck``): a raw partition the raw topic has, an
offset below that partition's end offset when the message is read (an offset no event has had
yet would mark every later row of the partition as already trained). Without the raw topic on
the brokers, an offset more than ``max_gap`` past the highest one trained for its partition is
refused instead. A message that fails is rejected before the exactly-once state moves.

Other columns are allowed and ignored. The stream's decoded size is checked from its metadata
before any body is decompressed (``connectors.arrow_ipc``). A message that fails raises
``BadFeatureMessage`` whose ``kind`` names the check and whose text says what is wrong (the
column, the value, the row) in a line; the trainer sends it to its dead-letter topic.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from connectors.arrow_ipc import IpcTooLarge, NotArrowIpc, decode_bounded
from connectors.dataset_spec import CAT_PREFIX, ID_PREFIX, LABEL, NUM_PREFIX, WEIGHT
from flowtrain.train.loader import TabularDataset, TabularSplit
from flowtrain.train.options import StreamTrainOptions

__all__ = ["BadFeatureMessage", "FeatureInput", "FeatureMessageCheck", "SOURCE_COLUMNS", "DEFAULT_MAX_DECODED_BYTES",
           "DEFAULT_MAX_SOURCE_GAP", "RawTopicEnds", "SourceCheck"]

#: Where each row came from (raw partition, raw offset): the trainer's exactly-once state.
SOURCE_COLUMNS = ("src_partition", "src_offset")
#: Largest decoded size of one feature message (64 MiB: ~30x a 2,000-row message of 100 features; --max-decoded-bytes).
DEFAULT_MAX_DECODED_BYTES = StreamTrainOptions.max_decoded_bytes
#: Without the raw topic: the largest step of a raw partition's offset past the highest one trained.
DEFAULT_MAX_SOURCE_GAP = 10_000_000
#: Kafka partition numbers are 32-bit.
_MAX_PARTITION = (1 << 31) - 1


class BadFeatureMessage(ValueError):
    """A feature message the trainer cannot use; ``kind`` is one of ``FeatureMessageCheck.KINDS``."""

    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind = kind


@dataclass
class FeatureInput:
    """A checked message: its rows as tensors and each row's source."""

    split: TabularSplit
    src_partition: np.ndarray
    src_offset: np.ndarray

    def __len__(self) -> int:
        return len(self.split)


def _standardized_ranges(spec, stats: dict) -> tuple[np.ndarray, np.ndarray]:
    """Per numeric feature, the lowest and highest standardized value its range allows (a little wider:
    float32 rounding); -inf/inf for a column without a range."""
    low, high = [], []
    numeric = stats.get("numeric") or {}
    for col in spec.all_numeric:
        s = numeric.get(col) or {}
        mean, std = float(s.get("mean", 0.0)), float(s.get("std", 1.0)) or 1.0
        if col in spec.numeric_range:
            lo, hi = spec.numeric_range[col]
        elif s.get("max_abs"):
            lo, hi = -float(s["max_abs"]), float(s["max_abs"])
        else:
            lo, hi = -np.inf, np.inf
        zl, zh = (lo - mean) / std, (hi - mean) / std
        low.append(zl - 1e-5 * abs(zl) - 1e-5)
        high.append(zh + 1e-5 * abs(zh) + 1e-5)
    return np.asarray(low, dtype=np.float64), np.asarray(high, dtype=np.float64)


def _floating_or_integer(t: pa.DataType) -> bool:
    return pa.types.is_floating(t) or pa.types.is_integer(t)


class FeatureMessageCheck:
    """Checks and converts feature messages for one dataset (see the module doc)."""

    #: How a message can fail, as counted in the trainer's status and checkpoints.
    KINDS = ("not_arrow", "too_large", "schema", "values", "source", "non_finite_loss")

    def __init__(self, data: TabularDataset, *, max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES):
        if max_decoded_bytes < 1:
            raise ValueError(f"max_decoded_bytes={max_decoded_bytes!r}: must be >= 1")
        spec = data.spec
        self.max_decoded_bytes = max_decoded_bytes
        self.numeric = [NUM_PREFIX + c for c in spec.all_numeric]
        self.categorical = [CAT_PREFIX + c for c in spec.categorical]
        self.ids = [ID_PREFIX + c for c in spec.id_columns]  # ID keys: any int64 (flowtrain.train.ids)
        self.cardinalities = data.cardinalities  # vocabulary + 1: codes 0..len(vocab)
        self.classes = data.n_classes if spec.task == "classification" else 0
        self.z_low, self.z_high = _standardized_ranges(spec, getattr(data, "stats", None) or {})
        self.types = {**{c: ("a number", _floating_or_integer) for c in self.numeric},
                      **{c: ("an integer", pa.types.is_integer) for c in self.categorical},
                      **{c: ("an integer", pa.types.is_integer) for c in self.ids},
                      LABEL: ("a number", _floating_or_integer),
                      **({WEIGHT: ("a number", _floating_or_integer)} if spec.weight_column else {}),
                      **{c: ("an integer", pa.types.is_integer) for c in SOURCE_COLUMNS}}
        #: --weight-column: the training split's mean weight (each row's weight is divided by it, as in batch)
        self.weight_mean = data.weight_mean if spec.weight_column else None

    def __call__(self, payload) -> FeatureInput:
        """The message's rows, or ``BadFeatureMessage`` saying why not."""
        if not isinstance(payload, (bytes, bytearray, memoryview)) or not payload:
            raise BadFeatureMessage("not_arrow", "an empty message is not an Arrow IPC stream")
        try:
            table, _ = decode_bounded(bytes(payload), self.max_decoded_bytes)
        except IpcTooLarge as err:
            raise BadFeatureMessage("too_large", f"the message {err} (--max-decoded-bytes)") from None
        except NotArrowIpc as err:
            raise BadFeatureMessage("not_arrow", str(err)) from None
        self._check_schema(table.schema)
        return self._rows(table)

    def _check_schema(self, schema: pa.Schema) -> None:
        names = schema.names
        missing = [c for c in self.types if c not in names]
        twice = sorted({c for c in self.types if names.count(c) > 1})
        wrong = [f"{c!r} is {schema.field(c).type} (expected {what})" for c, (what, ok) in self.types.items()
                 if names.count(c) == 1 and not ok(schema.field(c).type)]
        problems = ([f"missing column(s) {', '.join(map(repr, missing))}"] if missing else []) + \
                   ([f"column(s) {', '.join(map(repr, twice))} given twice"] if twice else []) + wrong
        if problems:
            raise BadFeatureMessage("schema", "the message does not have the dataset's feature columns: "
                                    + "; ".join(problems))

    def _nulls(self, columns: dict) -> None:
        for name in self.types:
            column = columns[name]
            if column.null_count:
                first = int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])
                raise BadFeatureMessage("values", f"column {name!r} has {column.null_count} null value(s), "
                                        f"the first at row {first}")

    @staticmethod
    def _stack(columns: dict, names: list[str], dtype) -> np.ndarray:
        with np.errstate(over="ignore", invalid="ignore"):  # a copy: Arrow's buffers stay read-only
            return np.stack([columns[name].to_numpy() for name in names], axis=1).astype(dtype, copy=False)

    def _rows(self, table: pa.Table) -> FeatureInput:
        # by position: a column looked up by name costs ~30 us, by position ~2
        columns = {name: table.column(i) for i, name in enumerate(table.schema.names)}
        self._nulls(columns)
        n = table.num_rows
        x_num = self._stack(columns, self.numeric, np.float32) if self.numeric else np.zeros((n, 0), np.float32)
        if not np.isfinite(x_num).all():
            self._not_finite(table, x_num, self.numeric)
        outside = (x_num < self.z_low) | (x_num > self.z_high)
        if outside.any():
            i, j = (int(k[0]) for k in np.nonzero(outside))
            raise BadFeatureMessage("values", f"column {self.numeric[j]!r} has {float(x_num[i, j])!r} at row {i}, "
                                    f"outside [{self.z_low[j]:.6g}, {self.z_high[j]:.6g}]: the column's range "
                                    f"(declared, or from the training statistics), standardized")
        x_cat = self._stack(columns, self.categorical, np.int64) if self.categorical else np.zeros((n, 0), np.int64)
        bad = (x_cat < 0) | (x_cat >= np.asarray(self.cardinalities, dtype=np.int64))
        if bad.any():
            i, j = (int(k[0]) for k in np.nonzero(bad))
            size = self.cardinalities[j]
            raise BadFeatureMessage("values", f"column {self.categorical[j]!r} has category code {int(x_cat[i, j])} "
                                    f"at row {i}, outside [0, {size - 1}] (the dataset's vocabulary has {size - 1} "
                                    f"value(s); 0 is the out-of-vocabulary code)")
        if self.ids:  # after the category codes, as the batch loader stacks them
            x_cat = np.concatenate([x_cat, self._stack(columns, self.ids, np.int64)], axis=1)
        y = self._stack(columns, [LABEL], np.float32)
        if not np.isfinite(y).all():
            self._not_finite(table, y, [LABEL])
        y = y[:, 0]
        if self.classes:
            bad = (y != np.floor(y)) | (y < 0) | (y >= self.classes)
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise BadFeatureMessage("values", f"column {LABEL!r} has {float(y[i])!r} at row {i}, not a class "
                                        f"index in [0, {self.classes - 1}]")
        sources = self._stack(columns, list(SOURCE_COLUMNS), np.int64)
        if table.num_rows and sources.min() < 0:
            i, j = (int(k[0]) for k in np.nonzero(sources < 0))
            raise BadFeatureMessage("values", f"column {SOURCE_COLUMNS[j]!r} has {int(sources[i, j])} at row {i}; "
                                    f"a source partition or offset is >= 0")
        w = None
        if self.weight_mean is not None:  # sample weights: finite and >= 0, as the pipeline's checks left them
            w = self._stack(columns, [WEIGHT], np.float32)[:, 0]
            bad = ~(np.isfinite(w) & (w >= 0))
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise BadFeatureMessage("values", f"column {WEIGHT!r} has {float(w[i])!r} at row {i}, not a sample "
                                        f"weight (a finite number >= 0)")
            w = torch.from_numpy(w / np.float32(self.weight_mean))
        split = TabularSplit(torch.from_numpy(x_num), torch.from_numpy(x_cat), torch.from_numpy(y.copy()), w)
        return FeatureInput(split, sources[:, 0].copy(), sources[:, 1].copy())

    @staticmethod
    def _not_finite(table: pa.Table, values: np.ndarray, names: list[str]):
        bad = ~np.isfinite(values)
        i, j = (int(k[0]) for k in np.nonzero(bad))
        original = table.column(names[j])[i].as_py()
        raise BadFeatureMessage("values", f"column {names[j]!r} has {int(bad[:, j].sum())} value(s) that are not "
                                f"finite as float32 (NaN, inf or beyond +-3.4e38), the first {original!r} at row {i}")


#: Seconds one ask for the raw topic's partitions waits (then ``RawTopicEnds`` asks again, or stops if asked to).
RAW_ENDS_WAIT_S = 5.0


class RawTopicEnds:
    """The raw topic's partitions and end offsets, read on demand with one long-lived consumer.

    ``__call__`` returns ``{partition: end offset}`` now, or None when the topic is not on the
    brokers. While the brokers do not answer it waits and asks again (``progress`` is called: the
    launcher's heartbeat), as the trainer's own consumer does; a stop requested meanwhile ends the
    wait with the broker's error."""

    def __init__(self, bootstrap: str, kafka_config: dict, topic: str, *,
                 should_stop: Callable[[], bool] = lambda: False, progress: Callable[[], None] = lambda: None):
        self.bootstrap, self.kafka_config, self.topic = bootstrap, dict(kafka_config), topic
        self.should_stop, self.progress = should_stop, progress
        self._consumer = None

    def __call__(self) -> dict[int, int] | None:
        from kafka import TopicPartition
        from kafka.errors import KafkaError

        from connectors.kafka import (
            KafkaUnavailable,
            close_client,
            describe_error,
            is_retriable,
            new_consumer,
            topic_partitions,
        )

        waiting = False
        while True:
            try:
                if self._consumer is None:
                    self._consumer = new_consumer(self.bootstrap, self.kafka_config, group_id=None)
                # fresh metadata (a partition added since is seen), within a bound: kafka-python's has none
                parts = sorted(topic_partitions(self._consumer, self.topic, timeout_s=RAW_ENDS_WAIT_S, refresh=True))
                if not parts:
                    return None
                ends = self._consumer.end_offsets([TopicPartition(self.topic, p) for p in parts])
                return {tp.partition: int(o) for tp, o in ends.items()}
            except (KafkaError, KafkaUnavailable) as err:
                if isinstance(err, KafkaUnavailable):  # a new consumer next time (closing this one ends its wait)
                    close_client(self._consumer)
                    self._consumer = None
                if self.should_stop() or not (isinstance(err, KafkaUnavailable) or is_retriable(err)):
                    raise
                if not waiting:
                    waiting = True
                    print(f"stream train: the end offsets of the raw topic {self.topic} are not known "
                          f"({describe_error(err)}); waiting for the brokers", flush=True)
                self.progress()
                time.sleep(1.0)

    def close(self) -> None:
        if self._consumer is not None:
            from connectors.kafka import close_client

            close_client(self._consumer)
            self._consumer = None


class SourceCheck:
    """Whether each row's source (raw partition, raw offset) can exist (see the module doc).

    ``ends``: the raw topic's end offsets now (``RawTopicEnds``), or None when the raw topic is not
    known; they are read again only when a row's offset is at or past the ends last read, so a
    trainer keeping up asks the brokers about once per message and one far behind almost never."""

    def __init__(self, ends: Callable[[], dict[int, int] | None] | None, *, raw_topic: str | None = None,
                 max_gap: int = DEFAULT_MAX_SOURCE_GAP):
        if max_gap < 1:
            raise ValueError(f"max_gap={max_gap!r}: must be >= 1")
        self.ends, self.raw_topic, self.max_gap = ends, raw_topic, max_gap
        self.known: dict[int, int] | None = None  # the raw topic's end offsets last read
        self.without_topic_said = False
        self._absent_until = 0.0  # the raw topic was not there: asked again after this (monotonic)

    def __call__(self, partitions: np.ndarray, offsets: np.ndarray, trained: dict[int, int]) -> None:
        """Nothing, or ``BadFeatureMessage("source", ...)`` naming the first impossible source;
        ``trained``: raw partition -> highest offset trained (not changed here)."""
        if not len(offsets):
            return
        top = _highest_per_partition(partitions, offsets)
        too_big = [p for p in top if p > _MAX_PARTITION]
        if too_big:
            raise BadFeatureMessage("source", f"column 'src_partition' has {too_big[0]}, not a Kafka partition "
                                    f"number (0 to {_MAX_PARTITION})")
        ends = self._ends_covering(top)
        if ends is None:
            self._check_gap(top, trained)
            return
        for p, o in sorted(top.items()):
            if p not in ends:
                raise BadFeatureMessage("source", f"column 'src_partition' has {p}, but the raw topic "
                                        f"{self.raw_topic!r} has partitions 0 to {max(ends)}: no event came from it")
            if o >= ends[p]:
                raise BadFeatureMessage("source", f"column 'src_offset' has {o} for raw partition {p}, at or past "
                                        f"the end of the raw topic {self.raw_topic!r} there ({ends[p]}): no event "
                                        f"has that offset yet, and training it would mark every later event of "
                                        f"the partition as a duplicate")

    def _ends_covering(self, top: dict[int, int]) -> dict[int, int] | None:
        if self.ends is None:
            return None
        known = self.known
        if known is None and time.monotonic() < self._absent_until:
            return None
        if known is None or any(p not in known or o >= known[p] for p, o in top.items()):
            self.known = known = self.ends()
            if known is None:
                self._absent_until = time.monotonic() + 10.0
            if known is None and not self.without_topic_said:
                self.without_topic_said = True
                print(f"stream train: the raw topic {self.raw_topic!r} is not on the brokers; each row's source "
                      f"offset is checked against the highest trained for its partition (a step of more than "
                      f"{self.max_gap:,} is refused)", flush=True)
        return known

    def _check_gap(self, top: dict[int, int], trained: dict[int, int]) -> None:
        for p, o in sorted(top.items()):
            if p in trained and o > trained[p] + self.max_gap:
                raise BadFeatureMessage("source", f"column 'src_offset' has {o} for raw partition {p}, more than "
                                        f"{self.max_gap:,} past the highest offset trained there ({trained[p]}); "
                                        f"such a row would mark every later event of the partition as a duplicate")


def _highest_per_partition(partitions: np.ndarray, offsets: np.ndarray) -> dict[int, int]:
    if partitions.min() == partitions.max():  # the usual message: one raw partition
        return {int(partitions[0]): int(offsets.max())}
    order = np.argsort(partitions, kind="stable")
    p, o = partitions[order], offsets[order]
    starts = np.flatnonzero(np.r_[True, p[1:] != p[:-1]])
    return {int(k): int(v) for k, v in zip(p[starts], np.maximum.reduceat(o, starts))}

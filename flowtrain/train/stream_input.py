"""The online trainer's input check: a feature message is trained on only if the dataset says it can be.

A feature message (one Arrow IPC stream, as the stream pipeline writes it) must hold, for the
dataset the trainer was built for:

- ``num__<col>`` for every numeric column: a floating or integer type, no nulls, every value
  finite once it is a float32 (what the model reads);
- ``cat__<col>`` for every categorical column: an integer type, no nulls, every code in
  ``[0, vocabulary size]`` (0 is the out-of-vocabulary bucket);
- ``label``: a floating or integer type, no nulls, finite; for a classification a class index
  in ``[0, classes)``;
- ``src_partition`` and ``src_offset`` (where the row came from: the exactly-once ledger): an
  integer type, no nulls, ``>= 0``.

Other columns are allowed and ignored. The stream's decoded size is checked from its metadata
before any body is decompressed (``connectors.arrow_ipc``). A message that fails raises
``BadFeatureMessage`` whose ``kind`` names the check and whose text says what is wrong (the
column, the value, the row) in a line; the trainer sends it to its dead-letter topic.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from connectors.arrow_ipc import IpcTooLarge, NotArrowIpc, decode_bounded
from connectors.dataset_spec import CAT_PREFIX, LABEL, NUM_PREFIX
from flowtrain.train.loader import TabularDataset, TabularSplit

__all__ = ["BadFeatureMessage", "FeatureInput", "FeatureMessageCheck", "SOURCE_COLUMNS", "DEFAULT_MAX_DECODED_BYTES"]

#: Where each row came from (raw partition, raw offset): the trainer's exactly-once state.
SOURCE_COLUMNS = ("src_partition", "src_offset")
#: Largest decoded size of one feature message (64 MiB: ~30x a 2,000-row message of 100 features).
DEFAULT_MAX_DECODED_BYTES = 64 << 20


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


def _floating_or_integer(t: pa.DataType) -> bool:
    return pa.types.is_floating(t) or pa.types.is_integer(t)


class FeatureMessageCheck:
    """Checks and converts feature messages for one dataset (see the module doc)."""

    #: How a message can fail, as counted in the trainer's status and checkpoints.
    KINDS = ("not_arrow", "too_large", "schema", "values", "non_finite_loss")

    def __init__(self, data: TabularDataset, *, max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES):
        if max_decoded_bytes < 1:
            raise ValueError(f"max_decoded_bytes={max_decoded_bytes!r}: must be >= 1")
        spec = data.spec
        self.max_decoded_bytes = max_decoded_bytes
        self.numeric = [NUM_PREFIX + c for c in spec.all_numeric]
        self.categorical = [CAT_PREFIX + c for c in spec.categorical]
        self.cardinalities = data.cardinalities  # vocabulary + 1: codes 0..len(vocab)
        self.classes = data.n_classes if spec.task == "classification" else 0
        self.types = {**{c: ("a number", _floating_or_integer) for c in self.numeric},
                      **{c: ("an integer", pa.types.is_integer) for c in self.categorical},
                      LABEL: ("a number", _floating_or_integer),
                      **{c: ("an integer", pa.types.is_integer) for c in SOURCE_COLUMNS}}

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
        x_cat = self._stack(columns, self.categorical, np.int64) if self.categorical else np.zeros((n, 0), np.int64)
        bad = (x_cat < 0) | (x_cat >= np.asarray(self.cardinalities, dtype=np.int64))
        if bad.any():
            i, j = (int(k[0]) for k in np.nonzero(bad))
            size = self.cardinalities[j]
            raise BadFeatureMessage("values", f"column {self.categorical[j]!r} has category code {int(x_cat[i, j])} "
                                    f"at row {i}, outside [0, {size - 1}] (the dataset's vocabulary has {size - 1} "
                                    f"value(s); 0 is the out-of-vocabulary code)")
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
        split = TabularSplit(torch.from_numpy(x_num), torch.from_numpy(x_cat), torch.from_numpy(y.copy()))
        return FeatureInput(split, sources[:, 0].copy(), sources[:, 1].copy())

    @staticmethod
    def _not_finite(table: pa.Table, values: np.ndarray, names: list[str]):
        bad = ~np.isfinite(values)
        i, j = (int(k[0]) for k in np.nonzero(bad))
        original = table.column(names[j])[i].as_py()
        raise BadFeatureMessage("values", f"column {names[j]!r} has {int(bad[:, j].sum())} value(s) that are not "
                                f"finite as float32 (NaN, inf or beyond +-3.4e38), the first {original!r} at row {i}")

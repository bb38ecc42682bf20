"""Columnar loading of a dataset split into torch tensors, and seeded batch order.

Arrow -> numpy -> torch, a column at a time: each split is read once with pyarrow into
contiguous tensors (numerics ``[N, F]`` float32, category codes ``[N, C]`` int64, label
``[N]``), and a batch is an ``index_select`` by a slice of a permutation. No per-row Python,
no DataLoader workers to feed. The permutation of epoch ``e`` depends only on
``(seed, e)``, so a resumed run sees exactly the batches an uninterrupted one would.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from connectors.dataset import is_local_path, read_manifest, read_shard, shard_paths
from connectors.dataset_spec import CAT_PREFIX, ID_PREFIX, LABEL, NUM_PREFIX, WEIGHT, FeatureSpec


@dataclass
class Batch:
    x_num: torch.Tensor
    x_cat: torch.Tensor
    y: torch.Tensor
    #: ``--weight-column``: each row's sample weight, divided by the training split's mean weight (None: unweighted)
    w: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def take(self, index: torch.Tensor) -> Batch:
        return Batch(self.x_num.index_select(0, index), self.x_cat.index_select(0, index),
                     self.y.index_select(0, index), None if self.w is None else self.w.index_select(0, index))


@dataclass
class TabularSplit(Batch):
    """One split of a dataset held as tensors."""

    def all(self) -> Batch:
        return Batch(self.x_num, self.x_cat, self.y, self.w)


def epoch_order(n: int, *, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    if not shuffle:
        return torch.arange(n)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=gen)


def iter_batches(split: TabularSplit, *, batch_size: int, seed: int, epoch: int, shuffle: bool = True,
                 start_batch: int = 0, drop_last: bool = False) -> Iterator[Batch]:
    """Batches of one epoch, from batch ``start_batch`` on (for resuming mid-epoch).

    ``split`` may also be a ``flowtrain.train.shards.StreamedSplit`` (a split too large for the
    memory budget, streamed through a shuffle buffer): the same rows per epoch, another order."""
    if not isinstance(split, TabularSplit) and hasattr(split, "batches"):
        yield from split.batches(batch_size=batch_size, seed=seed, epoch=epoch, shuffle=shuffle,
                                 start_batch=start_batch, drop_last=drop_last)
        return
    order = epoch_order(len(split), seed=seed, epoch=epoch, shuffle=shuffle)
    stop = len(split) - (len(split) % batch_size if drop_last else 0)
    for lo in range(start_batch * batch_size, stop, batch_size):
        yield split.take(order[lo: lo + batch_size])


def feature_columns(spec: FeatureSpec) -> list[str]:
    """The dataset columns a split is built from: numerics, category codes, ID keys, the label."""
    return [NUM_PREFIX + c for c in spec.all_numeric] + [CAT_PREFIX + c for c in spec.categorical] + \
        [ID_PREFIX + c for c in spec.id_columns] + [LABEL]


def weight_mean(spec: FeatureSpec, stats: dict) -> float | None:
    """The training split's mean sample weight (``--weight-column``; None without one): each row's weight is divided
    by it, so the weights average 1 over the training rows and the loss keeps its scale (a weighted mean)."""
    if not spec.weight_column:
        return None
    mean = float(stats.get("weight_mean") or 0.0)
    if not mean > 0:
        raise ValueError(f"--weight-column {spec.weight_column!r}: the training split weighs nothing (every weight "
                         f"is 0, or the dataset's statistics have no weight_mean: run its ETL again)")
    return mean


def weights_of(table: pa.Table | pa.RecordBatch, spec: FeatureSpec, mean: float | None) -> torch.Tensor | None:
    """The rows' sample weights (the dataset's ``weight`` column) divided by ``mean``; None without a weight column
    (or when the rows do not carry one: rows to score)."""
    if mean is None or WEIGHT not in table.schema.names:
        return None
    w = np.asarray(table.column(WEIGHT).to_numpy(zero_copy_only=False), dtype=np.float32) / np.float32(mean)
    return torch.from_numpy(np.ascontiguousarray(w))


def table_to_split(table: pa.Table, spec: FeatureSpec, weight_mean: float | None = None) -> TabularSplit:
    """A table of dataset columns as tensors; with ``weight_mean`` (``weight_mean``) the sample weights too."""
    n = table.num_rows

    def stack(names, dtype):
        if not names:
            return np.zeros((n, 0), dtype=dtype)
        return np.stack([table.column(c).to_numpy() for c in names], axis=1).astype(dtype, copy=False)

    x_num = stack([NUM_PREFIX + c for c in spec.all_numeric], np.float32)
    # ID columns' int64 keys follow the category codes (flowtrain.train.models.ids splits them off)
    x_cat = stack([CAT_PREFIX + c for c in spec.categorical] + [ID_PREFIX + c for c in spec.id_columns], np.int64)
    y = table.column(LABEL).to_numpy().astype(np.float32, copy=False)
    def tensor(a: np.ndarray) -> torch.Tensor:
        a = np.ascontiguousarray(a)
        return torch.from_numpy(a if a.flags.writeable else a.copy())

    return TabularSplit(tensor(x_num), tensor(x_cat), tensor(y), weights_of(table, spec, weight_mean))


class TabularDataset:
    """A finished dataset directory: its manifest, spec, statistics and splits as tensors."""

    def __init__(self, path: str | Path):
        self.path = Path(path) if is_local_path(path) else str(path)  # a URL (gs://...) stays one
        self.manifest = read_manifest(self.path)
        self.spec = FeatureSpec.from_dict(self.manifest["spec"])
        self.stats = self.manifest["stats"]
        self._splits: dict[str, TabularSplit] = {}

    @property
    def cardinalities(self) -> list[int]:
        """Embedding sizes: vocabulary + 1 for the out-of-vocabulary code 0."""
        return [len(self.stats["vocab"][c]) + 1 for c in self.spec.categorical]

    @property
    def weight_mean(self) -> float | None:
        """The training split's mean sample weight (``--weight-column``), None without one."""
        return weight_mean(self.spec, self.stats)

    @property
    def n_numeric(self) -> int:
        return len(self.spec.all_numeric)

    @property
    def classes(self) -> list[str] | None:
        """Class names of a classification label (index = target), from the training split."""
        if self.spec.task != "classification":
            return None
        return list(self.stats.get("classes") or ["0", "1"])

    @property
    def n_classes(self) -> int:
        """Classes of a classification label (2 for ``positive_above``); 0 for a regression."""
        return len(self.classes) if self.classes is not None else 0

    @property
    def outputs(self) -> int:
        """Model outputs: K logits for K > 2 classes, else one (a binary logit or a value)."""
        return self.n_classes if self.n_classes > 2 else 1

    @property
    def kind(self) -> str:
        """"binary", "multiclass" or "regression"."""
        if self.spec.task == "regression":
            return "regression"
        return "multiclass" if self.n_classes > 2 else "binary"

    def split(self, name: str) -> TabularSplit:
        if name not in self._splits:
            columns = feature_columns(self.spec) + ([WEIGHT] if self.spec.weight_column else [])
            files = shard_paths(self.path, name)
            tables = [read_shard(f, columns=columns) for f in files]
            table = pa.concat_tables(tables) if tables else pa.table({c: pa.array([], pa.float32()) for c in columns})
            self._splits[name] = table_to_split(table, self.spec, self.weight_mean)
        return self._splits[name]


def target_scale(data: TabularDataset) -> tuple[float, float]:
    """Regression trains on a standardized target (mean 0, std 1 over the training split), so
    learning rates do not depend on the label's units; predictions are scaled back."""
    if data.spec.task != "regression":
        return 0.0, 1.0
    return float(data.stats["label_mean"]), float(data.stats.get("label_std", 1.0))

"""bench loader: flowtrain's columnar loader vs torch DataLoader over the same Parquet files.

One run, same dataset directory (the demo dataset's training split), same batch size, shuffled:
(a) the anchor, a map-style Dataset over rows with DataLoader's default collate (what most
PyTorch tabular code does); (b) DataLoader over an IterableDataset of Parquet record batches
(batch_size=None, the fast DataLoader idiom); (c) flowtrain's loader (Arrow -> numpy -> torch
once, batches by index_select); (d) flowtrain's streamed split (shards through a shuffle buffer,
for data over the memory budget). Goal: (c) >= 2x (a). Also the fraction of training step time
spent waiting on data in a real ``flowtrain batch`` training epoch (goal < 5%).
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from bench.demo import build_demo, demo, describe
from bench.table import report
from bench.timing import MIN_REPEATS, best, check_repeats, interleaved, median, repeats_note
from connectors.dataset import shard_paths
from connectors.dataset_spec import CAT_PREFIX, LABEL, NUM_PREFIX
from flowtrain.local.runners import pipeline_options
from flowtrain.train.loader import TabularDataset, iter_batches
from flowtrain.train.loop import fit
from flowtrain.train.models import build_model
from flowtrain.train.plan import TrainConfig
from flowtrain.train.shards import StreamedSplit, open_split

#: A budget below the training split's size: (d) streams it (the split needs ~80 MiB to load).
STREAM_BUDGET = "32MB"


class RowDataset(Dataset):
    """The common pattern: a table in memory, one row per __getitem__."""

    def __init__(self, files, num_cols, cat_cols):
        table = pq.read_table(files[0]) if len(files) == 1 else __import__("pyarrow").concat_tables(
            [pq.read_table(f) for f in files])
        self.num = np.stack([table[c].to_numpy() for c in num_cols], 1).astype(np.float32)
        self.cat = np.stack([table[c].to_numpy() for c in cat_cols], 1).astype(np.int64)
        self.y = table[LABEL].to_numpy().astype(np.float32)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return torch.from_numpy(self.num[i]), torch.from_numpy(self.cat[i]), torch.tensor(self.y[i])


class BatchStream(IterableDataset):
    """Record batches of the Parquet files, shuffled within each batch."""

    def __init__(self, files, num_cols, cat_cols, batch_size):
        self.files, self.num_cols, self.cat_cols, self.batch_size = files, num_cols, cat_cols, batch_size

    def __iter__(self):
        for f in self.files:
            for b in pq.ParquetFile(f).iter_batches(batch_size=self.batch_size):
                num = torch.from_numpy(np.stack([b.column(c).to_numpy() for c in self.num_cols], 1))
                cat = torch.from_numpy(np.stack([b.column(c).to_numpy() for c in self.cat_cols], 1).astype(np.int64))
                yield num, cat, torch.from_numpy(b.column(LABEL).to_numpy())


def _drain(iterable) -> tuple[int, float]:
    t0 = time.perf_counter()
    rows = 0
    for batch in iterable:
        rows += len(batch[-1]) if isinstance(batch, (tuple, list)) else len(batch)
    return rows, time.perf_counter() - t0


def run(out_dir: str | None = "bench/results", batch_size: int = 2048, repeats: int = MIN_REPEATS,
        memory_budget: str = STREAM_BUDGET) -> str:
    """``memory_budget``: (d)'s ``--memory-budget``, below the training split's size (a smaller table, e.g. a tiny
    preset's, needs a smaller one to stream)."""
    check_repeats(repeats)
    work = Path(tempfile.mkdtemp(prefix="flowtrain-bench-loader-"))
    try:
        dataset = work / "dataset"
        build_demo(demo(), "loader", dataset_path=dataset, options=pipeline_options("batch"))
        data = TabularDataset(dataset)
        files = shard_paths(dataset, "train")
        num_cols = [NUM_PREFIX + c for c in data.spec.all_numeric]
        cat_cols = [CAT_PREFIX + c for c in data.spec.categorical]

        def rows_dataloader():  # (a): load time included
            t0 = time.perf_counter()
            rows_ds = RowDataset(files, num_cols, cat_cols)
            n, _ = _drain(DataLoader(rows_ds, batch_size=batch_size, shuffle=True))
            return n, time.perf_counter() - t0

        def columnar():  # (c): load time included
            t0 = time.perf_counter()
            split = TabularDataset(dataset).split("train")
            n, _ = _drain(iter_batches(split, batch_size=batch_size, seed=0, epoch=0))
            return n, time.perf_counter() - t0

        def streamed():  # (d): shards through the shuffle buffer (a budget below the split's size)
            t0 = time.perf_counter()
            split = open_split(TabularDataset(dataset), "train", memory_budget=memory_budget)
            if not isinstance(split, StreamedSplit):
                raise SystemExit(f"bench loader: the training split fits in --memory-budget {memory_budget}, so (d) "
                                 f"would not stream it: pass a smaller --memory-budget")
            n, _ = _drain(iter_batches(split, batch_size=batch_size, seed=0, epoch=0))
            return n, time.perf_counter() - t0

        def training_epoch():
            config = TrainConfig(epochs=1, batch_size=batch_size, no_progress=True, patience=5)
            result = fit(build_model("mlp", data, config), data, config, name="bench")
            return result.data_wait_fraction

        runs = interleaved({"a": rows_dataloader,
                            "b": lambda: _drain(DataLoader(BatchStream(files, num_cols, cat_cols, batch_size),
                                                           batch_size=None)),
                            "c": columnar, "d": streamed, "fit": training_epoch}, repeats=repeats)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    n = {k: runs[k][0][0] for k in "abcd"}
    sec = {k: median(runs[k], key=lambda r: r[1]) for k in "abcd"}
    rate_a = n["a"] / sec["a"]
    labels = {"a": "(a) DataLoader, map-style rows + collate (anchor)",
              "b": "(b) DataLoader, IterableDataset of Parquet batches",
              "c": "(c) flowtrain columnar loader (shuffled)",
              "d": f"(d) flowtrain streamed shards, shuffle buffer (--memory-budget {memory_budget})"}
    rows = [(labels[k], n[k], sec[k], best(runs[k], key=lambda r: r[1]), n[k] / sec[k], (n[k] / sec[k]) / rate_a)
            for k in "abcd"]
    wait = median(runs["fit"])
    return report("loader", ["loader", "rows", "seconds", "best s", "rows/s", "vs (a)"], rows,
                  notes=[f"Training split of {describe()}, batch {batch_size}, one epoch, load time included; "
                         f"{repeats_note(repeats)}.",
                         f"Waiting on data in a flowtrain training epoch: {100 * wait:.2f}% of step time (median; "
                         f"goal < 5%)."], out_dir=out_dir)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch-size", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=MIN_REPEATS, help="interleaved runs (>= 3); medians reported")
    ap.add_argument("--memory-budget", default=STREAM_BUDGET,
                    help=f"(d)'s budget, below the training split's size so that it streams (default {STREAM_BUDGET})")
    a = ap.parse_args(argv)
    run(batch_size=a.batch_size, repeats=a.repeats, memory_budget=a.memory_budget)


if __name__ == "__main__":
    main()

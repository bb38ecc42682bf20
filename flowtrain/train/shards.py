"""Bounded-memory loading: a dataset split streamed from its Parquet shards through a shuffle buffer.

``TabularDataset.split`` holds a whole split in memory as tensors (fast, an exact permutation per
epoch). A split that does not fit the memory budget (``--memory-budget``, default
``DEFAULT_BUDGET_FRACTION`` of this machine's RAM, shared by the local workers) is streamed
instead: its Parquet row groups are read in a seeded order per epoch, in chunks, and pass
through a shuffle buffer of ``buffer_rows`` rows: each incoming row takes the place of a random
resident, which leaves as a training row; at the end of the epoch the buffer drains in random
order. Every row enters once and leaves once: **every row exactly once per epoch**, as on the
in-memory path, only in another (still seeded, deterministic) order. Reading, decoding and the
buffer run in one background thread, so a training step rarely waits for data.

``open_split`` picks the path; ``iter_batches`` in ``flowtrain.train.loader`` accepts either kind of
split, so the training loop, evaluation and the data-parallel engine do not care which it got.
Memory on the streaming path (``StreamPlan.peak_rows``): the buffer plus a few chunks of tensors
(the chunk read, the rows it evicts, rows waiting to become a batch, ``PREFETCH_CHUNKS`` queued),
one decoded Parquet row group, and the split's label vector (4 bytes per row, for evaluation).
"""
from __future__ import annotations

import contextlib
import os
import queue
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from connectors.dataset import is_local_path, read_shard, shard_paths
from connectors.dataset_spec import LABEL, WEIGHT, FeatureSpec
from flowtrain.parallel.device import local_world_size
from flowtrain.train.loader import Batch, TabularDataset, TabularSplit, feature_columns, table_to_split

__all__ = ["DEFAULT_BUDGET_FRACTION", "LOAD_OVERHEAD", "PREFETCH_CHUNKS", "RAMP", "StreamPlan", "StreamedSplit",
           "format_bytes", "memory_budget_bytes", "open_split", "parse_memory_budget", "plan_stream", "row_bytes", "total_memory"]

#: Default memory budget: this fraction of the machine's RAM (or of the cgroup's limit), shared by
#: the workers on this machine.
DEFAULT_BUDGET_FRACTION = 0.25
#: Peak bytes while loading a split into memory per byte of its tensors (the Arrow table, the
#: stacked numpy arrays and the tensors are alive at once); measured 3.07 on the 10x demo dataset.
LOAD_OVERHEAD = 3
#: Chunks the reader thread may hold ready ahead of the shuffle buffer.
PREFETCH_CHUNKS = 2
#: While the shuffle buffer fills, this share of each incoming chunk replaces residents (which
#: leave as training rows) and the rest grows the buffer: training starts after two chunks.
RAMP = 0.5
_MIN_CHUNK, _MAX_CHUNK, _MAX_BUFFER = 64, 65_536, 2_097_152

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def total_memory() -> int:
    """Physical RAM, or the cgroup's memory limit where that is lower (containers)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def parse_memory_budget(value: int | float | str | None) -> int | None:
    """``"2GB"``, ``"512m"``, ``"1.5GiB"``, ``"25%"`` (of RAM), ``1000000`` (bytes) -> bytes; None stays None.

    Units are powers of 1024 (``k``, ``m``, ``g``, ``t``, with or without ``b``/``ib``).
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"--memory-budget {value!r} is not a size")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    else:
        text = str(value).strip().lower().replace(" ", "").replace("_", "")
        if text.endswith("%"):
            try:
                percent = float(text[:-1])
            except ValueError:
                percent = -1.0
            if not 0 < percent <= 100:
                raise ValueError(f"--memory-budget {value!r}: a percentage must be in (0, 100], e.g. 25%")
            return int(total_memory() * percent / 100)
        m = re.fullmatch(r"([0-9]*\.?[0-9]+)([kmgt]?)(i?b)?", text)
        if not m:
            raise ValueError(f"--memory-budget {value!r} is not a size: give bytes or a number with a unit, "
                             f"e.g. 512MB, 2GB, 1.5GiB, or a share of RAM such as 25%")
        number, unit = float(m.group(1)), m.group(2) or ""
    budget = int(number * _UNITS[unit])
    if budget <= 0:
        raise ValueError(f"--memory-budget {value!r} must be more than 0 bytes")
    return budget


def memory_budget_bytes(value: int | float | str | None = None) -> int:
    """This process's budget in bytes: ``value`` (or the default share of RAM) divided among the
    workers on this machine (``LOCAL_WORLD_SIZE``, set by flowtrain's launcher and by torchrun)."""
    budget = parse_memory_budget(value)
    if budget is None:
        budget = int(total_memory() * DEFAULT_BUDGET_FRACTION)
    local_workers = local_world_size()
    return max(1, budget // local_workers)


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} GiB"


def row_bytes(spec: FeatureSpec) -> int:
    """Bytes one row takes as tensors: float32 numerics, int64 category codes, a float32 label (and a float32 sample
    weight with ``--weight-column``)."""
    return 4 * len(spec.all_numeric) + 8 * len(spec.categorical) + 4 + (4 if spec.weight_column else 0)


@dataclass(frozen=True)
class StreamPlan:
    """How much a streamed split holds at once, in rows."""

    buffer_rows: int
    chunk_rows: int

    def peak_rows(self) -> int:
        """Rows of tensors alive at most: the buffer, the chunk read, the rows it evicts, the rows
        waiting to become a batch, and the prefetch queue."""
        return self.buffer_rows + (3 + PREFETCH_CHUNKS) * self.chunk_rows


def plan_stream(budget_bytes: int, bytes_per_row: int) -> StreamPlan:
    """The largest shuffle buffer whose peak (``StreamPlan.peak_rows``) fits ``budget_bytes``."""
    affordable = max(1, budget_bytes // max(1, bytes_per_row))
    chunk = min(_MAX_CHUNK, max(_MIN_CHUNK, affordable // 16))
    buffer = affordable - (3 + PREFETCH_CHUNKS) * chunk
    return StreamPlan(buffer_rows=min(_MAX_BUFFER, max(chunk, buffer)), chunk_rows=chunk)


def open_split(data: TabularDataset, name: str, *, memory_budget: int | float | str | None = None
               ) -> TabularSplit | StreamedSplit:
    """The split in memory when it fits ``memory_budget`` (see ``memory_budget_bytes``), else streamed."""
    budget = memory_budget_bytes(memory_budget)
    rows = int(data.manifest.get("rows", {}).get(name, 0))
    need = rows * row_bytes(data.spec) * LOAD_OVERHEAD
    if need <= budget:
        return data.split(name)
    return StreamedSplit(data, name, plan=plan_stream(budget, row_bytes(data.spec)), budget_bytes=budget)


@dataclass(frozen=True)
class _Unit:
    path: str
    row_group: int
    rows: int


class StreamedSplit:
    """One split of a dataset read from its shards on every pass, never held whole.

    ``len()`` and the batches are those of the in-memory split; ``y`` (the labels, in file order)
    is read once on first use. ``peak_buffer_rows`` records the most rows the shuffle buffer
    held (for tests and benchmarks).
    """

    def __init__(self, data: TabularDataset, name: str, *, plan: StreamPlan, budget_bytes: int | None = None):
        self.name, self.spec, self.plan, self.budget_bytes = name, data.spec, plan, budget_bytes
        self.weight_mean = data.weight_mean  # --weight-column: each row's weight over the training mean (else None)
        self.files = shard_paths(data.path, name)
        self.columns = feature_columns(self.spec) + ([WEIGHT] if self.weight_mean is not None else [])
        self.units: list[_Unit] = []
        for path in self.files:
            with _parquet_file(path) as pf:
                meta = pf.metadata
            self.units += [_Unit(path, i, meta.row_group(i).num_rows) for i in range(meta.num_row_groups)]
        self._rows = sum(u.rows for u in self.units)
        self._y: torch.Tensor | None = None
        self._w: torch.Tensor | None = None
        self.peak_buffer_rows = 0

    def __len__(self) -> int:
        return self._rows

    @property
    def y(self) -> torch.Tensor:
        if self._y is None:
            parts = [read_shard(f, columns=[LABEL]).column(LABEL).to_numpy().astype(np.float32) for f in self.files]
            self._y = torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32))
        return self._y

    @property
    def w(self) -> torch.Tensor | None:
        """The split's sample weights in shard order (``--weight-column``, over the training mean), read once; None
        without a weight column."""
        if self.weight_mean is None:
            return None
        if self._w is None:
            parts = [read_shard(f, columns=[WEIGHT]).column(WEIGHT).to_numpy().astype(np.float32) for f in self.files]
            self._w = torch.from_numpy(np.concatenate(parts) / np.float32(self.weight_mean) if parts
                                       else np.zeros(0, dtype=np.float32))
        return self._w

    def describe(self) -> str:
        budget = format_bytes(self.budget_bytes) if self.budget_bytes else "the budget"
        need = format_bytes(len(self) * row_bytes(self.spec) * LOAD_OVERHEAD)
        return (f"{self.name}: {len(self):,} rows (~{need} to load) do not fit the memory budget ({budget}): streaming "
                f"{len(self.units)} row groups of {len(self.files)} shard(s) through a shuffle buffer of "
                f"{self.plan.buffer_rows:,} rows")

    # --- reading ---------------------------------------------------------------------------------
    def _chunks(self, order: list[int]) -> Iterator[Batch]:
        """The units in ``order``, in chunks of at most ``chunk_rows`` rows, as tensors."""
        for i in order:
            unit = self.units[i]
            with _parquet_file(unit.path) as pf:
                for rb in pf.iter_batches(batch_size=self.plan.chunk_rows, row_groups=[unit.row_group],
                                          columns=self.columns):
                    yield table_to_split(pa.Table.from_batches([rb]), self.spec, self.weight_mean)

    def _shuffled(self, chunks: Iterator[Batch], gen: torch.Generator) -> Iterator[Batch]:
        """Rows out of a shuffle buffer of ``buffer_rows``: each incoming row takes the place of a
        random resident, which leaves; at the end the buffer drains in random order. Every row
        enters once and leaves once. While the buffer fills, only ``RAMP`` of each chunk takes a
        resident's place (the rest grows the buffer), so the first batch waits for two chunks,
        not for a full buffer. Work per chunk: O(chunk) rows moved, O(buffer) integers."""
        size = self.plan.buffer_rows
        buf: Batch | None = None
        fill = 0
        for chunk in chunks:
            if buf is None:
                buf = Batch(chunk.x_num.new_empty((size, *chunk.x_num.shape[1:])),
                            chunk.x_cat.new_empty((size, *chunk.x_cat.shape[1:])), chunk.y.new_empty((size,)),
                            None if chunk.w is None else chunk.w.new_empty((size,)))
            lo, n = 0, len(chunk)
            while lo < n:
                rest, room = n - lo, size - fill
                # incoming rows that replace residents: all once the buffer is full, RAMP of them before
                swap = min(rest, fill) if not room else min(int(rest * RAMP), fill)
                if swap:
                    slots = torch.randperm(fill, generator=gen)[:swap]
                    yield buf.take(slots)
                    for mine, theirs in zip(_tensors(buf), _tensors(chunk)):
                        mine[slots] = theirs[lo:lo + swap]
                    lo += swap
                add = min(n - lo, room)
                if add:
                    for mine, theirs in zip(_tensors(buf), _tensors(chunk)):
                        mine[fill:fill + add] = theirs[lo:lo + add]
                    fill, lo = fill + add, lo + add
                    self.peak_buffer_rows = max(self.peak_buffer_rows, fill)
        if fill:
            yield _slice(buf, 0, fill).take(torch.randperm(fill, generator=gen))

    def batches(self, *, batch_size: int, seed: int, epoch: int, shuffle: bool = True, start_batch: int = 0,
                drop_last: bool = False) -> Iterator[Batch]:
        """The batches of one epoch (the same arguments as ``flowtrain.train.loader.iter_batches``).

        Reading, decoding and the shuffle buffer run in a background thread (all random draws
        there, in a fixed order: the batches depend only on ``seed`` and ``epoch``)."""
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        order = torch.randperm(len(self.units), generator=gen).tolist() if shuffle else list(range(len(self.units)))
        self.peak_buffer_rows = 0
        parts = self._shuffled(self._chunks(order), gen) if shuffle else self._chunks(order)
        stop_rows = len(self) - (len(self) % batch_size if drop_last else 0)
        emitted = index = 0  # rows handed out (skipped batches included), batch number
        pending: list[Batch] = []  # rows out of the buffer, not yet a whole batch
        pending_rows = 0

        def cut(final: bool) -> Iterator[Batch]:
            nonlocal pending, pending_rows, emitted, index
            if not pending_rows:
                return
            whole = pending[0] if len(pending) == 1 else _cat(pending)
            lo = 0
            while pending_rows - lo >= batch_size or (final and lo < pending_rows):
                n = min(batch_size, pending_rows - lo)
                if emitted + n > stop_rows:
                    break
                if index >= start_batch:
                    yield _slice(whole, lo, lo + n)
                lo, emitted, index = lo + n, emitted + n, index + 1
            # the few rows short of a batch are copied, so the part they came from can be freed
            rest = pending_rows - lo
            pending = [_clone(_slice(whole, lo, pending_rows))] if rest and not final else []
            pending_rows = rest if not final else 0

        for part in _in_background(parts, name=f"flowtrain-shards-{self.name}"):
            pending.append(part)
            pending_rows += len(part)
            yield from cut(final=False)
        yield from cut(final=True)


def _in_background(items: Iterator, *, name: str, depth: int = PREFETCH_CHUNKS) -> Iterator:
    """``items`` produced by a daemon thread, at most ``depth`` ahead; an error is raised here.
    Closing the returned generator stops the thread (and waits for it)."""
    stop = threading.Event()
    ready: queue.Queue = queue.Queue(maxsize=depth)
    done = object()

    def produce() -> None:
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        ready.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            ready.put(done)
        except BaseException as err:  # noqa: BLE001 - handed to the consumer, raised there
            ready.put(err)
        finally:
            items.close() if hasattr(items, "close") else None

    thread = threading.Thread(target=produce, daemon=True, name=name)
    thread.start()
    try:
        while True:
            item = ready.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise RuntimeError(f"reading the dataset's shards failed: {item}") from item
            yield item
    finally:
        stop.set()
        while thread.is_alive():  # unblock a producer waiting on a full queue
            try:
                ready.get(timeout=0.05)
            except queue.Empty:
                pass
        thread.join()


@contextlib.contextmanager
def _parquet_file(path: str) -> Iterator[pq.ParquetFile]:
    """A shard opened for reading row groups: from a local path, or through Beam's FileSystems."""
    if is_local_path(path):
        yield pq.ParquetFile(path)
        return
    from apache_beam.io.filesystem import CompressionTypes
    from apache_beam.io.filesystems import FileSystems

    with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as fh:
        yield pq.ParquetFile(fh)


def _tensors(b: Batch) -> list[torch.Tensor]:
    """A batch's tensors, row-aligned: numerics, codes, labels and (with ``--weight-column``) sample weights."""
    return [b.x_num, b.x_cat, b.y] + ([b.w] if b.w is not None else [])


def _cat(parts: list[Batch]) -> Batch:
    return Batch(*(torch.cat(ts) for ts in zip(*(_tensors(p) for p in parts))))


def _slice(b: Batch, lo: int, hi: int) -> Batch:
    return Batch(*(t[lo:hi] for t in _tensors(b)))


def _clone(b: Batch) -> Batch:
    return Batch(*(t.clone() for t in _tensors(b)))

"""The bounded-memory training loader (flowtrain/train/shards.py): a split streamed from its shards.

Real Parquet shards and a real manifest (written with connectors.dataset.finalize_dataset), real
training with ``fit`` and the ``flowtrain batch`` command line; nothing mocked.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from connectors.dataset import finalize_dataset
from connectors.dataset_spec import CAT_PREFIX, LABEL, NUM_PREFIX, FeatureSpec
from flowtrain.train.loader import TabularDataset, TabularSplit, iter_batches
from flowtrain.train.shards import StreamedSplit, StreamPlan, open_split, parse_memory_budget, plan_stream, row_bytes

ID_SCALE = 32768.0  # ids are stored as id / 2**15: exact in float32, small enough to train on

SPEC = FeatureSpec(label="y", task="classification", numeric=["id", "x"], categorical=["c"])
#: rows per shard of each split, and the row-group size: uneven on purpose
SHARDS = {"train": [7_000, 5_003, 9_001], "valid": [2_500, 1_700], "test": [3_001]}
ROW_GROUP = 2_000


def make_dataset(base: Path) -> Path:
    """A dataset whose label follows x and c (learnable), with a unique id per row."""
    rng = np.random.default_rng(7)
    tmp = base / "ds.tmp"
    shards, next_id = [], 0
    for split, sizes in SHARDS.items():
        for i, n in enumerate(sizes):
            ids = np.arange(next_id, next_id + n)
            next_id += n
            x = rng.standard_normal(n).astype(np.float32)
            c = rng.integers(1, 5, n).astype(np.int32)
            y = ((x + 1.5 * (c == 2) - 0.5 + 0.3 * rng.standard_normal(n)) > 0).astype(np.float32)
            table = pa.table({NUM_PREFIX + "id": (ids / ID_SCALE).astype(np.float32), NUM_PREFIX + "x": x,
                              CAT_PREFIX + "c": c, LABEL: y})
            rel = f"{split}/part-{i}.parquet"
            (tmp / split).mkdir(parents=True, exist_ok=True)
            pq.write_table(table, tmp / rel, row_group_size=ROW_GROUP)
            shards.append({"split": split, "file": rel, "rows": n,
                           "schema": [{"name": f.name, "type": str(f.type), "nullable": True} for f in table.schema]})
    stats = {"vocab": {"c": ["a", "b", "c", "d"]}, "label_mean": 0.5, "label_values": [0.0, 1.0]}
    total = sum(sum(v) for v in SHARDS.values())
    counts = {"in": total, "out": total, "dead_letters": 0, "dead_letters_by_reason": {},
              "out_by_split": {k: sum(v) for k, v in SHARDS.items()}}
    finalize_dataset(str(tmp), str(base / "ds"), shards, {"spec": SPEC.to_dict(), "stats": stats, "counts": counts},
                     overwrite=True)
    return base / "ds"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("shards"))


def _ids(batch) -> np.ndarray:
    return np.rint(batch.x_num[:, 0].numpy().astype(np.float64) * ID_SCALE).astype(np.int64)


def _streamed(dataset: Path, buffer_rows: int = 1_500, chunk_rows: int = 500) -> StreamedSplit:
    return StreamedSplit(TabularDataset(dataset), "train", plan=StreamPlan(buffer_rows=buffer_rows,
                                                                           chunk_rows=chunk_rows))


@pytest.mark.timeout(60)
def test_streamed_split_yields_every_row_exactly_once_per_epoch_with_a_bounded_buffer(dataset):
    split = _streamed(dataset)
    n = sum(SHARDS["train"])
    assert len(split) == n
    orders = []
    for epoch in range(3):
        batches = list(iter_batches(split, batch_size=256, seed=3, epoch=epoch))
        ids = np.concatenate([_ids(b) for b in batches])
        # every row once: exactly the ids 0..n-1 (train holds the first n ids)
        assert len(ids) == n and np.array_equal(np.sort(ids), np.arange(n))
        assert [len(b) for b in batches] == [256] * (n // 256) + [n % 256]
        # labels and features travel with their row
        whole = TabularDataset(dataset).split("train")
        got = torch.cat([b.y for b in batches])
        assert torch.equal(got, whole.y[torch.from_numpy(ids)])
        # the buffer stayed bounded, far below the split
        assert 0 < split.peak_buffer_rows <= 1_500 < n // 10
        orders.append(ids)
    # shuffled: not file order, a different order each epoch, the same order for the same (seed, epoch)
    assert not np.array_equal(orders[0], np.arange(n))
    assert not np.array_equal(orders[0], orders[1])
    again = np.concatenate([_ids(b) for b in iter_batches(split, batch_size=256, seed=3, epoch=1)])
    assert np.array_equal(again, orders[1])
    # mixed within row groups (hardly any neighbours stay neighbours) and across them (the order
    # of the row groups is shuffled too: file position says little about when a row leaves)
    for ids in orders:
        assert np.mean(np.abs(np.diff(ids)) == 1) < 0.01
        assert abs(np.corrcoef(ids, np.arange(n))[0, 1]) < 0.9


@pytest.mark.timeout(60)
def test_streamed_split_resume_drop_last_and_file_order(dataset):
    split = _streamed(dataset, buffer_rows=3_000, chunk_rows=700)
    n = len(split)
    full = list(iter_batches(split, batch_size=512, seed=1, epoch=0))
    tail = list(iter_batches(split, batch_size=512, seed=1, epoch=0, start_batch=5))
    assert len(tail) == len(full) - 5
    assert all(torch.equal(a.x_num, b.x_num) and torch.equal(a.y, b.y) for a, b in zip(full[5:], tail))
    dropped = list(iter_batches(split, batch_size=512, seed=1, epoch=0, drop_last=True))
    assert [len(b) for b in dropped] == [512] * (n // 512)
    # unshuffled: file order, the same rows and labels as the in-memory split (evaluation relies on it)
    plain = list(iter_batches(split, batch_size=4_096, seed=0, epoch=0, shuffle=False))
    assert np.array_equal(np.concatenate([_ids(b) for b in plain]), np.arange(n))
    assert torch.equal(torch.cat([b.y for b in plain]), split.y)
    assert torch.equal(split.y, TabularDataset(dataset).split("train").y)
    # a consumer that stops early leaves no reader thread behind
    import threading

    it = iter_batches(split, batch_size=64, seed=0, epoch=0)
    next(it)
    it.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("flowtrain-shards-")]


@pytest.mark.timeout(30)
def test_open_split_keeps_small_splits_in_memory_and_streams_over_budget(dataset):
    data = TabularDataset(dataset)
    assert isinstance(open_split(data, "train"), TabularSplit)  # default budget: a share of RAM
    big = open_split(data, "train", memory_budget="64KB")
    assert isinstance(big, StreamedSplit)
    # the plan fits the budget
    assert big.plan.peak_rows() * row_bytes(data.spec) <= 64 * 1024
    assert "do not fit the memory budget (64.0 KiB)" in big.describe()
    assert parse_memory_budget("2GB") == 2 << 30 and parse_memory_budget("512m") == 512 << 20
    assert parse_memory_budget("1.5GiB") == int(1.5 * (1 << 30)) and parse_memory_budget(1000) == 1000
    assert parse_memory_budget(None) is None and parse_memory_budget("50%") > 0
    for bad in ("lots", "-1GB", "0", "150%"):
        with pytest.raises(ValueError, match="--memory-budget"):
            parse_memory_budget(bad)
    plan = plan_stream(256 << 20, 112)
    assert plan.peak_rows() * 112 <= 256 << 20 and plan.buffer_rows > 1_000_000


@pytest.mark.timeout(300)
def test_training_forced_onto_the_streaming_path_learns(dataset, capsys):
    from flowtrain.train.loop import evaluate, fit
    from flowtrain.train.models import build_model
    from flowtrain.train.plan import TrainConfig

    data = TabularDataset(dataset)
    results = {}
    for budget in ("64KB", None):  # streamed, then in memory
        config = TrainConfig(epochs=2, batch_size=512, lr=3e-3, patience=5, hidden=(32,), dropout=0.0,
                             no_progress=True, memory_budget=budget)
        result = fit(build_model("mlp", data, config), data, config, name="m")
        out = capsys.readouterr().out
        assert ("streaming" in out) == (budget is not None), out
        assert result.steps == 2 * -(-sum(SHARDS["train"]) // 512)  # every row once per epoch
        valid = open_split(data, "valid", memory_budget=budget)
        assert isinstance(valid, StreamedSplit) == (budget is not None)
        results[budget] = evaluate(result.model, valid, "classification")
    # a sane model: the label is learnable from x and c; both paths reach about the same quality
    assert results["64KB"]["auc"] > 0.9, results
    assert abs(results["64KB"]["auc"] - results[None]["auc"]) < 0.03, results


@pytest.mark.timeout(300)
def test_batch_cli_memory_budget_streams_and_rejects_a_bad_budget(dataset, tmp_path):
    cmd = [sys.executable, "-m", "flowtrain.cli", "batch", "--no-progress", "--dataset", str(dataset),
           "--epochs", "2", "--batch-size", "512", "--hidden", "32"]
    proc = subprocess.run(cmd + ["--out", str(tmp_path / "run"), "--memory-budget", "64KB"],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "model: train: 21,004 rows" in proc.stdout and "streaming" in proc.stdout, proc.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["test"]["model"]["auc"] > 0.85, summary["test"]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["memory_budget"] == "64KB"
    bad = subprocess.run(cmd + ["--out", str(tmp_path / "bad"), "--memory-budget", "lots"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--memory-budget 'lots' is not a size" in bad.stderr, bad.stderr[-2000:]


@pytest.mark.timeout(120)
def test_linear_baseline_over_budget_streams_the_split_and_fits_the_same_model(dataset, monkeypatch):
    """fit_linear over --memory-budget never loads the training split, and its full-batch
    objective summed over chunks gives the model the in-memory fit gives."""
    from flowtrain.train import baselines

    held = baselines.fit_linear(TabularDataset(dataset), seed=0)
    data = TabularDataset(dataset)

    def no_load(self, name):
        raise AssertionError(f"split {name!r} loaded whole although it is over the memory budget")

    monkeypatch.setattr(TabularDataset, "split", no_load)
    monkeypatch.setattr(baselines, "STREAM_CHUNK_ROWS", 4_096)  # several chunks per pass
    streamed = baselines.fit_linear(data, seed=0, memory_budget="64KB")
    assert streamed.grad_norm < 1e-3 and held.grad_norm < 1e-3
    assert streamed.objective == pytest.approx(held.objective, rel=1e-6)
    for (name, a), (_, b) in zip(held.model.state_dict().items(), streamed.model.state_dict().items()):
        assert torch.allclose(a, b, atol=1e-4), name


@pytest.mark.timeout(60)
def test_a_split_directory_or_shard_symlinked_outside_the_dataset_is_refused(tmp_path):
    """Issue 28 item 13: a split directory (or a shard) replaced by a symlink to files outside the dataset
    was read as the dataset's own; now loading the split, streamed or whole, is a DatasetError naming the
    link and where it leads. A symlink that stays inside the dataset is still read."""
    import shutil

    from connectors.dataset import DatasetError

    ds = make_dataset(tmp_path / "a")
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(ds / "valid", elsewhere)
    shutil.rmtree(ds / "valid")
    (ds / "valid").symlink_to(elsewhere, target_is_directory=True)
    test_shard = next((ds / "test").glob("*.parquet"))
    shutil.copy(test_shard, tmp_path / "outside.parquet")
    test_shard.unlink()
    test_shard.symlink_to(tmp_path / "outside.parquet")
    data = TabularDataset(ds)
    assert len(data.split("train")) == sum(SHARDS["train"])  # the real directories still load
    for split, link in (("valid", ds / "valid"), ("test", test_shard)):
        with pytest.raises(DatasetError, match="leads outside the dataset directory") as err:
            data.split(split)
        assert f"{link} is a symlink to {(tmp_path / ('elsewhere' if split == 'valid' else 'outside.parquet'))}" \
            in str(err.value)
        with pytest.raises(DatasetError, match="leads outside"):
            StreamedSplit(data, split, plan=StreamPlan(buffer_rows=100, chunk_rows=50))
    # inside the dataset, a link is only another name for its own files
    shutil.move(str(tmp_path / "outside.parquet"), str(ds / "test" / "kept.parquet"))
    test_shard.unlink()
    test_shard.symlink_to(ds / "test" / "kept.parquet")
    assert len(TabularDataset(ds).split("test")) == sum(SHARDS["test"])

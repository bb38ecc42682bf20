"""Comparing two datasets a runner wrote (the FnApiRunner's and Flink's, local or across hosts), and the
small two-file table both Flink tests run the tabular ETL on."""
from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from connectors.dataset import read_manifest, read_shard, shard_paths


def tabular_inputs(base: Path, n: int = 3000) -> list[str]:
    """``n`` rows of y = 2 x1 + 0.5 x2 + [c = green] + noise, about 3% with x1 missing (dead letters):
    the first 14/30 as CSV, the rest as Parquet in row groups of 400."""
    rng = np.random.default_rng(12)
    x1 = rng.normal(size=n)
    x1[rng.random(n) < 0.03] = np.nan  # a required value missing: a dead letter
    x2 = rng.uniform(0, 10, n)
    c = rng.choice(["red", "green", "blue", "grey"], n)
    y = 2 * x1 + 0.5 * x2 + (c == "green") + rng.normal(0, 0.1, n)
    table = pa.table({"x1": x1, "x2": x2, "c": c, "y": y})
    base.mkdir(parents=True, exist_ok=True)
    pacsv.write_csv(table.slice(0, n * 14 // 30), base / "part-a.csv")
    pq.write_table(table.slice(n * 14 // 30), base / "part-b.parquet", row_group_size=400)
    return [str(base / "part-a.csv"), str(base / "part-b.parquet")]


def assert_close(a, b, path="stats") -> None:
    """Equal structure; floats within 1e-9 relative (Flink combines partial sums in another order)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{path}: {a.keys()} != {b.keys()}"
        for k in a:
            assert_close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), f"{path}: {a} != {b}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_close(x, y, f"{path}[{i}]")
    elif isinstance(a, float) or isinstance(b, float):
        assert math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12), f"{path}: {a} != {b}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def row_multiset(table: pa.Table) -> Counter:
    def norm(v):
        return float(f"{v:.9g}") if isinstance(v, float) else v

    return Counter(tuple(norm(v) for v in row) for row in zip(*(table.column(c).to_pylist()
                                                                for c in table.column_names)))


def assert_same_dataset(reference: str | Path, other: str | Path) -> dict:
    """The same counts, schema, spec, vocabularies, statistics (floats to 1e-9) and rows per split
    (as multisets: runners write shards in other orders); returns the reference's manifest."""
    ref, got = read_manifest(reference), read_manifest(other)
    assert got["counts"] == ref["counts"] and got["rows"] == ref["rows"]
    assert got["schema"] == ref["schema"] and got["spec"] == ref["spec"]
    assert got["stats"]["vocab"] == ref["stats"]["vocab"]  # vocabularies exactly
    assert_close(ref["stats"], got["stats"])
    for split in ref["splits"]:
        a = pa.concat_tables([read_shard(f) for f in shard_paths(reference, split)])
        b = pa.concat_tables([read_shard(f) for f in shard_paths(other, split)])
        assert b.num_rows == a.num_rows > 0
        assert row_multiset(b) == row_multiset(a), f"split {split}: rows differ"
    return ref

"""Issue 45 item 9: a random split hashes each file's name relative to the inputs' root, so the same file splits
the same way wherever its folder is (moved, copied, read from an object store)."""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from connectors.dataset_spec import FeatureSpec
from connectors.paths import note_origin
from connectors.rows import SOURCE_FILE, SOURCE_ROW
from pipelines.tabular.splits import assign_splits, source_names

SPEC = FeatureSpec(label="y", numeric=["x"], seed=3)


def _batch(file: str, n: int = 2000) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict({"x": np.zeros(n), "y": np.zeros(n), SOURCE_FILE: [file] * n,
                                       SOURCE_ROW: np.arange(1, n + 1)})


def test_names_are_relative_to_the_deepest_folder_holding_every_input():
    assert source_names(["/home/a/data/t.csv"])["/home/a/data/t.csv"] == "t.csv"
    names = source_names(["/x/data/a.csv", "/x/data/more/b.csv"])
    assert names["/x/data/a.csv"] == "a.csv" and names["/x/data/more/b.csv"] == "more/b.csv"
    assert source_names(["az://bucket/data/t.csv"])["az://bucket/data/t.csv"] == "t.csv"
    assert source_names(["file:///srv/t.csv"])["file:///srv/t.csv"] == "t.csv"


def test_a_moved_folder_and_an_object_store_copy_split_every_row_the_same_way(tmp_path):
    codes = {}
    for file in ("/home/me/project/data/t.csv", "/mnt/elsewhere/t.csv", "az://bucket/deep/er/t.csv"):
        codes[file] = assign_splits(_batch(file), SPEC, names=source_names([file]))
    first, *others = codes.values()
    assert all(np.array_equal(first, c) for c in others)
    assert 0.7 < (first == 0).mean() < 0.9 and (first == 2).any()  # still a random 80/10/10 split
    # a downloaded local copy names its rows by its URL: the same split as the store's name
    local = tmp_path / "0-0" / "t.csv"
    local.parent.mkdir()
    local.write_text("x,y\n")
    note_origin(local, "az://bucket/deep/er/t.csv")
    names = source_names([str(local)])
    assert names[str(local)] == names["az://bucket/deep/er/t.csv"] == "t.csv"
    # by default (no names) a file is hashed as read: two folders split differently, as before
    assert not np.array_equal(assign_splits(_batch("/a/t.csv"), SPEC), assign_splits(_batch("/b/t.csv"), SPEC))

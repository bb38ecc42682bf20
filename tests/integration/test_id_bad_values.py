"""Issue 32, bad input: an ID value that is missing, empty, too long (--max-id-bytes) or of the wrong type uses the
fallback vector and its reason is counted (the dataset manifest's counts; the reason travels with the row as its
reserved key), and with --required-ids such a row is a dead letter with its reason instead. Rows in = rows out +
dead letters."""
from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

import flowtrain
from connectors.dataset import read_manifest
from connectors.id_keys import BAD_KEYS, is_key, keys_of, reason_counts
from flowtrain.train.ids import IdTable

pytestmark = pytest.mark.timeout(300)


def test_id_bad_values_use_the_fallback_and_are_counted_or_dead_letters_when_required(tmp_path):
    r = np.random.default_rng(5)
    lines = ["x1,user,item,y"]
    want_user = {"user: empty": 0, "user: too_long": 0}
    want_dead = 0
    for i in range(300):
        user, item = f"u{int(r.integers(30))}", f"i{int(r.integers(10))}"
        if i % 10 == 3:
            user = ""  # empty (read as a missing value or an empty one: both counted)
            want_user["user: empty"] += 1
        elif i % 10 == 6:
            user = "u" * 40  # over --max-id-bytes 16
            want_user["user: too_long"] += 1
        elif i % 25 == 8:
            item = "i" * 40  # a required ID without a key: a dead letter
            want_dead += 1
        lines.append(f"{r.normal():.3f},{user},{item},{int(r.random() < 0.5)}")
    (tmp_path / "in.csv").write_text("\n".join(lines) + "\n")
    flowtrain.batch(input=[str(tmp_path / "in.csv")], out=str(tmp_path / "run"), label="y", numeric=["x1"],
                    id_columns=["user", "item"], required_ids=["item"], max_id_bytes=16, task="classification",
                    steps=2, batch_size=64, eval_every=2, id_dim=2, hidden=(4,), no_progress=True)
    manifest = read_manifest(tmp_path / "run" / "dataset")
    counts = manifest["counts"]
    assert counts["in"] == 300 == counts["out"] + counts["dead_letters"]
    assert counts["dead_letters"] == want_dead
    assert list(counts["dead_letters_by_reason"]) == ["required ID 'item' is too long (over 16 bytes); it has no "
                                                      "key (--required-ids)"]
    fallbacks = counts["id_fallbacks"]
    assert sum(v for k, v in fallbacks.items() if k in ("user: empty", "user: missing")) == want_user["user: empty"]
    assert fallbacks["user: too_long"] == want_user["user: too_long"] and not any(k.startswith("item") for k in
                                                                                      fallbacks)
    # the rows are in the dataset, each with its reason's reserved key (the fallback vector in training)
    keys = np.concatenate([pq.read_table(f).column("id__user").to_numpy()
                           for f in (tmp_path / "run" / "dataset").rglob("*.parquet")])
    assert {f"user: {k}": v for k, v in reason_counts(keys).items()} == fallbacks
    assert manifest["spec"]["required_ids"] == ["item"]


def test_id_bad_value_kinds_have_their_own_reserved_keys_and_use_the_fallback():
    keys = keys_of(["a", None, "", "x" * 300, 1.5, True, float("nan"), 42.0, 42])
    assert keys[0] == keys_of(["a"])[0] and keys[7] == keys[8]  # 42.0 (an integer column with a gap) is 42
    assert keys[1:7].tolist() == [BAD_KEYS[k] for k in ("missing", "empty", "too_long", "wrong_type", "wrong_type",
                                                        "missing")]
    assert not is_key(keys[1:7]).any() and is_key(keys[[0, 7, 8]]).all()
    t = IdTable(2)
    assert (t.observe(keys)[1:7] == -1).all() and len(t) == 2  # no row for a value without a key
    t.rows_of(keys)
    assert t.stats.unknown == 0  # a value without a key is not an unknown ID: its reason is counted where it is read

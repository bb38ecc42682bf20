"""Issue 45 item 8: `flowtrain compare` pairs two runs on the same data by the rows themselves (a row's file named
relative to the run's input folder, and its line), not by where the run's copy of the file sat or the order its
split holds the rows in."""
from __future__ import annotations

import numpy as np

from flowtrain.commands.compare import TestPredictions, paired_differences, row_ids


def _run(folder: str, order: np.ndarray, y: np.ndarray, p: np.ndarray, digest: str) -> TestPredictions:
    ids = row_ids([f"{folder}/customers.csv:{i + 2}" for i in order])
    return TestPredictions("binary", y[order], p[order], digest, ids)


def test_runs_on_copies_in_two_folders_pair_row_by_row_whatever_the_order():
    r = np.random.default_rng(0)
    n = 580
    y = (r.random(n) > 0.5).astype(float)
    p_a = np.clip(y * 0.6 + r.random(n) * 0.4, 0, 1)
    p_b = np.clip(y * 0.5 + r.random(n) * 0.5, 0, 1)
    a = _run("/home/me/data", np.arange(n), y, p_a, "digest-a")
    b = _run("/mnt/copy/of/data", r.permutation(n), y, p_b, "digest-b")  # other folder, other order, other features
    out = paired_differences(["a", "b"], [a, b], b=200)
    assert "metrics" in out["runs"]["b"], out["runs"]["b"]
    assert out["runs"]["b"]["rows"] == n
    # the same as pairing them by hand in one order
    b_sorted = _run("/x", np.arange(n), y, p_b, "digest-a")
    by_hand = paired_differences(["a", "b"], [a, b_sorted], b=200)
    assert out["runs"]["b"]["metrics"] == by_hand["runs"]["b"]["metrics"]


def test_different_rows_say_how_many_are_shared():
    y = np.zeros(10)
    a = _run("/d", np.arange(10), y, y, "x")
    b = TestPredictions("binary", y, y, "x", row_ids([f"/d/customers.csv:{i + 7}" for i in range(10)]))
    reason = paired_differences(["a", "b"], [a, b], b=50)["runs"]["b"]["reason"]
    assert reason == ("b and a have different test rows (10 and 10 rows, 5 of them the same rows of the same files): "
                      "the runs split differently (another --seed, --time-column, other files)")

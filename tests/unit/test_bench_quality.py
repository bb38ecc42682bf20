"""``flowtrain bench quality`` (issue 46 item 1): its tables are offline and say how flowtrain reads them, its metrics
are scikit-learn's, and its summary counts the goals from the medians over the seeds."""
from __future__ import annotations

import csv

import numpy as np
import pytest

from bench.quality import score, summarize
from bench.quality_tables import TABLES, TINY


def test_at_least_eight_tables_each_with_a_split_and_a_metric():
    assert len(TABLES) >= 8 and set(TINY) <= set(TABLES)
    assert {t.metric for t in TABLES.values()} == {"auc", "accuracy", "rmse"}
    assert all(t.split and t.source for t in TABLES.values())
    assert sum(t.source.startswith("generated") for t in TABLES.values()) >= 2


@pytest.mark.parametrize("name", [n for n in TABLES if n != "demo_sample"])
def test_a_table_writes_its_input_offline(name, tmp_path):
    args = TABLES[name].prepare(tmp_path, True)
    path = args[args.index("--input") + 1]
    with open(path, newline="") as fh:
        header = next(csv.reader(fh))
    label = args[args.index("--label") + 1]
    assert label in header
    named = [c for flag in ("--numeric", "--optional-numeric", "--categorical") if flag in args
             for c in args[args.index(flag) + 1].split(",")]
    assert set(named) | {label} == set(header)


def test_metrics_are_scikit_learns():
    y = np.array([0.0, 1.0, 1.0, 0.0])
    assert score("auc", y, np.array([0.1, 0.9, 0.4, 0.5])) == 0.75
    assert score("accuracy", np.array([0.0, 2.0]), np.array([[0.9, 0.1, 0.0], [0.2, 0.3, 0.5]])) == 1.0
    assert score("rmse", np.array([1.0, 3.0]), np.array([2.0, 3.0])) == pytest.approx(np.sqrt(0.5))


def _runs(default, linear, hgb, chosen="network"):
    rows = {"train": 80, "valid": 10, "test": 10}
    return [{"default": d, "linear": linear, "hgb": hgb, "lightgbm": None, "chosen": chosen, "rows": rows,
             "seconds": 1.0} for d in default]


def test_the_summary_counts_the_goals_from_the_medians():
    results = [{"table": "a", "metric": "auc", "runs": _runs([0.90, 0.80, 0.95], 0.85, 0.91)},  # median 0.90
               {"table": "b", "metric": "rmse", "runs": _runs([2.0, 2.1, 1.9], 1.9, 1.97)},  # worse than linear
               {"table": "c", "metric": "accuracy", "runs": _runs([0.5, 0.5, 0.5], 0.5, 0.9, "linear start")}]
    headers, rows, notes = summarize(results)
    assert rows[0][7] == "+5.9%" and rows[0][8] == "-1.1%" and rows[0][9] == "3/3"
    assert rows[1][7] == "-5.3%" and rows[1][8] == "-1.5%"
    assert rows[2][9] == "0/3"
    assert "beats its linear start on 1 of 3 tables; it is within 2% of HGB's metric on 2 of 3" in notes[1]

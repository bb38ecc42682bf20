"""A regression label is bounded as a numeric feature is (h6 item 3): a label of 1e30 made the label's mean and
std ~1e28 (every ordinary target then standardized to ~0) and was trained on; now it is a dead letter with its
reason, in the batch ETL and in the stream's feature code, and the label's statistics are the ordinary rows'."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pytest

from connectors.dataset_spec import FeatureSpec
from flowtrain.local.runners import pipeline_options
from pipelines.tabular.features import featurize_rows
from pipelines.tabular.stats import StatsAccumulator

pytestmark = pytest.mark.timeout(300)

SPEC = FeatureSpec(label="y", task="regression", numeric=["x"], categorical=["c"])


def _table(n: int, seed: int, absurd: dict[int, float]) -> pa.Table:
    rng = np.random.default_rng(seed)
    y = rng.normal(50, 10, n)
    for i, v in absurd.items():
        y[i] = v
    return pa.table({"x": rng.normal(size=n), "c": rng.choice(["a", "b"], n), "y": y})


@pytest.mark.parametrize("seed,n", [(0, 500), (3, 2000)])
def test_label_statistics_leave_out_an_absurd_regression_label(seed, n):
    table = _table(n, seed, {7: 1e30, n // 2: -3e38})
    acc = StatsAccumulator()
    for batch in table.to_batches(max_chunksize=128):
        acc.add(batch, SPEC)
    stats = acc.finalize(SPEC)
    ordinary = np.delete(table.column("y").to_numpy(), [7, n // 2])
    assert stats["label_mean"] == pytest.approx(float(ordinary.mean()), rel=1e-9)
    assert stats["label_std"] == pytest.approx(float(ordinary.std()), rel=1e-6)
    assert stats["label_outside"] == 2 and 1e6 < stats["label_max_abs"] < 1e9  # 2**20 x the usual size (~2**6)


def test_an_absurd_regression_label_is_a_dead_letter_in_the_batch_etl(tmp_path):
    from pipelines.tabular.pipeline import run_tabular_etl

    n, absurd = 1500, {17: 1e30, 999: -1e25}
    path = tmp_path / "t.csv"
    pacsv.write_csv(_table(n, 1, absurd), path)
    manifest = run_tabular_etl([str(path)], SPEC, dataset_path=str(tmp_path / "ds"),
                               dead_letters_path=str(tmp_path / "dead.jsonl"), options=pipeline_options("batch"))
    dead = [json.loads(line) for line in open(tmp_path / "dead.jsonl")]
    assert {d["source"] for d in dead} == {f"{path}:{i + 2}" for i in absurd}, dead  # CSV line = row + 2
    assert all(d["reason"].startswith("label 'y' is out of range: a magnitude of") for d in dead)
    assert manifest["counts"]["out"] == n - 2 and manifest["counts"]["dead_letters"] == 2
    stats = manifest["stats"]
    assert 45 < stats["label_mean"] < 55 and 8 < stats["label_std"] < 12, stats  # not ~1e28
    assert stats["label_max_abs"] > 0


def test_an_absurd_regression_label_is_a_dead_letter_in_the_stream_feature_code():
    train = _table(400, 2, {})
    acc = StatsAccumulator()
    for batch in train.to_batches():
        acc.add(batch, SPEC)
    stats = acc.finalize(SPEC)
    events = pa.RecordBatch.from_pydict({"x": [0.1, 0.2, 0.3], "c": ["a", "b", "a"], "y": [49.0, 1e30, 51.0],
                                         "_source_file": ["e", "e", "e"], "_source_row": [0, 1, 2]})
    features, letters = featurize_rows(events, SPEC, stats)
    assert features.num_rows == 2 and len(letters) == 1
    assert letters[0].reason.startswith("label 'y' is out of range") and letters[0].payload["y"] == 1e30

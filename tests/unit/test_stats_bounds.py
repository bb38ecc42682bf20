"""ETL statistics hold bounded memory (#22 item 13): a categorical column's counter becomes a
heavy-hitters summary past its capacity; a label with too many classes stops the ETL at once."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pytest

from connectors.dataset_spec import FeatureSpec
from flowtrain.local.runners import pipeline_options
from pipelines.tabular.features import SchemaError, StatsAccumulator

pytestmark = pytest.mark.timeout(300)


def _batch(cats, ys) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict({"x": np.ones(len(ys)), "c": cats, "y": ys})


def test_an_id_like_categorical_column_keeps_a_bounded_counter_and_its_heavy_hitters():
    spec = FeatureSpec(label="y", task="regression", numeric=["x"], categorical=["c"], max_vocab=100)
    capacity = 4 * spec.max_vocab  # VOCAB_SKETCH_FACTOR x max_vocab (checked below)
    parts = [StatsAccumulator(), StatsAccumulator()]
    largest = 0
    for i in range(60):  # 60 x 1,000 rows: 30,000 ids seen once, plus three frequent values
        ids = [f"id-{i}-{j}" for j in range(500)]
        frequent = ["hot"] * 300 + ["warm"] * 150 + ["mild"] * 50
        acc = parts[i % 2]
        acc.add(_batch(ids + frequent, [0.0] * 1000), spec)
        largest = max(largest, len(acc.values["c"]))
    merged = parts[0].merge(parts[1])
    assert largest <= 2 * capacity and len(merged.values["c"]) <= 2 * capacity  # not 30,000
    from connectors.dataset_spec import VOCAB_SKETCH_FACTOR

    assert capacity == VOCAB_SKETCH_FACTOR * spec.max_vocab
    stats = merged.finalize(spec)
    assert stats["vocab"]["c"][:3] == ["hot", "warm", "mild"] and len(stats["vocab"]["c"]) <= spec.max_vocab
    error = stats["vocab_count_error"]["c"]
    assert 0 < error <= 60_000 // (capacity + 1) + 1  # Misra-Gries: undercount at most rows / (capacity + 1)
    assert merged.values["c"]["hot"] >= 18_000 - error  # the frequent values' counts stay within the bound


def test_a_column_with_fewer_values_than_the_capacity_is_counted_exactly():
    spec = FeatureSpec(label="y", task="regression", numeric=["x"], categorical=["c"], max_vocab=100)
    acc = StatsAccumulator()
    for _ in range(5):
        acc.add(_batch([f"v{j % 250}" for j in range(1000)], [0.0] * 1000), spec)
    stats = acc.finalize(spec)
    assert stats["vocab_count_error"]["c"] == 0 and len(acc.values["c"]) == 250 and acc.values["c"]["v0"] == 20


def test_too_many_classes_stop_the_statistics_as_soon_as_the_limit_is_passed():
    spec = FeatureSpec(label="y", task="classification", numeric=["x"])
    acc = StatsAccumulator()
    with pytest.raises(SchemaError, match=r"label column 'y' has more than 1,000 distinct values .* "
                                          r"pass --task regression, or --positive-above T"):
        for i in range(100):  # 100 batches of 100 new values: would be 10,000 classes
            acc.add(_batch(["a"] * 100, [f"{i * 100 + j}.5" for j in range(100)]), spec)
    from connectors.dataset_spec import MAX_CLASSES

    assert MAX_CLASSES == 1000 and len(acc.label_counts) <= MAX_CLASSES + 100  # stopped at the passing batch


def test_the_etl_of_a_numeric_label_declared_as_classes_stops_naming_the_label(tmp_path):
    from pipelines.tabular.pipeline import run_tabular_etl

    rng = np.random.default_rng(0)
    n = 4000
    table = pa.table({"x": rng.normal(size=n), "price": rng.uniform(0, 1000, n).round(3)})
    pacsv.write_csv(table, tmp_path / "t.csv")
    with pytest.raises(SchemaError, match="label column 'price' has more than 1,000 distinct values"):
        run_tabular_etl([str(tmp_path / "t.csv")], FeatureSpec(label="price", task="classification", numeric=["x"]),
                        dataset_path=str(tmp_path / "ds"), dead_letters_path=str(tmp_path / "dead.jsonl"),
                        options=pipeline_options("batch"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.csv"]  # no dataset, no temporaries

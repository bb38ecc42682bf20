"""ETL statistics hold bounded memory (#22 item 13): a categorical column's counter becomes a
heavy-hitters summary past its capacity; a label with too many classes stops the ETL at once."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pytest

from connectors.dataset_spec import FeatureSpec
from flowtrain.local.runners import pipeline_options
from pipelines.tabular.schema import SchemaError
from pipelines.tabular.stats import StatsAccumulator

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


# --- numeric ranges (issue 28 item 12) -------------------------------------------------------------------
def _outlier_etl(tmp_path, **spec_kw):
    """An ETL of y = x / 10 + c with x ~ N(10, 3) over 2,000 rows, four of them absurd (|x| >= 1e25)."""
    import json

    from pipelines.tabular.pipeline import run_tabular_etl

    rng = np.random.default_rng(1)
    n = 2000
    x = rng.normal(10, 3, n)
    absurd = {17: 1e30, 400: -1e25, 999: 1e30, 1500: 3e38}
    for i, v in absurd.items():
        x[i] = v
    table = pa.table({"x": x, "c": rng.choice(["a", "b"], n), "y": rng.normal(size=n)})
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "t.csv"
    pacsv.write_csv(table, path)
    spec = FeatureSpec(label="y", task="regression", numeric=["x"], categorical=["c"], **spec_kw)
    manifest = run_tabular_etl([str(path)], spec, dataset_path=str(tmp_path / "ds"),
                               dead_letters_path=str(tmp_path / "dead.jsonl"), options=pipeline_options("batch"))
    dead = [json.loads(line) for line in open(tmp_path / "dead.jsonl")]
    return manifest, dead, {f"{path}:{i + 2}" for i in absurd}  # CSV line = row + 2 (the header is line 1)


def test_an_absurd_feature_value_in_batch_training_data_is_a_dead_letter_and_left_out_of_the_statistics(tmp_path):
    """Issue 28 item 12: x = 1e30 (and -1e25, 3e38: finite) was trained on and made the column's std ~1e28,
    so every ordinary x standardized to ~0. Now each is a dead letter naming the column and the way out, the
    mean and std are the ordinary rows', and the bound is in the manifest for the stream and predict."""
    manifest, dead, absurd = _outlier_etl(tmp_path)
    assert {d["source"] for d in dead} == absurd, dead
    assert all(d["reason"].startswith("numeric feature 'x' is out of range") and "--numeric-range x=LO:HI" in
               d["reason"] for d in dead)
    assert manifest["counts"]["in"] == 2000 and manifest["counts"]["out"] == 1996
    x = manifest["stats"]["numeric"]["x"]
    assert 9 < x["mean"] < 11 and 2.5 < x["std"] < 3.5, x
    assert 1e6 < x["max_abs"] < 1e9  # 2**20 times the 99th percentile's power of two: ~2**25


def test_a_declared_numeric_range_rejects_or_clips_what_lies_outside(tmp_path):
    manifest, dead, absurd = _outlier_etl(tmp_path / "reject", numeric_range={"x": [-5, 25]})
    outside = {d["source"] for d in dead}
    assert absurd <= outside and all(d["reason"] == "numeric feature 'x' is outside its declared range [-5, 25] "
                                                    "(--numeric-range)" for d in dead)
    assert manifest["spec"]["numeric_range"] == {"x": [-5.0, 25.0]} and "max_abs" not in manifest["stats"]["numeric"]["x"]
    manifest, dead, _ = _outlier_etl(tmp_path / "clip", numeric_range={"x": [-5, 25]}, clip_numeric=True)
    assert dead == [] and manifest["counts"]["out"] == 2000
    from flowtrain.train.loader import TabularDataset

    data = TabularDataset(tmp_path / "clip" / "ds")
    s = manifest["stats"]["numeric"]["x"]
    largest = max(float(data.split(split).x_num[:, 0].max()) for split in ("train", "valid", "test"))
    assert abs(largest - (25 - s["mean"]) / s["std"]) < 1e-4  # 1e30 became 25
    with pytest.raises(ValueError, match="'z' is not a declared numeric column"):
        FeatureSpec(label="y", numeric=["x"], numeric_range={"z": [0, 1]})


def test_an_absurd_feature_value_is_a_dead_letter_in_the_stream_in_predict_and_for_the_trainer(tmp_path):
    """The same bound in the stream pipeline's feature code, predict's, and the online trainer's input check."""
    import json

    from connectors.dataset import read_manifest
    from flowtrain.train.loader import TabularDataset
    from flowtrain.train.stream.input import BadFeatureMessage, FeatureMessageCheck
    from pipelines.predict.rows import featurize_for_prediction
    from pipelines.stream.featurize import StreamFeaturizer

    _outlier_etl(tmp_path)
    manifest = read_manifest(tmp_path / "ds")
    events = [{"x": 12.5, "c": "a", "y": 0.3}, {"x": 5e12, "c": "b", "y": 0.1}, {"x": -9e15, "c": "a"}]  # < 2**53
    out = StreamFeaturizer.from_manifest(manifest).featurize_payloads(
        [json.dumps(e).encode() for e in events], [("raw", 0, i) for i in range(3)])
    assert out.features.num_rows == 1 and [d.source for d in out.dead_letters] == ["raw/0/1", "raw/0/2"]
    assert all("numeric feature 'x' is out of range" in d.reason for d in out.dead_letters)

    from connectors.dataset_spec import FeatureSpec as Spec

    rows = pa.RecordBatch.from_pydict({"x": [12.5, 1e30, 3.0], "c": ["a", "b", "b"]})
    inputs, letters = featurize_for_prediction(rows, Spec.from_dict(manifest["spec"]), manifest["stats"])
    assert inputs is not None and [d.reason.startswith("numeric feature 'x' is out of range") for d in letters] == [True]

    check = FeatureMessageCheck(TabularDataset(tmp_path / "ds"))
    s = manifest["stats"]["numeric"]["x"]
    from connectors.arrow import encode_batch

    def message(z):
        return encode_batch(pa.record_batch({"num__x": pa.array(z, pa.float32()), "cat__c": pa.array([1, 2], pa.int32()),
                                             "label": pa.array([0.0, 1.0], pa.float32()),
                                             "src_partition": pa.array([0, 0], pa.int32()),
                                             "src_offset": pa.array([0, 1], pa.int64())}))
    assert len(check(message([0.5, (s["max_abs"] * 0.99 - s["mean"]) / s["std"]]))) == 2
    with pytest.raises(BadFeatureMessage, match="'num__x' has .* at row 1, outside") as err:
        check(message([0.5, (1e30 - s["mean"]) / s["std"]]))
    assert err.value.kind == "values"

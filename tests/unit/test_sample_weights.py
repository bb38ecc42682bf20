"""Issue 45 item 7 (sample weights): --weight-column COL weighs each row's loss by its own weight (a weighted mean:
the loader divides the weights by their training mean), alone, with --class-weight and over an ensemble's members;
the map/reduce sum stays a sum over rows (N workers equal one); the ETL's checks make a bad weight a dead letter;
the weighted metrics are what they say."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch
from torch import nn

from connectors.dataset_spec import WEIGHT, FeatureSpec
from flowtrain.train.class_weights import weighted_metrics
from flowtrain.train.loader import table_to_split, weight_mean
from flowtrain.train.trainer import loss_function
from pipelines.tabular.checks import split_valid
from pipelines.tabular.stats import StatsAccumulator


def _per_row(task, outputs, out, y):
    if task == "regression":
        return (out - y) ** 2
    if outputs > 1:
        return nn.functional.cross_entropy(out, y.long(), reduction="none")
    return nn.functional.binary_cross_entropy_with_logits(out, y, reduction="none")


@pytest.mark.parametrize("task, outputs", [("regression", 1), ("classification", 1), ("classification", 3)])
def test_the_sample_weighted_loss_is_the_sum_of_each_rows_loss_times_its_weight(task, outputs):
    g = torch.Generator().manual_seed(0)
    n = 64
    out = torch.randn(n, generator=g) if outputs == 1 else torch.randn(n, outputs, generator=g)
    y = torch.randn(n, generator=g) if task == "regression" else \
        torch.randint(0, max(outputs, 2), (n,), generator=g).float()
    w = torch.rand(n, generator=g) * 3
    w[:10] = 0.0
    fn = loss_function(task, outputs, sample_weights=True)
    per = _per_row(task, outputs, out, y)
    assert fn.reduction == "sum"
    target = torch.stack([y, w], dim=1)  # what Trainer.step gives the engine: (label, weight) per row
    torch.testing.assert_close(fn(out, target), (per * w).sum())
    # a weight-0 row has no say: the loss (and its gradient) equal the loss of the other rows alone
    torch.testing.assert_close(fn(out, target), fn(out[10:], target[10:]))
    # shards sum to the whole (the map/reduce engines reduce sums and row counts)
    torch.testing.assert_close(fn(out[:20], target[:20]) + fn(out[20:], target[20:]), fn(out, target))
    # all weights 1: the unweighted loss, summed
    torch.testing.assert_close(fn(out, torch.stack([y, torch.ones(n)], dim=1)), per.sum())
    if task == "classification":  # with --class-weight: the product of both weights
        cw = torch.tensor([0.5, 4.0] if outputs == 1 else [0.5, 4.0, 1.5])
        both = loss_function(task, outputs, cw, sample_weights=True)
        torch.testing.assert_close(both(out, target), (per * w * cw[y.long()]).sum())


def test_an_ensembles_members_share_each_rows_weight():
    g = torch.Generator().manual_seed(1)
    n, members = 16, 4
    out = torch.randn(n, members, generator=g)  # [N, M]: one output per member, as an ensemble trains
    y = torch.randint(0, 2, (n,), generator=g).float()
    w = torch.rand(n, generator=g)
    fn = loss_function("classification", 1, sample_weights=True)
    per = torch.stack([_per_row("classification", 1, out[:, m], y) for m in range(members)], dim=1)
    torch.testing.assert_close(fn(out, torch.stack([y, w], dim=1)), (per * w[:, None]).sum() / members)


def test_weights_are_divided_by_their_training_mean_and_carried_by_a_split():
    spec = FeatureSpec(label="y", numeric=["x"], weight_column="w")
    table = pa.table({"num__x": pa.array([0.0, 1.0, 2.0], pa.float32()), "label": pa.array([0.0, 1.0, 0.0], pa.float32()),
                      WEIGHT: pa.array([0.0, 2.0, 4.0], pa.float32())})
    stats = {"weight_mean": 2.0}
    split = table_to_split(table, spec, weight_mean(spec, stats))
    torch.testing.assert_close(split.w, torch.tensor([0.0, 1.0, 2.0]))
    assert split.take(torch.tensor([2, 0])).w.tolist() == [2.0, 0.0]
    with pytest.raises(ValueError, match="--weight-column 'w': the training split weighs nothing"):
        weight_mean(spec, {"weight_mean": 0.0})
    assert weight_mean(FeatureSpec(label="y", numeric=["x"]), {}) is None


def test_a_bad_weight_is_a_dead_letter_and_the_statistics_sum_the_good_ones():
    spec = FeatureSpec(label="y", numeric=["x"], weight_column="w")
    assert "w" in spec.input_columns and "w" not in spec.all_numeric
    batch = pa.RecordBatch.from_pydict({
        "x": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], "y": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
        "w": [1.0, 0.0, -1.0, float("nan"), None, float("inf")],
        "_source_file": ["t.csv"] * 6, "_source_row": list(range(6))})
    good, letters = split_valid(batch, spec)
    assert good.column("w").to_pylist() == [1.0, 0.0]
    assert len(letters) == 4 and all(letter.reason.startswith("weight column 'w' is missing, not a finite number "
                                                              "or negative") for letter in letters)
    stats = StatsAccumulator().add(good, spec).finalize(spec)
    assert stats["weight_sum"] == 1.0 and stats["weight_mean"] == 0.5
    with pytest.raises(ValueError, match="declared twice"):
        FeatureSpec(label="y", numeric=["x", "w"], weight_column="w")


def test_weighted_metrics_of_a_regression_and_of_a_weighted_classifier():
    out, y = torch.tensor([1.0, 2.0, 10.0]), torch.tensor([1.0, 1.0, 0.0])
    w = torch.tensor([1.0, 1.0, 0.0])  # the outlier weighs nothing
    m = weighted_metrics(out, y, None, w, regression=True)
    assert m["weighted_rmse"] == pytest.approx(np.sqrt(0.5)) and m["weighted_mae"] == pytest.approx(0.5)
    logits = torch.tensor([3.0, -3.0, 3.0])
    m = weighted_metrics(logits, y, None, w)
    assert m["weighted_accuracy"] == pytest.approx(0.5)  # the wrong third row weighs 0
    assert weighted_metrics(out, y, None, None, regression=True) == {}


@pytest.fixture(scope="module")
def weighted_dataset(tmp_path_factory):
    """A small dataset made by the real batch ETL with --weight-column w (weights 1 and 3: mean 2)."""
    import pyarrow.csv as pacsv

    from flowtrain.local.runners import pipeline_options
    from pipelines.tabular.pipeline import run_tabular_etl

    base = tmp_path_factory.mktemp("weighted")
    n = 200
    x = np.linspace(-3, 3, n)
    pacsv.write_csv(pa.table({"x": x, "y": (x > 0).astype(np.int64), "w": np.where(np.arange(n) % 2, 3.0, 1.0)}),
                    base / "t.csv")
    spec = FeatureSpec(label="y", task="classification", numeric=["x"], weight_column="w")
    manifest = run_tabular_etl([str(base / "t.csv")], spec, dataset_path=str(base / "ds"), dead_letters_path=None,
                               options=pipeline_options("batch"))
    return str(base / "ds"), manifest


def test_events_carry_their_weight_to_the_online_trainer(weighted_dataset):
    """The stream: a labelled event's weight is checked as the batch ETL checks it (its dead letter's reason), an
    unlabelled event needs none; the features messages carry the weight and the online trainer's message check
    turns it into the rows' weights, divided by the training split's mean weight."""
    import json

    from connectors.arrow import encode_batch
    from flowtrain.train.loader import TabularDataset
    from flowtrain.train.stream.input import BadFeatureMessage, FeatureMessageCheck
    from pipelines.stream.featurize import StreamFeaturizer

    ds, manifest = weighted_dataset
    assert manifest["stats"]["weight_mean"] == pytest.approx(manifest["stats"]["weight_sum"]
                                                             / manifest["stats"]["train_rows"])
    events = [{"x": 1.0, "y": 1, "w": 2.5}, {"x": -1.0, "y": 0}, {"x": 0.5, "y": 1, "w": -1}, {"x": 0.2},
              {"x": -0.3, "y": 0, "w": 0}]
    payloads = [json.dumps(e).encode() for e in events]
    out = StreamFeaturizer.from_manifest(manifest).featurize_payloads(payloads, [("raw", 0, i) for i in range(5)])
    assert [d.source for d in out.dead_letters] == ["raw/0/1", "raw/0/2"]
    assert all(d.reason.startswith("weight column 'w' is missing, not a finite number or negative")
               for d in out.dead_letters)
    assert out.unlabelled == 1 and int(out.trainable.sum()) == 2  # events 3 (no label, no weight) and 0, 4
    training = out.training()
    assert training.column(WEIGHT).to_pylist() == [2.5, 0.0]
    data = TabularDataset(ds)
    rows = FeatureMessageCheck(data)(encode_batch(pa.Table.from_batches([training])))
    torch.testing.assert_close(rows.split.w, torch.tensor([2.5, 0.0]) / data.weight_mean)
    with pytest.raises(BadFeatureMessage, match="missing column\\(s\\) 'weight'"):
        FeatureMessageCheck(data)(encode_batch(pa.Table.from_batches([training]).drop_columns([WEIGHT])))
    negative = pa.Table.from_batches([training]).set_column(training.schema.get_field_index(WEIGHT), WEIGHT,
                                                            pa.array([1.0, -2.0], pa.float32()))
    with pytest.raises(BadFeatureMessage, match="not a sample weight"):
        FeatureMessageCheck(data)(encode_batch(negative))


def test_a_streamed_split_carries_each_rows_weight_with_the_row(weighted_dataset):
    """A split over --memory-budget (streamed from its shards through the shuffle buffer) hands out each row with its
    own weight, as the split held in memory does."""
    from flowtrain.train.loader import TabularDataset
    from flowtrain.train.shards import StreamedSplit, StreamPlan

    ds, _ = weighted_dataset
    data = TabularDataset(ds)
    whole = data.split("train")
    pairs = sorted(zip(whole.x_num[:, 0].tolist(), whole.w.tolist()))
    assert sorted({w for _, w in pairs}) == pytest.approx([1 / data.weight_mean, 3 / data.weight_mean])
    streamed = StreamedSplit(data, "train", plan=StreamPlan(buffer_rows=40, chunk_rows=16))
    torch.testing.assert_close(streamed.w, whole.w)  # the evaluation's weights, in shard order
    for shuffle in (True, False):
        batches = list(streamed.batches(batch_size=7, seed=3, epoch=1, shuffle=shuffle))
        got = sorted((x, w) for b in batches for x, w in zip(b.x_num[:, 0].tolist(), b.w.tolist()))
        assert got == pairs


def test_inferred_feature_types_leave_the_weight_column_out(tmp_path):
    """Without --numeric/--categorical the features are inferred: the weight column is never one of them, and a
    weight column the file lacks is refused naming it and listing the file's columns."""
    import pyarrow.csv as pacsv

    from flowtrain.commands.batch.etl import spec_from
    from flowtrain.commands.batch.job import BatchJob
    from pipelines.tabular.infer import infer_columns
    from pipelines.tabular.schema import SchemaError

    n = 100
    pacsv.write_csv(pa.table({"x": np.linspace(0, 1, n), "w": np.linspace(1, 2, n), "y": np.arange(n) % 2}),
                    tmp_path / "t.csv")
    inferred = infer_columns([str(tmp_path / "t.csv")], "y", weight_column="w")
    assert inferred.numeric == ["x"] and "w" not in inferred.left_out
    _, spec = spec_from(BatchJob(input=(str(tmp_path / "t.csv"),), label="y", weight_column="w"), inferred)
    assert spec.weight_column == "w" and spec.numeric == ["x"]
    with pytest.raises(SchemaError, match="--weight-column weight: no such column in .*; it has x, w, y"):
        infer_columns([str(tmp_path / "t.csv")], "y", weight_column="weight")


def test_a_training_split_that_weighs_nothing_stops_the_run_naming_the_column():
    from pipelines.tabular.preflight import SplitError, check_splits

    manifest = {"rows": {"train": 80, "valid": 10, "test": 10}, "spec": {"weight_column": "w"},
                "stats": {"train_rows": 80, "weight_sum": 0.0, "weight_mean": 0.0}}
    with pytest.raises(SplitError, match="--weight-column 'w': every training row weighs 0 \\(80 rows\\)"):
        check_splits(manifest)
    check_splits({**manifest, "stats": {"train_rows": 80, "weight_sum": 0.5, "weight_mean": 0.5 / 80}})
    check_splits({**manifest, "spec": {}})  # no weight column: nothing to weigh

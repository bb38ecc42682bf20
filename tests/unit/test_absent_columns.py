"""Issue 45 item 2: a column the model can do without (an optional numeric, a categorical, an ID column that is not
required) may be absent from the input: read as missing; the ones it cannot do without are refused, naming them,
and the message says "input" for rows given in Python. In events such fields are optional too."""
from __future__ import annotations

import json

import pyarrow as pa
import pytest

from connectors.dataset_spec import FeatureSpec
from pipelines.predict.rows import absent_line, check_columns, feature_columns, optional_columns, required_columns
from pipelines.stream.featurize import StreamFeaturizer
from pipelines.tabular.schema import SchemaError

SPEC = FeatureSpec(label="y", task="classification", numeric=["x"], optional_numeric=["age"], categorical=["city"],
                   id_columns=["user", "device"], required_ids=["user"])


def test_required_and_optional_columns():
    assert required_columns(SPEC) == ["x", "user"]
    assert optional_columns(SPEC) == ["age", "city", "device"]
    assert feature_columns(SPEC) == ["x", "age", "city", "user", "device"]
    assert check_columns(["x", "user", "y"], SPEC, "new.csv") == ["age", "city", "device"]
    assert check_columns(["x", "user", "age", "city", "device"], SPEC, "new.csv") == []


def test_a_column_it_cannot_do_without_is_refused_naming_it_and_the_input():
    with pytest.raises(SchemaError, match=r"^new.csv: missing column\(s\) x that the model needs .*the file has "
                                          r"user, age$"):
        check_columns(["user", "age"], SPEC, "new.csv")
    with pytest.raises(SchemaError, match=r"the input has x$"):
        check_columns(["x"], SPEC, "predict(rows)", what="input")
    with pytest.raises(SchemaError, match=r"no column id \(--id-column / --keep-columns\)"):
        check_columns(["x", "user"], SPEC, "new.csv", extra=["id"])


def test_the_line_said_once():
    assert absent_line({"age": 50, "city": 50}, "new.csv") == (
        "age, city absent from new.csv: read as missing in its 50 row(s) (the model learned with missing values there)")


def test_events_without_the_optional_fields_are_featurized_not_dead_letters():
    spec = FeatureSpec(label="y", task="classification", numeric=["x"], optional_numeric=["age"],
                       categorical=["city"])
    stats = {"numeric": {"x": {"mean": 0.0, "std": 1.0}, "age": {"mean": 40.0, "std": 10.0}},
             "vocab": {"city": ["a", "b"]}, "classes": ["no", "yes"]}
    out = StreamFeaturizer(spec, stats).featurize_payloads([json.dumps({"x": 1.0}).encode()], [("raw", 0, 1)])
    assert out.dead_letters == [] and out.features.num_rows == 1
    row = out.features.to_pylist()[0]
    assert row["num__age"] == 0.0 and row["cat__city"] == 0  # the training mean, the out-of-vocabulary code
    assert isinstance(out.features, pa.RecordBatch)

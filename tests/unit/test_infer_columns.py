"""Issue 45 item 1: with no --numeric/--categorical, the feature columns are inferred from the files' first rows
(read by the ETL's own readers): numbers, text with few values, the time column; IDs suggested; constant and
empty columns left out; --exclude drops; declared --id-columns / --time-column override; a wrong column's message
lists the file's columns."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from flowtrain.commands.batch.etl import spec_from
from flowtrain.commands.batch.job import BatchJob
from pipelines.tabular.infer import infer_columns
from pipelines.tabular.schema import SchemaError


def _customers(n: int = 600) -> pa.Table:
    r = np.random.default_rng(0)
    return pa.table({
        "customer_id": [f"cust-{i:05d}" for i in range(n)],
        "row": np.arange(n),  # an integer per row: an ID, not a number to learn from
        "x1": r.normal(size=n).round(4),
        "visits": r.integers(0, 9, size=n),
        "age": [None if i % 7 == 0 else float(20 + i % 50) for i in range(n)],
        "city": np.array(list("abcd"))[r.integers(4, size=n)],
        "vip": r.integers(0, 2, size=n).astype(bool),
        "signup": [f"2024-{1 + i % 12:02d}-{1 + i % 28:02d}" for i in range(n)],
        "last_seen": [f"2024/{1 + i % 12:02d}/{1 + i % 28:02d}" for i in range(n)],
        "const": ["k"] * n,
        "empty": pa.nulls(n, pa.string()),
        "status": np.where(r.normal(size=n) > 0, "yes", "no"),
    })


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    base = tmp_path_factory.mktemp("infer")
    table = _customers()
    pacsv.write_csv(table, base / "c.csv")
    pq.write_table(table, base / "c.parquet")
    return base


@pytest.mark.parametrize("name", ["c.csv", "c.parquet"])
def test_roles_inferred_from_the_first_rows(files, name):
    got = infer_columns([str(files / name)], "status")
    assert got.numeric == ["x1", "visits"] and got.optional_numeric == ["age"]
    assert got.categorical == ["city", "vip"] and got.time_column == "signup"
    assert got.id_suggested == ["customer_id", "row"]
    assert list(got.left_out) == ["customer_id", "row", "last_seen", "const", "empty"]
    assert "a time column; the rows split by signup" in got.left_out["last_seen"]
    assert got.left_out["const"].startswith("constant") and got.left_out["empty"] == "no value in the sample"
    assert got.rows == 600
    text = got.describe()
    assert "numeric x1, visits; numeric with missing values (optional) age; categorical city, vip" in text
    assert "--id-columns customer_id,row" in text
    assert ("--numeric x1,visits --optional-numeric age --categorical city,vip --time-column signup" in text)
    assert infer_columns([str(files / name)], "status") == got  # deterministic


def test_exclude_and_declared_columns_override(files):
    got = infer_columns([str(files / "c.csv")], "status", exclude=["x1", "signup"], id_columns=["customer_id"],
                        time_column="last_seen")
    assert got.numeric == ["visits"] and got.time_column == "last_seen"
    assert "customer_id" not in got.left_out and "x1" not in got.left_out and "signup" not in got.left_out
    assert got.id_suggested == ["row"]


@pytest.mark.parametrize("kwargs, start", [({"exclude": ["cty"]}, "--exclude cty: no such column in {path}"),
                                           ({"id_columns": ["customer"]}, "--id-columns customer: no such column in "
                                                                          "{path}"),
                                           ({"time_column": "when"}, "--time-column when: no such column in {path}"),
                                           ({}, "--label 'statu' is not a column of {path} (did you mean 'status'?)")])
def test_a_wrong_column_lists_the_files_columns(files, kwargs, start):
    label = "statu" if not kwargs else "status"
    with pytest.raises(SchemaError) as err:
        infer_columns([str(files / "c.csv")], label, **kwargs)
    message = str(err.value)
    assert message.startswith(start.format(path=files / "c.csv")), message
    assert "it has customer_id, row, x1, visits, age, city, vip, signup, last_seen, const, empty, status" in message


def test_nothing_to_infer_says_so_and_what_to_declare(tmp_path):
    pacsv.write_csv(pa.table({"id": [f"u{i}" for i in range(100)], "k": ["same"] * 100, "y": [1.0, 2.0] * 50}),
                    tmp_path / "t.csv")
    with pytest.raises(SchemaError, match=r"no feature column could be inferred .*id: text with 100 different.*"
                                          r"declare them with --numeric / --categorical"):
        infer_columns([str(tmp_path / "t.csv")], "y")


def test_the_spec_takes_the_inferred_columns_only_when_none_are_declared(files):
    inferred = infer_columns([str(files / "c.csv")], "status")
    _, spec = spec_from(BatchJob(input=(str(files / "c.csv"),), label="status"), inferred)
    assert (spec.numeric, spec.optional_numeric, spec.categorical, spec.time_column) == (
        ["x1", "visits"], ["age"], ["city", "vip"], "signup")
    _, spec = spec_from(BatchJob(input=(str(files / "c.csv"),), label="status", numeric=("x1",)), inferred)
    assert (spec.numeric, spec.optional_numeric, spec.categorical, spec.time_column) == (["x1"], [], [], None)
    with pytest.raises(Exception, match="--exclude drops columns from the inferred features"):
        spec_from(BatchJob(input=(str(files / "c.csv"),), label="status", numeric=("x1",), exclude=("age",)))

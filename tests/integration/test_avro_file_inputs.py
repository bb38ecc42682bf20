"""Avro object container files as inputs of ``flowtrain batch`` and ``flowtrain predict`` (issue 33, item 1): a
table written as .avro gives the same dataset and the same predictions as the same table as Parquet; a record
that fails the dataset's checks is a dead letter, as for Parquet; a corrupt file is a one-line error naming it."""
from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import fastavro
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import flowtrain
from flowtrain.cli.main import main
from flowtrain.errors import FlowtrainError

pytestmark = pytest.mark.timeout(400)

AVRO_SCHEMA = {"type": "record", "name": "Row", "fields": [
    {"name": "id", "type": "long"},
    {"name": "x1", "type": ["null", "double"]},
    {"name": "x2", "type": ["null", "double"]},  # one infinite value: its row's dead letter
    {"name": "c", "type": ["null", {"type": "enum", "name": "Letter", "symbols": ["a", "b", "c", "d", "zz"]}]},
    {"name": "t", "type": {"type": "long", "logicalType": "timestamp-millis"}},
    {"name": "y", "type": "long"}]}
ARROW_SCHEMA = pa.schema([("id", pa.int64()), ("x1", pa.float64()), ("x2", pa.float64()), ("c", pa.string()),
                          ("t", pa.timestamp("ms", tz="UTC")), ("y", pa.int64())])
OPTIONS = {"label": "y", "numeric": ["x1", "x2"], "categorical": ["c"], "task": "classification", "steps": 30,
           "no_progress": True, "threads": 1, "hidden": [8], "seed": 3, "time_column": "t",
           "valid_from": "2024-01-15", "test_from": "2024-01-22"}


def _rows(n: int, seed: int, *, bad_row: int = -1) -> list[dict]:
    r = np.random.default_rng(seed)
    start = dt.datetime(2024, 1, 1, tzinfo=dt.timezone.utc)
    rows = []
    for i in range(n):
        x1, x2 = float(r.normal()), float(r.normal())
        c = "zz" if i % 7 == 0 else "abcd"[r.integers(4)]
        rows.append({"id": i, "x1": round(x1, 4), "x2": float("inf") if i == bad_row else round(x2, 4),
                     "c": c, "t": start + dt.timedelta(minutes=15 * i),
                     "y": int(x1 + 0.5 * x2 + (c == "a") + r.normal() * 0.5 > 0.3)})
    return rows


def _both(base: Path, name: str, rows: list[dict]) -> tuple[str, str]:
    """The same table as ``name.avro`` and ``name.parquet``."""
    avro, parquet = base / f"{name}.avro", base / f"{name}.parquet"
    with open(avro, "wb") as fh:
        fastavro.writer(fh, AVRO_SCHEMA, rows, codec="deflate", sync_interval=4096)
    pq.write_table(pa.Table.from_pylist(rows, schema=ARROW_SCHEMA), parquet, row_group_size=500)
    return str(avro), str(parquet)


def _close(a, b, where: str = "stats") -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), where
        for k in a:
            _close(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{where}[{i}]")
    elif isinstance(a, float):
        assert b == pytest.approx(a, rel=1e-9, abs=1e-12), where
    else:
        assert a == b, where


def _dataset(path: Path) -> dict[str, pa.Table]:
    """Each split's rows without the source columns, in one order."""
    out = {}
    for split in ("train", "valid", "test"):
        table = pa.concat_tables([pq.read_table(f) for f in sorted((path / split).glob("*.parquet"))])
        table = table.select([c for c in table.column_names if not c.startswith("_source") and c != "source"])
        out[split] = table.sort_by([(c, "ascending") for c in table.column_names])
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("avro_inputs")
    train_avro, train_parquet = _both(base, "train", _rows(2400, 0, bad_row=11))
    new_avro, new_parquet = _both(base, "new", _rows(300, 1, bad_row=7))
    summary = flowtrain.batch(input=[train_avro], out=str(base / "run"), **OPTIONS)
    return {"base": base, "train": (train_avro, train_parquet), "new": (new_avro, new_parquet), "run": base / "run",
            "summary": summary}


def test_item1_a_table_as_avro_gives_the_same_dataset_and_predictions_as_the_same_table_as_parquet(files, tmp_path):
    from connectors.dataset import read_manifest
    from connectors.dataset_spec import FeatureSpec
    from flowtrain.local.runners import pipeline_options
    from pipelines.tabular.pipeline import run_tabular_etl

    train_avro, train_parquet = files["train"]
    run = files["run"]
    manifest = read_manifest(str(run / "dataset"))
    assert manifest["counts"]["dead_letters"] == 1  # row 11's infinite x2, as for Parquet below
    dead = [json.loads(line) for line in open(run / "dead_letters.jsonl")] if (run / "dead_letters.jsonl").exists() \
        else []
    assert not dead or dead[0]["source"] == f"{train_avro}:11"
    spec = FeatureSpec.from_dict(manifest["spec"])
    parquet_manifest = run_tabular_etl([train_parquet], spec, dataset_path=str(tmp_path / "parquet_dataset"),
                                       dead_letters_path=str(tmp_path / "parquet_dead.jsonl"),
                                       options=pipeline_options("batch"))
    assert parquet_manifest["rows"] == manifest["rows"] and parquet_manifest["counts"]["dead_letters"] == 1
    _close(parquet_manifest["stats"], manifest["stats"])  # the same sums, maybe added in another order
    from_avro, from_parquet = _dataset(run / "dataset"), _dataset(tmp_path / "parquet_dataset")
    for split in ("train", "valid", "test"):
        assert from_avro[split].equals(from_parquet[split]), split

    new_avro, new_parquet = files["new"]
    outs = {}
    for name, path in (("avro", new_avro), ("parquet", new_parquet)):
        out = tmp_path / f"pred_{name}.parquet"
        got = flowtrain.predict(model=str(run), input=[path], out=str(out), id_column="id")
        assert got["counts"] == {"in": 300, "predictions": 299, "dead_letters": 1}
        letters = [json.loads(line) for line in open(got["dead_letters"])]
        assert [d["source"] for d in letters] == [f"{path}:7"] and "x2" in letters[0]["reason"]
        outs[name] = pq.read_table(out).sort_by("id")
    assert outs["avro"].column("id").to_pylist() == outs["parquet"].column("id").to_pylist()
    np.testing.assert_allclose(outs["avro"].column("pred_probability_1").to_numpy(),
                               outs["parquet"].column("pred_probability_1").to_numpy(), atol=1e-6, rtol=0)
    assert outs["avro"].column("y").to_pylist() == outs["parquet"].column("y").to_pylist()


def test_item1_a_corrupt_avro_input_is_a_one_line_error_naming_the_file(files, tmp_path, capsys):
    good = Path(files["new"][0]).read_bytes()
    bad = tmp_path / "cut.avro"
    bad.write_bytes(good[: len(good) // 2])  # a copy cut short: the header and first blocks read, a later one not
    with pytest.raises(FlowtrainError) as err:
        flowtrain.batch(input=[str(bad)], out=str(tmp_path / "run"), **OPTIONS)
    assert str(err.value).startswith(f"{bad}: not a readable Avro object container file") and "\n" not in str(err.value)
    other = tmp_path / "other.avro"
    other.write_bytes(b"id,x1\n1,2\n")
    capsys.readouterr()
    code = main(["predict", "--model", str(files["run"]), "--input", str(other), "--out", str(tmp_path / "p.parquet")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"flowtrain predict: {other}: not an Avro object container file (it starts with "
                                 f"{b'id,x'!r}, not Avro's {b'Obj' + bytes([1])!r}); check the file, or name it after "
                                 f"its format (.parquet, .csv, .jsonl)"]

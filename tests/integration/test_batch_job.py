"""The batch main job: flights ETL, the join, splits, features, training, resume, bad input."""
from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to

from connectors.dataset import read_manifest
from connectors.deadletter import reason_kind
from connectors.files import ReadFromFiles
from flowtrain.local.paths import cache_root
from flowtrain.local.runners import pipeline_options
from pipelines.flights import features as FF
from pipelines.flights.batch import JoinReference, run_flights_etl
from pipelines.flights.nycflights import load_table
from pipelines.flights.preset import FLIGHTS
from pipelines.tabular.pipeline import build_etl

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def flights_slice(tmp_path_factory) -> dict[str, str]:
    """Every 40th flight of 2013 (8.4k rows, all months) plus the full weather and planes."""
    base = tmp_path_factory.mktemp("flights")
    tables = FLIGHTS.demo_inputs(cache_root())
    flights = pq.read_table(tables["flights"])
    sliced = flights.take(pa.array(np.arange(0, flights.num_rows, 40)))
    pq.write_table(sliced, base / "flights.parquet", row_group_size=2000)
    return {"flights": str(base / "flights.parquet"), "weather": tables["weather"], "planes": tables["planes"]}


@pytest.fixture(scope="module")
def slice_dataset(flights_slice, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("ds") / "dataset"
    run_flights_etl(dataset_path=str(out), dead_letters_path=str(out.parent / "dead.jsonl"),
                    options=pipeline_options("batch"), tables=flights_slice)
    return str(out)


def test_etl_counts_reconcile_with_assert_that(flights_slice, tmp_path):
    n_in = pq.read_metadata(flights_slice["flights"]).num_rows
    with TestPipeline(options=pipeline_options("batch")) as p:
        flights = p | ReadFromFiles(flights_slice["flights"], with_source=True)
        joined = flights | JoinReference(flights_slice["weather"], flights_slice["planes"])
        manifest = build_etl(joined, FF.FLIGHTS_SPEC, dataset_path=str(tmp_path / "ds"),
                             dead_letters_path=str(tmp_path / "dead.jsonl"), extra_checks=FF.impossible_values)
        counts = manifest | beam.Map(lambda m: (m["counts"]["in"], m["counts"]["out"] + m["counts"]["dead_letters"]))
        assert_that(counts, equal_to([(n_in, n_in)]))
    m = read_manifest(tmp_path / "ds")
    assert m["counts"]["dead_letters"] > 0 and sum(m["rows"].values()) == m["counts"]["out"]
    dead = [json.loads(line) for line in open(tmp_path / "dead.jsonl")]
    assert len(dead) == m["counts"]["dead_letters"]
    assert {reason_kind(d["reason"]) for d in dead} == set(m["counts"]["dead_letters_by_reason"])  # counted by kind
    assert all(d["source"].startswith(flights_slice["flights"] + ":") for d in dead)


def _flight(**kw):
    row = {"year": 2013, "month": 3, "day": 4, "hour": 9, "minute": 5, "sched_dep_time": 905, "sched_arr_time": 1130,
           "carrier": "UA", "flight": 1, "tailnum": "N14228", "origin": "EWR", "dest": "ORD", "distance": 719.0,
           "time_hour": dt.datetime(2013, 3, 4, 14, tzinfo=dt.timezone.utc), "arr_delay": 30.0}
    row.update(kw)
    return row


def test_join_keeps_flights_without_weather_or_plane():
    weather = FF.prepare_weather(load_table("weather"))
    planes = FF.prepare_planes(load_table("planes"))
    rows = [_flight(), _flight(tailnum="NOSUCH"), _flight(time_hour=dt.datetime(2014, 6, 1, 0, tzinfo=dt.timezone.utc))]
    flights = pa.Table.from_pylist(rows, schema=load_table("flights").select(list(rows[0])).schema)
    with TestPipeline(options=pipeline_options("batch")) as p:
        w = p | "w" >> beam.Create([weather]) | "wt" >> beam.Map(lambda t: t)
        joined = (p | beam.Create([flights.to_batches()[0]])
                  | beam.FlatMap(lambda b, w_, p_: FF.join_reference(b, w_, p_).to_batches(),
                                 beam.pvalue.AsSingleton(w), planes)
                  | beam.FlatMap(lambda b: b.select(["tailnum", "temp", "seats", "manufacturer"]).to_pylist()))
        temp = float(weather.filter(pa.compute.and_(
            pa.compute.equal(weather["origin"], "EWR"),
            pa.compute.equal(weather["time_hour"], pa.scalar(rows[0]["time_hour"], pa.timestamp("s", tz="UTC")))))["temp"][0].as_py())
        seats = float(planes.filter(pa.compute.equal(planes["tailnum"], "N14228"))["seats"][0].as_py())
        assert_that(joined, equal_to([
            {"tailnum": "N14228", "temp": temp, "seats": seats, "manufacturer": "BOEING"},
            {"tailnum": "NOSUCH", "temp": temp, "seats": None, "manufacturer": None},
            {"tailnum": "N14228", "temp": None, "seats": seats, "manufacturer": "BOEING"}]))


def test_no_test_period_row_in_training_split(slice_dataset, flights_slice):
    manifest = read_manifest(slice_dataset)
    flights = pq.read_table(flights_slice["flights"])
    times = flights["time_hour"].cast(pa.int64()).to_numpy() / 1000.0  # ms -> s
    valid_from = dt.datetime(2013, 10, 1, tzinfo=dt.timezone.utc).timestamp()
    test_from = dt.datetime(2013, 11, 1, tzinfo=dt.timezone.utc).timestamp()
    for split, (lo, hi) in {"train": (-np.inf, valid_from), "valid": (valid_from, test_from),
                            "test": (test_from, np.inf)}.items():
        rows = pa.concat_tables([pq.read_table(f"{slice_dataset}/{s['file']}", columns=["source"])
                                 for s in manifest["splits"][split]])
        idx = np.array([int(s.rsplit(":", 1)[1]) for s in rows["source"].to_pylist()])
        assert len(idx) > 0
        assert ((times[idx] >= lo) & (times[idx] < hi)).all(), split


def test_batch_features_equal_the_streaming_function(slice_dataset, flights_slice):
    manifest = read_manifest(slice_dataset)
    raw = pq.read_table(flights_slice["flights"]).slice(0, 500)
    weather = FF.prepare_weather(load_table("weather"))
    planes = FF.prepare_planes(load_table("planes"))
    streamed, letters = FF.featurize_raw(raw, weather, planes, manifest["stats"])
    streamed_rows = streamed.drop_columns(["source"]).to_pylist()
    batch = pa.concat_tables([pq.read_table(f"{slice_dataset}/{s['file']}")
                              for split in manifest["splits"].values() for s in split])
    by_row = {int(s.rsplit(":", 1)[1]): i for i, s in enumerate(batch["source"].to_pylist())}
    wanted = [by_row[r] for r in range(500) if r in by_row]
    batch_rows = batch.take(pa.array(wanted)).drop_columns(["source"]).to_pylist()
    assert len(streamed_rows) == len(batch_rows) == 500 - len(letters)
    assert streamed_rows == batch_rows


def _options(dataset, out, **kw):
    return {"dataset": dataset, "out": str(out), "no_progress": True, "epochs": 3, "patience": 10,
            "batch_size": 512, "threads": 2, **kw}


def test_short_training_lowers_loss_and_beats_mean_baseline(slice_dataset, tmp_path):
    from flowtrain import batch as run_batch

    summary = run_batch(**_options(slice_dataset, tmp_path / "run", epochs=6, lr=0.003))
    train_losses = [r["loss"] for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl"))
                    if r["kind"] == "train" and r["model"] == "model"]
    assert train_losses[-1] < train_losses[0]
    test = summary["test"]
    assert test["model"]["loss"] < test["baselines"]["majority class"]["loss"]
    assert test["model"]["auc"] > 0.6
    for name in ("report.md", "summary.json", "loss.png", "metric.png", "model.pt", "metrics.jsonl"):
        assert (tmp_path / "run" / name).exists(), name
    ckpts = sorted((tmp_path / "run" / "checkpoints").glob("ckpt-*.pt"))
    state = torch.load(ckpts[-1], weights_only=True)
    assert state["step"] == summary["training"]["steps"] and "optimizer" in state and "rng" in state


def test_resume_continues_the_same_run(slice_dataset, tmp_path):
    from flowtrain import batch as run_batch

    # the schedule spans the budget given, so runs that must share their first steps fix it (docs/batch.md)
    full = run_batch(**_options(slice_dataset, tmp_path / "full", epochs=4, decay_steps=400))
    run_batch(**_options(slice_dataset, tmp_path / "part", epochs=2, decay_steps=400))
    resumed = run_batch(**_options(slice_dataset, tmp_path / "part", epochs=4, decay_steps=400, resume=True))
    assert resumed["training"]["steps"] == full["training"]["steps"]
    read = lambda d: [r for r in map(json.loads, open(d / "metrics.jsonl")) if r["model"] == "model"]  # noqa: E731
    a, b = read(tmp_path / "full"), read(tmp_path / "part")
    assert [(r["kind"], r["step"]) for r in a] == [(r["kind"], r["step"]) for r in b]
    assert all(abs(x["loss"] - y["loss"]) < 1e-9 for x, y in zip(a, b) if x["kind"] == "valid")
    wa = torch.load(tmp_path / "full" / "model.pt", weights_only=True)
    wb = torch.load(tmp_path / "part" / "model.pt", weights_only=True)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "flowtrain.cli", "batch", "--no-progress", *args],
                          capture_output=True, text=True, timeout=240, cwd=cwd)


def test_missing_column_and_wrong_type_stop_before_training(tmp_path):
    good = tmp_path / "good.csv"
    good.write_text("x,c,y\n" + "".join(f"{i},{'ab'[i % 2]},{i * 2.0}\n" for i in range(50)))
    missing = tmp_path / "missing.csv"
    missing.write_text("x,y\n1,2\n")
    proc = _cli("--input", str(good), "--input", str(missing), "--label", "y", "--numeric", "x",
                "--categorical", "c", "--out", str(tmp_path / "r1"))
    assert proc.returncode == 2
    assert f"{missing}: missing declared column(s) c" in proc.stderr
    assert not (tmp_path / "r1" / "checkpoints").exists()
    wrong = tmp_path / "wrong.csv"
    wrong.write_text("x,c,y\nabc,a,1\ndef,b,2\n")
    proc = _cli("--input", str(wrong), "--label", "y", "--numeric", "x", "--categorical", "c",
                "--out", str(tmp_path / "r2"))
    assert proc.returncode == 2  # declared types are never inferred from the first rows (#22 item 12): every
    # row is its own dead letter, and a table of nothing but dead letters says why
    assert "no row can be used: all 2 rows are dead letters (column 'x' holds a value that is not a number (2))" \
        in proc.stderr, proc.stderr


def test_empty_input_and_single_valued_label(tmp_path):
    empty = tmp_path / "empty.csv"
    empty.write_text("x,y\n")
    proc = _cli("--input", str(empty), "--label", "y", "--numeric", "x", "--out", str(tmp_path / "r1"))
    assert proc.returncode == 2 and "the input is empty" in proc.stderr
    const = tmp_path / "const.csv"
    const.write_text("x,y\n" + "".join(f"{i},1\n" for i in range(100)))
    proc = _cli("--input", str(const), "--label", "y", "--numeric", "x", "--task", "classification",
                "--out", str(tmp_path / "r2"))
    assert proc.returncode == 2 and "has a single value" in proc.stderr


def test_generic_csv_with_bad_rows_runs_end_to_end(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=3000)
    c = rng.choice(["a", "b", "c"], size=3000)
    y = 3 * x + (c == "a") * 2 + rng.normal(scale=0.1, size=3000)
    lines = [f"{x[i]},{c[i]},{y[i]}" for i in range(3000)] + ["NA,a,1.0", "1.0,b,NA", "2.0,c,inf"]
    (tmp_path / "data.csv").write_text("x,c,y\n" + "\n".join(lines) + "\n")
    proc = _cli("--input", str(tmp_path / "data.csv"), "--label", "y", "--numeric", "x", "--categorical", "c",
                "--epochs", "4", "--batch-size", "128", "--out", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["counts"] == {**summary["counts"], "in": 3003, "out": 3000, "dead_letters": 3}
    assert summary["test"]["model"]["rmse"] < summary["test"]["baselines"]["training mean"]["rmse"] / 2
    reasons = {json.loads(line)["reason"] for line in open(tmp_path / "run" / "dead_letters.jsonl")}
    assert reasons == {"numeric feature 'x' is missing or not a finite number", "label 'y' is missing",
                       "label 'y' is not a finite number"}

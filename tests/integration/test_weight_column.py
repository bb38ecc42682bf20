"""Issue 45 item 7 (sample weights) through the real batch job (the Beam ETL, the dataset, the trainer, the report):
--weight-column changes the fit as weights should (rows of weight 0 have no say: the fit equals the fit without
them, and differs from the unweighted one), bad weights are dead letters with their reason and the counts reconcile
(in = out + dead letters), a weight column the file lacks is a one-line error naming it, and the weights are never a
feature."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pytest

import flowtrain
from flowtrain.errors import FlowtrainError

pytestmark = pytest.mark.timeout(300)
FAST_API = {"steps": 30, "hidden": [16], "threads": 1, "no_progress": True, "seed": 1}


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    """Rows of two kinds with the same features: kind A's label is yes with probability sigmoid(3x), kind B's with
    sigmoid(-3x) (the opposite rule; noisy, so a fit is a smooth curve, not a step). Weighted, A weighs
    1 and B 0 (and a few rows carry bad weights); the same A rows alone; the same rows without a weight column."""
    base = tmp_path_factory.mktemp("weights")
    r = np.random.default_rng(0)
    n = 600
    x = r.normal(size=n)
    z = r.normal(size=n)  # a second feature, noise
    kind_b = np.arange(n) % 2 == 1
    p_yes = 1 / (1 + np.exp(np.where(kind_b, 3 * x, -3 * x)))
    y = (r.random(n) < p_yes).astype(np.int64)
    w = np.where(kind_b, 0.0, 1.0).astype(object)
    bad = {7: -1.0, 21: None, 35: float("nan")}  # negative, missing, not a number: dead letters
    for i, value in bad.items():
        w[i] = value
    weighted = pa.table({"x": x, "z": z, "y": y, "w": pa.array(list(w), pa.float64())})
    pacsv.write_csv(weighted, base / "weighted.csv")
    keep = ~kind_b & ~np.isin(np.arange(n), list(bad))
    pacsv.write_csv(weighted.filter(pa.array(keep)).drop_columns(["w"]), base / "a_only.csv")
    pacsv.write_csv(weighted.drop_columns(["w"]), base / "plain.csv")
    return {"base": base, "table": weighted, "kind_b": kind_b, "bad": bad, "x": x}


@pytest.fixture(scope="module")
def runs(tables):
    base = tables["base"]
    out = {}
    for name, extra in (("weighted", {"weight_column": "w"}), ("a_only", {}), ("plain", {})):
        summary = flowtrain.batch(input=[str(base / f"{name}.csv")], label="y", numeric=["x", "z"],
                                  task="classification", out=str(base / "runs" / name), **extra, **FAST_API)
        out[name] = {"summary": summary, "dir": base / "runs" / name}
    return out


def _p_yes(run_dir, x):
    rows = pa.table({"x": x, "z": np.zeros_like(x)}).to_pandas()
    predicted = flowtrain.load(str(run_dir)).predict(rows)
    return predicted["pred_probability_1"].to_numpy()


def test_rows_of_weight_zero_have_no_say_the_fit_equals_the_fit_without_them(tables, runs):
    grid = np.linspace(-2.5, 2.5, 41)
    weighted, a_only, plain = (_p_yes(runs[k]["dir"], grid) for k in ("weighted", "a_only", "plain"))
    # the weighted fit learns kind A's rule (yes above 0), as training on kind A alone does (not to the last digit:
    # the runs split their own rows at random, and a fit's L2 penalty scales with its rows) ...
    assert (weighted[grid > 1] > 0.8).all() and (weighted[grid < -1] < 0.2).all(), weighted
    np.testing.assert_allclose(weighted, a_only, atol=0.1)
    # ... while without the weights the two kinds cancel out: no rule
    assert np.abs(plain - 0.5).max() < 0.2, plain
    # the weighted metrics are reported, and the weight column is no feature
    test_metrics = runs["weighted"]["summary"]["test"]["model"]
    assert {"weighted_log_loss", "weighted_accuracy"} <= set(test_metrics)
    assert test_metrics["weighted_accuracy"] > 0.7 and "weighted_accuracy" not in runs["plain"]["summary"]["test"]["model"]
    manifest = json.loads((runs["weighted"]["dir"] / "dataset" / "_manifest.json").read_text())
    assert manifest["spec"]["weight_column"] == "w" and manifest["spec"]["numeric"] == ["x", "z"]
    assert json.loads((runs["weighted"]["dir"] / "config.json").read_text())["weight_column"] == "w"
    report = (runs["weighted"]["dir"] / "report.md").read_text()
    unused = [line for line in report.splitlines() if "not used" in line]
    assert "sample weights: column `w` (not a feature" in report and len(unused) == 1 and "`w`" not in unused[0]


def test_bad_weights_are_dead_letters_and_the_counts_reconcile(tables, runs):
    manifest = json.loads((runs["weighted"]["dir"] / "dataset" / "_manifest.json").read_text())
    counts = manifest["counts"]
    assert counts["in"] == tables["table"].num_rows == counts["out"] + counts["dead_letters"]
    reason = "weight column 'w' is missing, not a finite number or negative (a sample weight is a number >= 0)"
    assert counts["dead_letters_by_reason"] == {reason: len(tables["bad"])}
    good = tables["table"].num_rows - len(tables["bad"])
    weights = [v for i, v in enumerate(tables["table"].column("w").to_pylist()) if i not in tables["bad"]]
    assert len(weights) == good and manifest["stats"]["weight_sum"] <= sum(weights)  # the training split's share


def test_a_weight_column_the_file_lacks_is_a_one_line_error_naming_it(tables, tmp_path):
    with pytest.raises((FlowtrainError, ValueError)) as err:
        flowtrain.batch(input=[str(tables["base"] / "plain.csv")], label="y", numeric=["x", "z"],
                        weight_column="weight", out=str(tmp_path / "run"), **FAST_API)
    message = str(err.value)
    assert "weight" in message and "x, z, y" in message and "\n" not in message.strip(), message


@pytest.mark.kafka
@pytest.mark.streaming
def test_the_stream_carries_each_events_weight_to_the_online_trainer(tables, runs, bootstrap, tmp_path):
    """The weighted table replayed as events (`flowtrain replay --input`, the dataset's spec: its weight column
    among the fields), the generic stream pipeline on Prism and the online trainer: the features messages carry each
    event's weight, the bad weights are dead letters with the batch ETL's reason, every raw event is a training row
    or a dead letter, and the online trainer trains on every weighted row (its message check takes them)."""
    import subprocess
    import sys
    import time
    import uuid

    from kafka import KafkaConsumer, TopicPartition

    from connectors.arrow import decode_batch
    from tests.kafka_checks import committed
    from tests.procs import stop_group

    cli = [sys.executable, "-m", "flowtrain.cli"]
    dataset = str(runs["weighted"]["dir"] / "dataset")
    tag = uuid.uuid4().hex[:6]
    names = {"raw": f"wraw-{tag}", "features": f"wfeat-{tag}", "dead": f"wdead-{tag}", "updates": f"wupd-{tag}",
             "group": f"wg-{tag}"}
    args = ["--bootstrap", bootstrap, "--raw-topic", names["raw"], "--features-topic", names["features"],
            "--dead-letter-topic", names["dead"], "--updates-topic", names["updates"], "--group-id", names["group"],
            "--dataset", dataset]
    rp = subprocess.run(cli + ["replay", "--bootstrap", bootstrap, "--topic", names["raw"], "--input",
                               str(tables["base"] / "weighted.csv"), "--dataset", dataset, "--partitions", "1"],
                        capture_output=True, text=True, timeout=180)
    assert rp.returncode == 0, rp.stderr[-2000:]

    def read(topic):
        c = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, consumer_timeout_ms=4000)
        c.assign([TopicPartition(topic, p) for p in c.partitions_for_topic(topic)])
        c.seek_to_beginning()
        out = list(c)
        c.close()
        return out

    log = tmp_path / "pipeline.log"
    proc = subprocess.Popen(cli + ["stream", "pipeline", *args, "--out", str(tmp_path / "p"), "--batch-size", "200"],
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            done, end = committed(bootstrap, names["raw"], names["group"])
            if end and done == end:
                break
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(1)
        else:
            raise AssertionError(f"the pipeline did not catch up: {log.read_text()[-2000:]}")
    finally:
        stop_group(proc)
    n = tables["table"].num_rows
    weights = tables["table"].column("w").to_pylist()
    features = [decode_batch(m.value) for m in read(names["features"])]
    carried = {o: w for b in features for o, w in zip(b["src_offset"].to_pylist(), b["weight"].to_pylist())}
    dead = {int(dict(m.headers)["source"].decode().rsplit("/", 1)[1]): dict(m.headers)["reason"].decode()
            for m in read(names["dead"])}
    assert sorted(dead) == sorted(tables["bad"]) and len(carried) + len(dead) == n
    assert {r for r in dead.values()} == {"weight column 'w' is missing, not a finite number or negative (a sample "
                                          "weight is a number >= 0)"}
    assert all(carried[o] == pytest.approx(weights[o]) for o in carried)  # event i is offset i (one partition)

    run = tmp_path / "t"
    trainer = subprocess.run(cli + ["stream", "train", *args, "--out", str(run), "--ledger", "--idle-exit", "4"],
                             capture_output=True, text=True, timeout=300)
    assert trainer.returncode == 0, (trainer.stdout + trainer.stderr)[-3000:]
    ledger = [json.loads(line) for line in (run / "ledger.jsonl").read_text().splitlines()]
    assert sorted(r["offset"] for r in ledger) == sorted(carried)  # every weighted row trained, once
    assert json.loads((run / "trainer-status.json").read_text())["rows"] == len(carried)


def test_two_workers_train_the_weighted_loss_as_one_does(tables, runs, tmp_path):
    """Data parallelism with sample weights: each row's weight travels with its row into each replica's shard of a
    global batch (the target's second column), and the reduce of sums and row counts gives the one-worker step."""
    dataset = str(runs["weighted"]["dir"] / "dataset")
    grid = np.linspace(-2.5, 2.5, 41)
    fitted = {}
    for workers in (1, 2):
        flowtrain.batch(dataset=dataset, workers=workers, out=str(tmp_path / f"w{workers}"), **FAST_API)
        fitted[workers] = _p_yes(tmp_path / f"w{workers}", grid)
    np.testing.assert_allclose(fitted[2], fitted[1], atol=1e-4)
    np.testing.assert_allclose(fitted[1], _p_yes(runs["weighted"]["dir"], grid), atol=1e-4)  # the ETL'd run's own

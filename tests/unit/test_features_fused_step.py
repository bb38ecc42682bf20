"""The stream pipeline's fused step with features over time (pipelines/stream/pipeline.py ``_FusedFeaturizeFn``),
Kafka faked (the sends and commits recorded; the real broker's run is tests/integration/test_features_stream.py):
events out of order within the allowed lateness, a broken one, a restart of the step on the same states; what it
logged equals the backfill's core (skew zero), counts reconcile (events = rows + dead letters + waiting)."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from connectors.dataset_spec import FeatureSpec
from connectors.kafka import KafkaRecord, KafkaTarget, Topics
from pipelines.features.columns import encode_keys, key_text, time_micros, values_of
from pipelines.features.core import KeyFeatures
from pipelines.features.declare import declare
from pipelines.features.skew import compare, read_logged
from pipelines.features.transactions import generate_transactions
from pipelines.stream import pipeline as stream_pipeline
from pipelines.tabular.stats import StatsAccumulator

AGGS = ("card:amount:count,sum,mean:10m,1h,life", "card:*:count:10m", "card:merchant:distinct:1d")


def _step(cfg, sent: list, commits: list):
    fn = stream_pipeline._FusedFeaturizeFn(cfg)
    fn.aggregates = cfg.aggregates()
    fn.featurizer = cfg.featurizer(fn.aggregates)
    fn.totals = {k: 0 for k in ("events", "rows", "unlabelled", "dead_letters", "batches", "messages", "late",
                                "waiting")}
    fn.valid_seen = set()
    fn._deliver = lambda partition, features, letters: sent.append((features, letters)) or 1
    fn._commit = lambda topic, partition, offset: commits.append(offset)
    fn._write_status = lambda error=None: None
    return fn


def test_the_fused_step_logs_the_backfills_values_across_a_restart(tmp_path):
    txns, merchants = generate_transactions(700, cards=10, merchants=10, days=3, delay_s=300, seed=1)
    pacsv.write_csv(merchants, tmp_path / "m.csv")
    joins = (f"{tmp_path / 'm.csv'}:merchant:valid_from",)
    names = declare(AGGS, joins).aggregate_names()
    nullable = [n for n in names if "_mean_" in n]
    spec = FeatureSpec(label="fraud", task="classification", time_column="time", categorical=["category"],
                       numeric=["amount", *(n for n in names if n not in nullable)],
                       optional_numeric=[*nullable, "merchant_risk_tier"])
    fake = {c: pa.array(np.linspace(0, 1, 20)) for c in [*spec.numeric, *spec.optional_numeric]}
    fake.update({"category": pa.array(["fuel"] * 20), "fraud": pa.array([0, 1] * 10), "time": pa.array(range(20))})
    stats = StatsAccumulator().add(pa.RecordBatch.from_pydict(fake), spec).finalize(spec)
    cfg = stream_pipeline.StreamConfig(
        kafka=KafkaTarget("-", group_id="g", connect_timeout=1.0), topics=Topics(raw="raw", features="f", dead_letters="d"),
        spec=spec.to_dict(), stats=stats, aggregations=AGGS, joins=joins, allowed_lateness=300.0,
        feature_state=str(tmp_path / "state"), log_features=str(tmp_path / "log"), log_features_id="txn")
    records = [KafkaRecord("raw", 0, i, 1000 + i, None, json.dumps(r).encode())
               for i, r in enumerate(txns.to_pylist())]
    records[5] = records[5]._replace(value=b"{broken")  # a dead letter, in no aggregate
    sent, commits = [], []
    step = _step(cfg, sent, commits)
    for i in range(0, 400, 100):
        step._flush("raw", 0, records[i:i + 100])
    step.aggregates.close()
    step = _step(cfg, sent, commits)  # a restart that reads from an older commit: what the store holds is skipped
    for i in range(300, 700, 100):
        step._flush("raw", 0, records[i:i + 100])
    assert commits[-1] == 700
    rows = sum(f.num_rows for f, _ in sent if f is not None)
    letters = [letter for _, ls in sent for letter in ls]
    assert [letter.reason.split(":")[0] for letter in letters] == ["broken JSON"]
    assert rows + len(letters) + step.aggregates.waiting() == 700  # every event once: a row, a dead letter, waiting
    kept = txns.filter(pa.array(np.arange(700) != 5))
    group = KeyFeatures(declare(AGGS).by_key(("card",)))
    keys = encode_keys(key_text(kept, ("card",)))
    want = group.advance(keys[0], keys[1], time_micros(kept.column("time")),
                         {c: values_of(kept.column(c)) for c in ("amount", "merchant")})
    backfill = kept.select(["txn"])
    for n in names:
        backfill = backfill.append_column(n, pa.array(want[n], mask=np.isnan(want[n]) if want[n].dtype.kind == "f"
                                                      else None))
    report = compare(read_logged([str(tmp_path / "log")]), backfill, "txn", features=names)
    assert report.mismatches == 0 and report.extra == 0, "\n".join(report.lines())
    assert report.matched == rows and report.missing == step.aggregates.waiting()


def test_two_instances_of_the_step_taking_turns_on_a_partition_read_each_others_states(tmp_path):
    """A runner may give a partition's bundles to different instances of the step: each reads the file again when
    another moved it on, so the values stay the backfill's."""
    txns, _ = generate_transactions(400, cards=8, merchants=6, days=2, seed=2)
    aggs = ("card:amount:count,sum:1h,life",)
    names = declare(aggs).aggregate_names()
    spec = FeatureSpec(label="fraud", task="classification", time_column="time", numeric=["amount", *names])
    fake = {c: pa.array(np.linspace(0, 1, 20)) for c in spec.numeric}
    fake.update({"fraud": pa.array([0, 1] * 10), "time": pa.array(range(20))})
    stats = StatsAccumulator().add(pa.RecordBatch.from_pydict(fake), spec).finalize(spec)
    cfg = stream_pipeline.StreamConfig(
        kafka=KafkaTarget("-", group_id="g", connect_timeout=1.0), topics=Topics(raw="raw", features="f", dead_letters="d"),
        spec=spec.to_dict(), stats=stats, aggregations=aggs, feature_state=str(tmp_path / "state"),
        log_features=str(tmp_path / "log"), log_features_id="txn")
    records = [KafkaRecord("raw", 0, i, 1000 + i, None, json.dumps(r).encode())
               for i, r in enumerate(txns.to_pylist())]
    sent, commits = [], []
    steps = [_step(cfg, sent, commits), _step(cfg, sent, commits)]
    for k, i in enumerate(range(0, 400, 50)):
        steps[k % 2]._flush("raw", 0, records[i:i + 50])
    group = KeyFeatures(declare(aggs).by_key(("card",)))
    keys = encode_keys(key_text(txns, ("card",)))
    want = group.advance(keys[0], keys[1], time_micros(txns.column("time")), {"amount": values_of(txns.column("amount"))})
    backfill = txns.select(["txn"])
    for n in names:
        backfill = backfill.append_column(n, pa.array(want[n]))
    for step in steps:
        step.aggregates.close()
    report = compare(read_logged([str(tmp_path / "log")]), backfill, "txn", features=names)
    assert report.mismatches == 0 and report.matched == 400, "\n".join(report.lines())


def test_a_feature_log_cut_by_a_kill_loses_its_torn_last_line_not_the_next(tmp_path):
    from pipelines.stream.aggregates import open_log

    path = tmp_path / "g-raw-0.jsonl"
    path.write_text('{"a": 1}\n{"a": 2}\n{"a": 3, "b"')  # killed while writing its third line
    with open_log(path) as fh:
        fh.write('{"a": 3, "b": 4}\n')
    assert path.read_text() == '{"a": 1}\n{"a": 2}\n{"a": 3, "b": 4}\n'
    path.write_text('{"a": 1')  # nothing whole
    with open_log(path) as fh:
        fh.write('{"a": 1}\n')
    assert path.read_text() == '{"a": 1}\n'
    with open_log(tmp_path / "new.jsonl") as fh:
        fh.write("x\n")
    assert (tmp_path / "new.jsonl").read_text() == "x\n"

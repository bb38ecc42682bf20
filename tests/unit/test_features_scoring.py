"""The scorer's features over time (pipelines/stream/aggregates.py ``score_records``): the stream pipeline's code
with the scorer's own state, whose offsets are committed downstream after the predictions. After a restart that
reads events again from an older committed offset, those events go on again with the values kept for them: every
event scored at least once, always with the backfill's values bit for bit."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pyarrow as pa

from connectors.dataset_spec import FeatureSpec
from connectors.kafka import KafkaRecord
from pipelines.features.columns import encode_keys, key_text, time_micros, values_of
from pipelines.features.core import KeyFeatures
from pipelines.features.declare import declare
from pipelines.features.transactions import generate_transactions
from pipelines.stream.aggregates import AggregateInputs, Aggregates
from pipelines.stream.events import DEFAULT_BOUNDS, event_schema
from pipelines.stream.featurize import StreamFeaturizer
from pipelines.tabular.stats import StatsAccumulator

AGGS = ("card:amount:count,sum,mean:10m,1d,life", "card:merchant:distinct:1d")


def test_a_restarted_scorer_scores_again_with_the_values_it_kept(tmp_path):
    events, _ = generate_transactions(600, cards=15, merchants=10, days=3, delay_s=300, seed=5)
    decl = declare(AGGS)
    names = decl.aggregate_names()
    group = KeyFeatures(decl.by_key(("card",)))
    codes = encode_keys(key_text(events, ("card",)))
    want = group.advance(codes[0], codes[1], time_micros(events.column("time")),
                         {c: values_of(events.column(c)) for c in ("amount", "merchant")})
    spec = FeatureSpec(label="fraud", task="classification", time_column="time", categorical=["category"],
                       numeric=["amount", *(n for n in names if "_mean_" not in n)],
                       optional_numeric=[n for n in names if "_mean_" in n])
    table = events.append_column("src_offset", pa.array(np.arange(events.num_rows)))
    for n in names:
        table = table.append_column(n, pa.array(want[n], mask=np.isnan(want[n]) if want[n].dtype.kind == "f" else None))
    stats = StatsAccumulator().add(table.combine_chunks().to_batches()[0], spec).finalize(spec)
    options = SimpleNamespace(aggregations=AGGS, joins=(), allowed_lateness=300.0, log_features=str(tmp_path / "log"),
                              log_features_id="txn")

    def scorer():
        agg = Aggregates(options, spec, group_id="scorer", state_dir=str(tmp_path / "state"))
        return agg, StreamFeaturizer(spec, stats, AggregateInputs(agg.event_fields(event_schema(spec))))

    records = [KafkaRecord("raw", 0, i, 1000 + i, None, json.dumps(r).encode())
               for i, r in enumerate(events.to_pylist())]
    scored: dict[int, list] = {}
    agg, featurizer = scorer()
    committed, pos, rng = 0, 0, np.random.default_rng(0)
    while pos < len(records):
        items = records[pos:pos + int(rng.integers(20, 90))]
        out, stamps = agg.score_records(items, featurizer, DEFAULT_BOUNDS)
        if out.features is not None:
            for o, v in zip(out.features.column("src_offset").to_pylist(),
                            out.features.column("num__card_amount_sum_1d").to_pylist()):
                scored.setdefault(o, []).append(v)
                assert stamps[o] == 1000 + o
        pos = items[-1].offset + 1
        if rng.random() < 0.15:  # killed before the predictions' commit: read again from the commit
            agg.close()
            agg, featurizer = scorer()
            pos = committed
        elif rng.random() < 0.5:
            committed = pos
    assert len(scored) >= len(records) - 30  # every event scored, but those still inside the lateness at the end
    assert any(len(v) > 1 for v in scored.values())  # some were scored again after a restart
    for o, values in scored.items():
        assert len(set(values)) == 1, (o, values)  # the same value each time
    agg.close()
    logged = {}  # --log-features: the aggregates each event was scored with, equal to the backfill's
    for line in (tmp_path / "log" / "scorer-raw-0.jsonl").read_text().splitlines():
        row = json.loads(line)
        logged.setdefault(row["txn"], row)
    txn = events.column("txn").to_pylist()
    for i, t in enumerate(txn):
        if t in logged:
            for n in names:
                w = want[n][i]
                g = logged[t][n]
                assert (g is None and np.isnan(w)) or np.float64(g).tobytes() == np.float64(w).tobytes(), (n, t)
    assert len(logged) >= len(records) - 30

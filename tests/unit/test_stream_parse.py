"""The generic stream's parse + featurize on any dataset equals the batch ETL's featurize on the same rows."""
from __future__ import annotations

import json
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from connectors.dataset_spec import FeatureSpec
from connectors.deadletter import DeadLetter
from flowtrain.local.runners import pipeline_options
from pipelines.stream.events import ParseBounds, event_schema, events_table, parse_event
from pipelines.stream.featurize import StreamFeaturizer
from pipelines.stream.parse import parse_batch
from pipelines.stream.replay import MALFORMED_KINDS, drop_label, malform_event, order_by_time, read_files, table_events
from pipelines.tabular.pipeline import run_tabular_etl
from tests.sensor_data import CLASSES, sensor_rows, write_csv

SPEC = FeatureSpec(label="state", task="classification", numeric=["temp", "pressure"], optional_numeric=["humidity"],
                   categorical=["site", "machine"], time_column="ts", min_count=2)
N = 600


@pytest.fixture(scope="module")
def sensor_dataset(tmp_path_factory):
    base = tmp_path_factory.mktemp("sensors")
    csv = write_csv(base / "sensors.csv", sensor_rows(N))
    manifest = run_tabular_etl([csv], SPEC, dataset_path=str(base / "ds"), dead_letters_path=str(base / "dead.jsonl"),
                               options=pipeline_options("batch"))
    return csv, str(base / "ds"), manifest


def _dataset_rows(ds: str, manifest: dict) -> dict[int, dict]:
    """CSV line -> the batch ETL's feature row, over every split."""
    table = pa.concat_tables([pq.read_table(f"{ds}/{s['file']}") for split in manifest["splits"].values()
                              for s in split])
    return {int(r["source"].rsplit(":", 1)[1]): r for r in table.to_pylist()}


def _events(csv: str) -> list[dict]:
    table, _ = order_by_time(read_files([csv]), None)
    return list(table_events(table))


def test_stream_features_equal_the_batch_etls_on_the_same_rows(sensor_dataset):
    csv, ds, manifest = sensor_dataset
    assert manifest["stats"]["classes"] == list(CLASSES)
    batch_rows = _dataset_rows(ds, manifest)
    events = _events(csv)
    payloads = [json.dumps(e).encode() for e in events]
    sources = [("sensors", 0, i) for i in range(len(events))]
    out = StreamFeaturizer.from_manifest(manifest).featurize_payloads(payloads, sources)
    # a row without pressure is a dead letter in both, with the batch ETL's reason
    assert [d.source for d in out.dead_letters] == [f"sensors/0/{i}" for i in range(N) if i % 97 == 5]
    assert {d.reason for d in out.dead_letters} == {"numeric feature 'pressure' is missing or not a finite number"}
    assert out.features.num_rows == len(batch_rows) == N - len(out.dead_letters) and out.trainable.all()
    names = [c for c in out.features.schema.names if c.startswith(("num__", "cat__"))] + ["label"]
    assert set(names) < set(next(iter(batch_rows.values())))
    stream = out.features.to_pylist()
    for row in stream:
        i = row["src_offset"]
        mine, theirs = [row[c] for c in names], [batch_rows[i + 2][c] for c in names]  # CSV line = index + 2
        assert np.allclose(mine, theirs, rtol=0, atol=1e-6), (i, mine, theirs)
    rare = next(r for r in stream if r["src_offset"] == N // 2)
    assert rare["cat__site"] == 0  # out of vocabulary, as in the batch job
    assert any(r["num__humidity"] == 0.0 for r in stream)  # a missing optional numeric is the mean


def test_unlabelled_and_unseen_class_events_are_scored_not_trained(sensor_dataset):
    csv, _, manifest = sensor_dataset
    events = [e for e in _events(csv) if e["pressure"] is not None][:50]
    events[3] = drop_label(events[3], "state")
    events[4] = {**events[4], "state": None}
    events[5] = {**events[5], "state": "exploded"}
    payloads = [json.dumps(e).encode() for e in events]
    out = StreamFeaturizer.from_manifest(manifest).featurize_payloads(payloads, [("t", 1, i) for i in range(50)])
    assert out.features.num_rows == 50 and not out.dead_letters  # the scorer: every event a prediction
    assert out.trainable.tolist() == [i not in (3, 4, 5) for i in range(50)]
    assert out.unlabelled == 2 and [d.source for d in out.unseen_class] == ["t/1/5"]
    assert out.unseen_class[0].reason == "label 'state' holds a class not seen in the training split"
    training = out.training()
    assert training.num_rows == 47 and not np.isnan(training.column("label").to_numpy()).any()
    assert np.isnan(out.features.column("label").to_numpy()[[3, 4, 5]]).all()
    # raw = training rows + unlabelled + dead letters (the trainer's reconciliation)
    assert 50 == training.num_rows + out.unlabelled + len(out.training_dead_letters)
    # the unlabelled event's features are those of the same event with its label
    full = StreamFeaturizer.from_manifest(manifest).featurize_payloads([json.dumps(_events(csv)[3]).encode()],
                                                                        [("t", 1, 3)])
    for col in full.features.schema.names:
        if col.startswith(("num__", "cat__")):
            assert full.features.column(col)[0] == out.features.column(col)[3]


def test_every_malformed_kind_is_a_dead_letter_naming_its_field(sensor_dataset):
    csv, _, manifest = sensor_dataset
    events = [e for e in _events(csv) if e["pressure"] is not None]
    schema = event_schema(SPEC)
    bounds = ParseBounds(max_event_bytes=20_000)
    rng = random.Random(3)
    payloads = [malform_event(events[i], kind, rng, schema, bounds) for i, kind in enumerate(MALFORMED_KINDS * 3)]
    out = StreamFeaturizer.from_manifest(manifest).featurize_payloads(
        payloads, [("t", 0, i) for i in range(len(payloads))], bounds)
    assert out.features is None and len(out.dead_letters) == len(payloads)
    for kind, letter in zip(MALFORMED_KINDS * 3, out.dead_letters):  # the kind is the reason's own name
        assert letter.reason.startswith(kind + ": ") or letter.reason == kind, (kind, letter.reason)
        if kind in ("missing field(s)", "wrong type", "NaN", "infinite"):
            assert any(f"{c}" in letter.reason for c in ("temp", "pressure", "ts", "humidity")), letter.reason


def test_generic_parse_batch_equals_parse_event_row_by_row():
    schema = event_schema(SPEC)
    base = {"ts": "2024-03-01T00:00:00", "temp": 61.5, "pressure": 1.1, "humidity": 40.0, "site": "north",
            "machine": 3, "state": "ok"}
    good = [{**base, "temp": 50.0 + i, "machine": i % 5} for i in range(200)]
    odd = [
        {**base, "machine": "3"}, {**base, "machine": 3.0}, {**base, "machine": True}, {**base, "state": 2},
        {**base, "state": True}, {**base, "ts": 1709251200}, {**base, "ts": "2024/03/01"}, {**base, "site": None},
        {k: v for k, v in base.items() if k != "site"}, {k: v for k, v in base.items() if k != "humidity"},
        {k: v for k, v in base.items() if k != "state"}, {k: v for k, v in base.items() if k != "temp"},
        {**base, "temp": None}, {**base, "temp": "hot"}, {**base, "site": {"a": 1}}, {**base, "site": [1]},
        {**base, "temp": 1e300}, {**base, "machine": 2 ** 60}, {**base, "site": "2024-03-01T00:00:00"},
        {**base, "extra": {"x": [1, 2]}}, {**base, "temp": 7},
    ]
    payloads = [json.dumps(e).encode() for e in good[:100]]
    for i, e in enumerate(odd):
        payloads += [json.dumps(e).encode()] + [json.dumps(x).encode() for x in good[100 + i * 4:104 + i * 4]]
    payloads += [None, b"not json", json.dumps(base).encode().replace(b'"north"', b'"n\xffrth"'), b'{"temp": NaN}']
    sources = [("raw", 2, i) for i in range(len(payloads))]
    for bounds in (ParseBounds(), ParseBounds(max_abs_number=100.0)):
        table, letters = parse_batch(payloads, sources, schema, bounds)
        outs = [parse_event(p, f"raw/2/{i}", schema, bounds) for i, p in enumerate(payloads)]
        rows = [(o, s) for o, s in zip(outs, sources) if not isinstance(o, DeadLetter)]
        expected = events_table([o for o, _ in rows], [s for _, s in rows], schema)
        assert table.equals(expected), (table.to_pylist()[:3], expected.to_pylist()[:3])
        assert [(d.source, d.reason) for d in letters] == [(d.source, d.reason) for d in outs
                                                            if isinstance(d, DeadLetter)]
    row = {r["source"]: r for r in parse_batch(payloads, sources, schema)[0].to_pylist()}
    assert row["raw/2/100"]["machine"] == "3" and row["raw/2/105"]["machine"] == "3"  # "3" and 3.0 are one category
    assert row["raw/2/110"]["machine"] == "true" and row["raw/2/125"]["ts"] == "1709251200"


def test_replay_reads_csv_parquet_and_json_lines_alike_in_event_time_order(tmp_path):
    import datetime as dt

    rows = sensor_rows(40)
    table = pa.Table.from_pylist(rows)
    table = table.set_column(table.schema.get_field_index("ts"), "ts",
                             pa.array([dt.datetime.fromisoformat(r["ts"]) for r in rows], pa.timestamp("s")))
    shuffled = table.take(pa.array(np.random.default_rng(1).permutation(40)))
    pq.write_table(shuffled, tmp_path / "t.parquet")
    (tmp_path / "t.jsonl").write_text("".join(
        json.dumps({k: (v.isoformat() if isinstance(v, dt.datetime) else v) for k, v in r.items()}) + "\n"
        for r in shuffled.to_pylist()))
    write_csv(tmp_path / "t.csv", [{k: (v.isoformat() if isinstance(v, dt.datetime) else v) for k, v in r.items()}
                                   for r in shuffled.to_pylist()])
    outs = []
    for name in ("t.parquet", "t.jsonl", "t.csv"):
        ordered, ms = order_by_time(read_files([str(tmp_path / name)]), "ts")
        events = list(table_events(ordered))
        assert [e["ts"] for e in events] == [dt.datetime.fromisoformat(r["ts"]).strftime("%Y-%m-%dT%H:%M:%SZ")
                                             for r in rows], name
        assert ms[0] == dt.datetime(2024, 3, 1, tzinfo=dt.timezone.utc).timestamp() * 1000 and np.all(np.diff(ms) > 0)
        outs.append([{k: e[k] for k in ("temp", "pressure", "humidity", "site", "machine", "state")} for e in events])
    assert outs[0] == outs[1] == outs[2]  # the same events whatever the file format
    with pytest.raises(ValueError, match="--time-column 'nope' is not a column"):
        order_by_time(read_files([str(tmp_path / "t.csv")]), "nope")


def test_foreign_keys_names_another_tables_event_only_when_no_event_has_a_field():
    from pipelines.stream.parse import foreign_keys

    schema = event_schema(SPEC)
    diamonds = [json.dumps({"carat": 0.3, "cut": "Ideal", "price": 500}).encode()] * 3
    assert foreign_keys(diamonds + [b"{broken", b"{}", None], schema) == ["carat", "cut", "price"]
    assert foreign_keys(diamonds + [json.dumps({"temp": 1.0}).encode()], schema) is None  # one of ours: dead letters
    assert foreign_keys([b"{broken", b"{}"], schema) is None

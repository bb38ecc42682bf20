"""The ETL's bounded-memory path: valid rows spilled to temporary files between the statistics and
the featurize pass, the weather join sliced per flight batch, dead letters written per bundle.

Outputs are compared with the same steps done in memory with pyarrow (no Beam)."""
from __future__ import annotations

import datetime as dt
import json
from collections import Counter
from pathlib import Path

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
from test_dataset_filesystems import _Store  # registers the memfs:// object store (no rename, no directories)

from connectors.dataset import read_manifest
from connectors.dataset_spec import SPLITS, FeatureSpec
from connectors.deadletter import DeadLetter, WriteDeadLettersToJsonl, reason_kind
from connectors.spill import ReadFromSpill, WriteToSpill, remove_spill, spill_directory
from flowtrain.local.paths import cache_root
from flowtrain.local.runners import pipeline_options
from pipelines.flights import features as FF
from pipelines.flights.batch import run_flights_etl
from pipelines.flights.preset import FLIGHTS
from pipelines.tabular.checks import split_valid
from pipelines.tabular.features import featurize_rows
from pipelines.tabular.pipeline import run_tabular_etl
from pipelines.tabular.splits import assign_splits
from pipelines.tabular.stats import StatsAccumulator
from pipelines.tabular.times import time_cutoff

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def tables() -> dict[str, str]:
    return FLIGHTS.demo_inputs(cache_root())


@pytest.fixture(scope="module")
def flights_slice(tables, tmp_path_factory) -> dict[str, str]:
    """Every 50th flight of 2013 (6.7k rows, all months, some dead letters) in 1k-row groups."""
    base = tmp_path_factory.mktemp("flights")
    flights = pq.read_table(tables["flights"])
    pq.write_table(flights.take(pa.array(np.arange(0, flights.num_rows, 50))), base / "flights.parquet",
                   row_group_size=1000)
    return {**tables, "flights": str(base / "flights.parquet")}


def _in_memory(tables: dict[str, str], spec: FeatureSpec = FF.FLIGHTS_SPEC):
    """The ETL in plain pyarrow: (features per split, dead-letter reasons)."""
    flights = pq.read_table(tables["flights"])
    flights = flights.append_column("_source_file", pa.array([tables["flights"]] * flights.num_rows))
    flights = flights.append_column("_source_row", pa.array(np.arange(flights.num_rows, dtype=np.int64)))
    weather, planes = FF.prepare_weather(pq.read_table(tables["weather"])), FF.prepare_planes(pq.read_table(tables["planes"]))
    joined = FF.join_reference(flights, weather, planes).combine_chunks().to_batches()[0]
    good, dead = split_valid(joined, spec, FF.impossible_values(joined))
    codes = assign_splits(good, spec, (time_cutoff(spec.valid_from), time_cutoff(spec.test_from)))
    stats = StatsAccumulator().add(good.filter(pa.array(codes == 0)), spec).finalize(spec)
    out = {}
    for i, name in enumerate(SPLITS):
        out[name], unknown = featurize_rows(good.filter(pa.array(codes == i)), spec, stats)
        dead += unknown
    return out, Counter(d.reason for d in dead)


def _split_table(ds: str, split: str) -> pa.Table:
    m = read_manifest(ds)
    return pa.concat_tables([pq.read_table(f"{ds}/{s['file']}") for s in m["splits"][split]])


def _by_row(table: pa.Table) -> pa.Table:
    """Rows ordered by their source row number (``file:row``)."""
    rows = pc.cast(pc.list_element(pc.split_pattern(table.column("source"), ":", reverse=True, max_splits=1), 1), pa.int64())
    return table.take(pc.sort_indices(rows))


def _leftovers(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if ".spill-" in p.name or ".parts-" in p.name or ".tmp-" in p.name]


def test_spilled_flights_etl_equals_the_in_memory_etl_and_leaves_no_spill(flights_slice, tmp_path):
    m = run_flights_etl(dataset_path=str(tmp_path / "ds"), dead_letters_path=str(tmp_path / "dead.jsonl"),
                        options=pipeline_options("batch"), tables=flights_slice)
    expected, reasons = _in_memory(flights_slice)
    n_in = pq.read_metadata(flights_slice["flights"]).num_rows
    c = m["counts"]
    assert c["in"] == n_in == c["out"] + c["dead_letters"]
    assert m["rows"] == c["out_by_split"] == {s: expected[s].num_rows for s in SPLITS}
    assert c["dead_letters_by_reason"] == dict(Counter(reason_kind(r) for r in reasons.elements()))  # by kind
    assert c["dead_letters"] > 0
    dead = [json.loads(line) for line in open(tmp_path / "dead.jsonl")]
    assert Counter(d["reason"] for d in dead) == reasons
    assert len({d["source"] for d in dead}) == len(dead)
    for split in SPLITS:  # the same feature rows, whatever the bundling
        got, want = _by_row(_split_table(str(tmp_path / "ds"), split)), _by_row(pa.Table.from_batches([expected[split]]))
        assert got.column_names == want.column_names
        assert got.column("source").equals(want.column("source"))
        for name in got.column_names:
            if name.startswith("cat_") or name == "label":
                assert got.column(name).equals(want.column(name)), name
            elif name != "source":
                np.testing.assert_allclose(got.column(name).to_numpy(), want.column(name).to_numpy(), atol=1e-5)
    assert _leftovers(tmp_path) == []  # spill, dead-letter parts and staging all gone


def test_on_an_object_store_the_rows_are_spilled_and_every_spill_and_part_is_removed(flights_slice, tmp_path):
    _Store.objects.clear()
    _Store.commits.clear()
    local = run_flights_etl(dataset_path=str(tmp_path / "ds"), dead_letters_path=None,
                            options=pipeline_options("batch"), tables=flights_slice)
    remote = run_flights_etl(dataset_path="memfs://bucket/ds", dead_letters_path="memfs://bucket/dead.jsonl",
                             options=pipeline_options("batch"), tables=flights_slice)
    assert remote["counts"] == local["counts"] and remote["rows"] == local["rows"]
    spilled = [p for p in _Store.commits if p.startswith("memfs://bucket/ds.spill-")]
    parts = [p for p in _Store.commits if p.startswith("memfs://bucket/dead.jsonl.parts-")]
    assert spilled and parts  # the rows went through the spill, dead letters through per-bundle parts
    left = [p for p in _Store.objects if ".spill-" in p or ".parts-" in p]
    assert left == []
    lines = _Store.objects["memfs://bucket/dead.jsonl"].decode().splitlines()
    assert len(lines) == remote["counts"]["dead_letters"]
    _Store.objects.clear()


def test_fraction_split_by_time_reads_the_spill_twice_and_matches_in_memory(tmp_path):
    rng = np.random.default_rng(5)
    n = 3000
    t0 = dt.datetime(2020, 1, 1, tzinfo=dt.timezone.utc)
    x = rng.normal(size=n).round(4)
    x[::97] = np.nan  # dead letters
    table = pa.table({"t": [(t0 + dt.timedelta(hours=int(h))).isoformat() for h in rng.permutation(n)],
                      "x": x, "c": rng.choice(["a", "b", "c"], n), "y": rng.normal(size=n).round(4)})
    pacsv.write_csv(table, tmp_path / "data.csv")
    spec = FeatureSpec(label="y", task="regression", numeric=["x"], categorical=["c"], time_column="t",
                       fractions=(0.6, 0.2, 0.2))
    m = run_tabular_etl([str(tmp_path / "data.csv")], spec, dataset_path=str(tmp_path / "ds"),
                        dead_letters_path=str(tmp_path / "dead.jsonl"), options=pipeline_options("batch"))
    valid = ~np.isnan(x)
    hours = np.array([(dt.datetime.fromisoformat(s) - t0).total_seconds() for s in table.column("t").to_pylist()])[valid]
    lo, hi = hours.min(), hours.max()
    cut = (lo + (hi - lo) * 0.6, lo + (hi - lo) * 0.8)
    want = {"train": int((hours < cut[0]).sum()), "valid": int(((hours >= cut[0]) & (hours < cut[1])).sum()),
            "test": int((hours >= cut[1]).sum())}
    assert m["rows"] == m["counts"]["out_by_split"] == want
    assert m["counts"]["in"] == n and m["counts"]["dead_letters"] == int((~valid).sum())
    train = _split_table(str(tmp_path / "ds"), "train")
    assert abs(m["stats"]["numeric"]["x"]["mean"] - float(np.mean(x[valid][hours < cut[0]]))) < 1e-9
    assert train.num_rows == want["train"]
    assert _leftovers(tmp_path) == []


def test_spill_round_trips_every_type_and_batch_and_is_removed(tmp_path):
    batch = pa.RecordBatch.from_pydict({
        "ts": pa.array([0, 3600, None], pa.timestamp("s", tz="UTC")),
        "d": pa.array([1, None, 3], pa.date32()),
        "s": pa.array(["a", None, "ccc"], pa.large_string()),
        "cat": pa.array(["x", "y", "x"]).dictionary_encode(),
        "n": pa.array([None, None, None], pa.null()),
        "l": pa.array([[1], [], None], pa.list_(pa.int16())),
        "dec": pa.array([1, 2, None], pa.decimal128(10, 2)),
    })
    spill = spill_directory(str(tmp_path / "out"))
    other = pa.RecordBatch.from_pydict({"z": pa.array([1, 2], pa.int8())})  # another schema under the same key
    pairs = [("a", batch), ("b", batch.slice(1)), ("a", batch.slice(0, 2)), ("a", other)]
    with beam.Pipeline(options=pipeline_options("batch")) as p:
        names = p | beam.Create(pairs) | WriteToSpill(spill)
        back = names | ReadFromSpill() | beam.combiners.ToList()
        _ = back | beam.Map(lambda got: _same_batches(got, pairs))
    assert Path(spill).is_dir() and list(Path(spill).iterdir())  # kept until removed: retries can re-read
    remove_spill(spill)
    assert not Path(spill).exists()
    remove_spill(spill)  # gone already: no error


def _same_batches(got, pairs) -> None:
    def key(kv):
        return kv[0], kv[1].num_rows, kv[1].num_columns

    got, want = sorted(got, key=key), sorted(pairs, key=key)
    assert [k for k, _ in got] == [k for k, _ in want]
    for (_, g), (_, w) in zip(got, want):
        assert g.schema.equals(w.schema) and g.equals(w), (g, w)


def test_dead_letters_one_file_from_many_bundles_and_an_empty_file_when_none(tmp_path):
    letters = [DeadLetter({"i": i}, f"f:{i}", f"reason {i % 3}") for i in range(500)]
    with beam.Pipeline(options=pipeline_options("batch")) as p:
        _ = (p | "Letters" >> beam.Create(letters) | beam.Reshuffle()
             | "Write" >> WriteDeadLettersToJsonl(str(tmp_path / "dead.jsonl")))
        _ = p | "None" >> beam.Create([]) | "WriteNone" >> WriteDeadLettersToJsonl(str(tmp_path / "none.jsonl"))
    lines = [json.loads(line) for line in open(tmp_path / "dead.jsonl")]
    assert sorted(d["payload"]["json"]["i"] for d in lines) == list(range(500))
    assert lines[0].keys() == {"source", "reason", "payload"}
    assert (tmp_path / "none.jsonl").read_text() == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dead.jsonl", "none.jsonl"]


# --- the weather join, sliced per flight batch --------------------------------------------------------------
def _whole_table_join(flights: pa.Table, weather: pa.Table, planes: pa.Table) -> pa.Table:
    """The join as it was before slicing: every weather hour hashed for every batch."""
    table = flights.set_column(flights.schema.get_field_index("time_hour"), "time_hour",
                               pc.cast(flights.column("time_hour"), FF.HOUR_TYPE))
    table = table.append_column("__order", pa.array(np.arange(table.num_rows, dtype=np.int64)))
    joined = table.join(weather, keys=["origin", "time_hour"], join_type="left outer")
    joined = joined.join(planes, keys="tailnum", join_type="left outer")
    return FF.derive(joined.sort_by("__order").drop_columns(["__order"]))


def test_weather_sliced_per_batch_joins_like_the_whole_table(tables):
    flights = pq.read_table(tables["flights"])
    raw_weather = pq.read_table(tables["weather"])
    hours = pc.cast(pc.cast(raw_weather.column("time_hour"), FF.HOUR_TYPE), pa.int64())
    holes = pc.is_in(hours, value_set=pa.array(np.unique(hours.to_numpy())[[0, 1, 500, 501, 502, -1]]))
    weather = FF.prepare_weather(raw_weather.filter(pc.invert(holes)))  # hours missing from weather, edges too
    planes = FF.prepare_planes(pq.read_table(tables["planes"]))
    order = pc.sort_indices(flights, [("time_hour", "ascending")])
    by_time = flights.take(order)
    late = by_time.slice(by_time.num_rows - 300).set_column(
        by_time.schema.get_field_index("time_hour"), "time_hour",
        pc.add(pc.cast(by_time.slice(by_time.num_rows - 300).column("time_hour"), pa.timestamp("ms", tz="UTC")),
               pa.scalar(dt.timedelta(hours=5))))  # past the last weather hour
    no_hours = flights.slice(0, 50).set_column(flights.schema.get_field_index("time_hour"), "time_hour",
                                               pa.nulls(50, flights.schema.field("time_hour").type))
    batches = {
        "first hours (before and at weather's start)": by_time.slice(0, 2000),
        "last hours": by_time.slice(by_time.num_rows - 2000),
        "past weather's end": late,
        "a whole month, unordered": flights.filter(pc.equal(flights.column("month"), 7)),
        "every 97th flight (a year wide)": flights.take(pa.array(np.arange(0, flights.num_rows, 97))),
        "no hour at all": no_hours,
        "one row": flights.slice(12345, 1),
    }
    for what, batch in batches.items():
        got = FF.join_reference(batch, weather, planes)
        want = _whole_table_join(batch, weather, planes)
        assert got.equals(want), what
        assert got.schema.equals(want.schema, check_metadata=True), what
    joined_some = FF.join_reference(batches["first hours (before and at weather's start)"], weather, planes)
    assert joined_some.column("temp").null_count > 0 and joined_some.column("temp").null_count < joined_some.num_rows
    month = batches["a whole month, unordered"]
    assert FF.weather_hours(weather, month).num_rows < weather.num_rows / 6  # the batch's hours only
    shuffled = weather.take(pa.array(np.random.default_rng(0).permutation(weather.num_rows)))
    assert FF.weather_hours(shuffled, month).num_rows == weather.num_rows  # unsorted: whole, still right
    assert FF.join_reference(month, shuffled, planes).equals(_whole_table_join(month, weather, planes))


def test_weather_partitioned_by_month_joins_like_the_broadcast_weather(tables, tmp_path):
    """JoinReference(temp_dir=...) reads each batch's months from files; same rows as the whole table."""
    from pipelines.flights.batch import JoinReference

    flights = pq.read_table(tables["flights"])
    picked = pa.concat_tables([
        flights.slice(0, 700),  # the first hours of the year
        flights.slice(flights.num_rows - 700),  # the last
        flights.take(pa.array(np.arange(0, flights.num_rows, 401))),  # a year wide, unordered
    ])
    late = flights.slice(100, 200)
    late = late.set_column(late.schema.get_field_index("time_hour"), "time_hour",
                           pc.add(late.column("time_hour"), pa.scalar(dt.timedelta(days=400))))  # no weather then
    hourless = flights.slice(300, 50)
    hourless = hourless.set_column(hourless.schema.get_field_index("time_hour"), "time_hour",
                                   pa.nulls(50, hourless.schema.field("time_hour").type))
    batches = [b for t in (picked, late, hourless) for b in t.combine_chunks().to_batches(max_chunksize=500)]
    temp = spill_directory(str(tmp_path / "weather"))
    with beam.Pipeline(options=pipeline_options("batch")) as p:
        source = p | beam.Create(batches)
        by_month = source | "ByMonth" >> JoinReference(tables["weather"], tables["planes"], temp_dir=temp)
        broadcast = source | "Broadcast" >> JoinReference(tables["weather"], tables["planes"])
        _ = ((by_month | "A" >> beam.combiners.ToList()), (broadcast | "B" >> beam.combiners.ToList())) \
            | beam.Flatten() | beam.combiners.ToList() | beam.Map(_same_rows)
    assert Path(temp).is_dir()
    remove_spill(temp)
    assert not Path(temp).exists()


def _same_rows(two) -> None:
    a, b = (pa.Table.from_batches(x) for x in two)
    keys = [(name, "ascending") for name in a.column_names]
    a, b = a.sort_by(keys), b.sort_by(keys)
    assert a.num_rows == b.num_rows > 0
    assert a.equals(b)

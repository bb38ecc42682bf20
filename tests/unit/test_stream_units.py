"""The streaming job's pure pieces: event parsing, bad-event kinds, the seen-source filter."""
import hashlib
import io
import json
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from connectors.arrow import decode_batch, encode_batch, encode_batches
from connectors.deadletter import DeadLetter
from connectors.kafka import dead_letter_from_record, dead_letter_record, record_size
from flowtrain.train.stream.source import unseen
from pipelines.flights.events import MALFORMED_KINDS, ParseBounds, events_table, malform, parse_event

EVENT = {"year": 2013, "month": 1, "day": 1, "hour": 5, "minute": 15, "sched_dep_time": 515, "sched_arr_time": 819,
         "carrier": "UA", "flight": 1545, "tailnum": "N14228", "origin": "EWR", "dest": "IAH", "distance": 1400.0,
         "time_hour": "2013-01-01T10:00:00Z", "arr_delay": 11.0}


def test_parse_event_accepts_a_good_event_and_builds_a_table():
    assert parse_event(json.dumps(EVENT).encode(), "raw/0/0") == EVENT
    table = events_table([EVENT], [("raw", 0, 7)])
    assert table["source"].to_pylist() == ["raw/0/7"] and table["src_offset"].to_pylist() == [7]
    assert str(table.schema.field("time_hour").type) == "timestamp[s, tz=UTC]"


def test_each_malformed_kind_gets_its_reason():
    """The demo's malformed kinds are the names of their dead letters' reasons (issue 45 item 5): a reason is its
    kind or starts with "kind: " (``reason_kind``), as for the generic replay's kinds."""
    from pipelines.flights.features import impossible_values

    rng = random.Random(0)
    assert {"missing field(s)", "infinite", "not UTF-8"} <= set(MALFORMED_KINDS)
    for kind in MALFORMED_KINDS:
        out = parse_event(malform(EVENT, kind, rng), "raw/1/2")
        if not isinstance(out, DeadLetter):  # well-formed: the feature code's impossible-value check rejects it
            table = events_table([out], [("raw", 1, 2)])
            reasons = [reason for reason, fails in impossible_values(table) if fails.any()]
            assert reasons == [kind], (kind, reasons)
        else:
            assert (out.reason == kind or out.reason.startswith(kind + ": ")) and out.source == "raw/1/2", \
                (kind, out.reason)
    with pytest.raises(ValueError, match="no malformed kind 'impossible value'"):
        malform(EVENT, "impossible value", rng)


def test_unseen_filters_by_highest_offset_per_raw_partition():
    fresh = unseen(np.array([0, 0, 1, 1, 2]), np.array([5, 6, 3, 9, 0]), {0: 5, 1: 8})
    assert fresh.tolist() == [False, True, False, True, True]


# --- poison events, bounds, sizes, the dead-letter wire format (issue 16) ----------------------

@pytest.mark.parametrize("payload, reason", [
    (('{"a":' * 100_000 + "1" + "}" * 100_000).encode(), "too deeply nested JSON"),  # RecursionError before
    (('{"a":' * 40 + "1" + "}" * 40).encode(), "too deeply nested JSON: more than max_json_depth 32"),
    (json.dumps({**EVENT, "distance": 10 ** 30}).encode(), "number out of range: field 'distance'"),
    (json.dumps({**EVENT, "year": 10 ** 30}).encode(), "number out of range: field 'year'"),  # OverflowError before
    (json.dumps({**EVENT, "flight": 2 ** 63}).encode(), "number out of range: field 'flight'"),
    (json.dumps({**EVENT, "carrier": "UA"}).encode().replace(b'"UA"', b'"U\xff"'), "not UTF-8: "),
    (json.dumps({**EVENT, "carrier": "x" * 5_000_000}).encode(), "event too large: 5,000,"),
    (b"9" * 5000, "broken JSON"),
    (None, "broken JSON: the record has no value"),
])
def test_poison_events_are_dead_letters_with_their_reason(payload, reason):
    out = parse_event(payload, "raw/0/9")
    assert isinstance(out, DeadLetter) and out.reason.startswith(reason), out.reason if isinstance(out, DeadLetter) else out
    assert out.source == "raw/0/9" and out.payload is payload


def test_parse_bounds_are_options():
    big = json.dumps({**EVENT, "distance": 5000.0}).encode()
    assert parse_event(big, "s") == {**EVENT, "distance": 5000.0}
    assert parse_event(big, "s", ParseBounds(max_abs_number=1000)).reason.startswith("number out of range")
    assert parse_event(big, "s", ParseBounds(max_event_bytes=100)).reason.startswith("event too large")
    with pytest.raises(ValueError, match="max_json_depth"):
        ParseBounds(max_json_depth=0)


def test_events_that_make_the_feature_code_fail_become_dead_letters_alone():
    from connectors.dataset_spec import FeatureSpec
    from pipelines.stream.featurize import StreamFeaturizer

    spec = FeatureSpec(label="arr_delay", task="regression", numeric=["distance"], categorical=["carrier"])
    stats = {"numeric": {"distance": {"mean": 1000.0, "std": 500.0}}, "vocab": {"carrier": ["UA"]}, "label_mean": 5.0}

    class Unlucky:  # an enrichment that fails on one event: that event alone is a dead letter
        from pipelines.flights.events import FLIGHT_EVENTS as events

        def enrich(self, table):
            if 13 in table["flight"].to_pylist():
                raise OverflowError("unlucky")
            return table

        def checks(self, batch):
            return []

    table = events_table([EVENT, {**EVENT, "flight": 13}, EVENT], [("raw", 0, 1), ("raw", 0, 2), ("raw", 0, 3)])
    out = StreamFeaturizer(spec, stats, Unlucky()).featurize_table(table)
    assert out.features["src_offset"].to_pylist() == [1, 3] and out.trainable.all()
    assert [(d.source, d.reason) for d in out.dead_letters] == [("raw/0/2", "featurizing failed: OverflowError: unlucky")]


def test_encode_batches_splits_to_fit_and_keeps_every_row_in_order():
    batch = pa.RecordBatch.from_pydict({"a": list(range(10_000)), "s": [f"src-{i}" for i in range(10_000)]})
    assert encode_batches(batch) == [encode_batch(batch)]
    messages = encode_batches(batch, 20_000)
    assert len(messages) > 5 and all(len(m) <= 20_000 for m in messages)
    back = pa.Table.from_batches([decode_batch(m) for m in messages])
    assert back.equals(pa.Table.from_batches([batch]))
    with pytest.raises(ValueError, match="more than the 300 bytes"):
        encode_batches(batch.slice(0, 1), 300)


def test_dead_letter_wire_format_round_trips_and_truncates_to_fit():
    for payload in (b"\xff raw", "text", {"a": 1, "b": [1.5, None]}, None):
        key, value, headers = dead_letter_record(DeadLetter(payload, "raw/1/2", "why"))
        assert key == b"raw/1/2"
        assert dead_letter_from_record(value, headers) == (DeadLetter(payload, "raw/1/2", "why"), {})
    assert dead_letter_record(DeadLetter("text", "s", "r"))[1] == b"text"  # not JSON-quoted
    big = b"{" + b"x" * 3_000_000
    key, value, headers = dead_letter_record(DeadLetter(big, "raw/0/7", "event too large"), max_bytes=100_000)
    assert record_size(key, value, headers) <= 100_000 and big.startswith(value) and len(value) > 90_000
    letter, info = dead_letter_from_record(value, headers)
    assert (letter.source, letter.reason) == ("raw/0/7", "event too large")
    assert info == {"truncated": True, "size": len(big), "sha256": hashlib.sha256(big).hexdigest()}


def test_micro_batcher_closes_by_size_and_drains_the_rest():
    from pipelines.flights.streaming import MicroBatcher

    batcher = MicroBatcher(3, max_delay_s=3600)
    closed = [batcher.add(k, i) for i, k in enumerate("aabab")]
    assert closed == [None, None, None, [0, 1, 3], None]
    assert batcher.drain() == [("b", [2, 4])] and batcher.drain() == []


# --- reference tables through Beam's FileSystems (issue 11, defect 6) --------------------------
from apache_beam.io.filesystem import FileMetadata, FileSystem  # noqa: E402


class _MemoryFileSystem(FileSystem):
    """A non-local filesystem registered with Beam for the scheme ``streamtestmem://``."""

    files: dict[str, bytes] = {}

    @classmethod
    def scheme(cls):
        return "streamtestmem"

    def join(self, base, *paths):
        return "/".join([base.rstrip("/"), *paths])

    def split(self, path):
        return path.rsplit("/", 1)

    def mkdirs(self, path):
        pass

    def has_dirs(self):
        return False

    def _list(self, dir_or_prefix):
        return [FileMetadata(p, len(b)) for p, b in self.files.items() if p.startswith(dir_or_prefix)]

    def create(self, path, mime_type="application/octet-stream", compression_type=None):
        raise NotImplementedError

    def open(self, path, mime_type="application/octet-stream", compression_type=None):
        if path not in self.files:
            raise FileNotFoundError(path)
        return io.BytesIO(self.files[path])

    def copy(self, source_file_names, destination_file_names):
        raise NotImplementedError

    def rename(self, source_file_names, destination_file_names):
        raise NotImplementedError

    def exists(self, path):
        return path in self.files

    def size(self, path):
        return len(self.files[path])

    def last_updated(self, path):
        return 0.0

    def metadata(self, path):
        return FileMetadata(path, len(self.files[path]))

    def delete(self, paths):
        for p in paths:
            self.files.pop(p, None)


def test_reference_tables_are_read_through_beam_filesystems():
    from flowtrain.local.paths import cache_root
    from pipelines.flights import features as FF
    from pipelines.flights.preset import FLIGHTS
    from pipelines.flights.streaming import load_reference_tables

    tables = FLIGHTS.demo_inputs(cache_root())
    for name in ("weather", "planes"):
        sink = io.BytesIO()
        pq.write_table(pq.read_table(tables[name]), sink)
        _MemoryFileSystem.files[f"streamtestmem://ref/{name}.parquet"] = sink.getvalue()
    weather, planes = load_reference_tables("streamtestmem://ref/weather.parquet", "streamtestmem://ref/planes.parquet")
    local = load_reference_tables(tables["weather"], tables["planes"])
    assert weather.num_rows > 20_000 and weather.equals(local[0]) and planes.equals(local[1])
    joined = FF.join_reference(events_table([EVENT], [("raw", 0, 1)]), weather, planes)
    assert joined["temp"][0].as_py() is not None and joined["seats"][0].as_py() is not None
    with pytest.raises(FileNotFoundError, match="streamtestmem://ref/none.parquet"):
        load_reference_tables("streamtestmem://ref/none.parquet", "streamtestmem://ref/planes.parquet")


# --- the micro-batch parsed at once equals row by row (issue 15, item 1) ------------------------
def _row_wise(payloads, sources, bounds=ParseBounds()):
    outs = [parse_event(p, f"{t}/{pa_}/{o}", bounds) for p, (t, pa_, o) in zip(payloads, sources)]
    good = [(o, s) for o, s in zip(outs, sources) if not isinstance(o, DeadLetter)]
    table = events_table([o for o, _ in good], [s for _, s in good]) if good else None
    return table, [o for o in outs if isinstance(o, DeadLetter)]


def test_parse_batch_rejects_exactly_what_parse_event_rejects_with_the_same_reasons():
    import itertools

    from flowtrain.local.paths import cache_root
    from pipelines.flights.events import events_from_table, parse_batch
    from pipelines.flights.preset import FLIGHTS

    flights = pq.read_table(FLIGHTS.demo_inputs(cache_root())["flights"]).slice(0, 3000)
    events = list(itertools.islice(events_from_table(flights), 2000))  # real rows: nulls, cancelled flights
    rng = random.Random(7)
    payloads = [json.dumps(e).encode() for e in events[:1500]]
    for i, kind in enumerate(MALFORMED_KINDS * 20):  # every `flowtrain replay --malformed` kind, many times
        payloads.append(malform(events[1500 + i], kind, rng))
    e = events[0]
    edge = [
        json.dumps({**e, "carrier": None}), json.dumps({k: v for k, v in e.items() if k != "tailnum"}),
        json.dumps({k: v for k, v in e.items() if k != "arr_delay"}), json.dumps({**e, "tailnum": None}),
        json.dumps({**e, "distance": float("inf")}), json.dumps({**e, "distance": float("-inf")}),
        json.dumps({**e, "year": True}), json.dumps({**e, "year": 2013.0}), json.dumps({**e, "year": "2013"}),
        json.dumps({**e, "distance": 3}), json.dumps({**e, "flight": 2 ** 53}), json.dumps({**e, "flight": 2 ** 53 + 1}),
        json.dumps({**e, "flight": -(2 ** 53) - 1}), json.dumps({**e, "distance": 9007199254740993.0}),
        json.dumps({**e, "flight": 2 ** 63}), json.dumps({**e, "flight": -(2 ** 63)}),
        json.dumps(e, indent=1), "", "   ", json.dumps(e) + json.dumps(e), json.dumps(e) + " x",
        "\ufeff" + json.dumps(e), json.dumps({**e, "extra": {"a": [1, {"b": [2]}]}}),
        json.dumps({**e, "extra": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}),
        json.dumps({**e, "time_hour": "2013-01-01 10:00:00"}), json.dumps({**e, "time_hour": "2013-1-1T10:00:00Z"}),
        json.dumps({**e, "time_hour": 5}), json.dumps({**e, "carrier": "Ünïcödé ✈"}), json.dumps([e]), "null",
        '{"year": 1, ' + json.dumps(e)[1:],  # a duplicate key
    ]
    payloads += [p.encode() for p in edge] + [None, b"\xff\xfe{}", json.dumps(e).encode().replace(b'"UA"', b'"U\xff"'),
                                              ('{"a":' * 5000 + "1" + "}" * 5000).encode()]
    specials = payloads[1500:]
    # Each special case alone among valid events too (a group the reader rejects is split down to
    # 16 events, so 40 apart no special case hides behind another).
    spaced = [p for i, special in enumerate(specials) for p in
              [json.dumps(x).encode() for x in events[(39 * i) % 1900:(39 * i) % 1900 + 39]] + [special]]
    for batch in (payloads, spaced):
        sources = [("raw", 3, 100 + i) for i in range(len(batch))]
        for bounds in (ParseBounds(), ParseBounds(max_abs_number=5000, max_json_depth=3, max_event_bytes=400)):
            table, letters = parse_batch(batch, sources, bounds)
            expected_table, expected_letters = _row_wise(batch, sources, bounds)
            assert table.num_rows > 500 and table.equals(expected_table)
            assert [(d.source, d.reason, d.payload) for d in letters] == \
                [(d.source, d.reason, d.payload) for d in expected_letters]
            assert len(letters) > 90  # the specials but the valid edge cases and impossible values


def test_status_files_are_read_whole_or_not_at_all_and_cleared(tmp_path):
    """A status file being replaced (.tmp) or cut short is skipped, not read as zeros or an error."""
    from pipelines.stream.status import clear_status, read_status, write_status

    prefix = str(tmp_path / "[run]" / "score-status.json")
    (tmp_path / "[run]").mkdir()
    owner_a, owner_b = object(), object()
    write_status(prefix, owner_a, {"rows": 3}, kind="featurize")
    write_status(prefix, owner_b, {"rows": 4}, kind="featurize")
    write_status(prefix, owner_a, {"version": 2}, kind="versions")
    (tmp_path / "[run]" / "score-status.json.featurize.1-2.tmp").write_text('{"rows": 100}')
    (tmp_path / "[run]" / "score-status.json.featurize.1-3").write_text('{"rows": 1')  # cut short
    assert sorted(s["rows"] for s in read_status(prefix, "featurize")) == [3, 4]
    assert [s["version"] for s in read_status(prefix, "versions")] == [2]
    write_status(None, owner_a, {"rows": 9})  # no prefix: nothing written
    clear_status(prefix)
    assert not read_status(prefix) and not list((tmp_path / "[run]").iterdir())

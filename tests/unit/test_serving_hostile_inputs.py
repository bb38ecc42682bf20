"""Issue 28, items 1, 2 and 9, without a broker or a runner: any record on the model-updates topic
is a rejected update with its reason (never an exception out of ``check_record`` or the scorer's
``VersionTracker``); an event whose carried id is too long, or a prediction too large for a
message, is a dead letter with its reason; the status page counts only verified versions."""
from __future__ import annotations

import json
import logging

import pyarrow as pa
import pytest

KEY = b"k" * 32
GOOD = {"version": 1, "run_id": "run-a", "checkpoint": "/nonexistent/ckpt-000000001.pt", "sha256": "a" * 64,
        "bytes": 10, "step": 1, "sequence": 1_700_000_000_000}


def _signed(record: dict, key: bytes = KEY) -> bytes:
    from connectors.model_updates import sign_record

    return json.dumps(sign_record(record, key)).encode()


def _raw_signed(record_json: str, key: bytes = KEY) -> bytes:
    """A record signed over its own text (NaN and the like, which ``json.dumps`` of Python values writes)."""
    import hashlib
    import hmac

    record = json.loads(record_json)
    canonical = json.dumps(record, sort_keys=True, separators=(",", ":")).encode()
    return json.dumps({**record, "signature": hmac.new(key, canonical, hashlib.sha256).hexdigest()}).encode()


def hostile_records() -> list[bytes | None]:
    """What a hostile or broken producer can put on the updates topic (each malformed; none a version)."""
    deep = 5000
    return [
        None,  # a tombstone
        b"\xff\xfe not json",
        b"",
        b'"just a string"',
        b"[1, 2, 3]",
        b"[" * 30_000 + b"]" * 30_000,  # nesting under the size bound: RecursionError in json.loads
        b'{"a":' * deep + b"1" + b"}" * deep,
        json.dumps({**GOOD, "deep": [[[[[[[[[[[1]]]]]]]]]]]}).encode(),  # deeper than a record is
        _raw_signed(json.dumps({**GOOD, "metrics": {"loss": float("nan")}})),  # NaN: the canonical form fails
        _raw_signed(json.dumps({**GOOD, "version": float("inf")})),
        json.dumps({**GOOD, "time": float("-inf")}).encode(),
        b'{"version": 1e999, "checkpoint": "/x"}',
        json.dumps({**GOOD, "version": 1.5}).encode(),  # not a whole number
        json.dumps({**GOOD, "version": 2.0}).encode(),
        json.dumps({**GOOD, "version": "3"}).encode(),
        json.dumps({**GOOD, "version": True}).encode(),
        json.dumps({**GOOD, "version": 0}).encode(),
        json.dumps({**GOOD, "version": 2 ** 64}).encode(),  # beyond a prediction's int64
        b'{"version": ' + b"9" * 5000 + b', "checkpoint": "/x"}',
        json.dumps({k: v for k, v in GOOD.items() if k != "checkpoint"}).encode(),  # missing keys
        json.dumps({"checkpoint": "/x"}).encode(),
        json.dumps({**GOOD, "checkpoint": ["/x"]}).encode(),  # wrong types
        json.dumps({**GOOD, "checkpoint": "/x\x00y"}).encode(),
        json.dumps({**GOOD, "run_id": {"a": 1}}).encode(),
        json.dumps({**GOOD, "run_id": "r" * 10_000}).encode(),  # copied into every prediction: bounded
        json.dumps({**GOOD, "sha256": "../../../etc/passwd"}).encode(),  # names a file in the scorer's cache
        json.dumps({**GOOD, "bytes": -1}).encode(),
        json.dumps({**GOOD, "sequence": "soon"}).encode(),
        json.dumps({**GOOD, "signature": 42}).encode(),
        json.dumps({**GOOD, "pad": "x" * 70_000}).encode(),  # huge
    ]


def test_item1_any_update_record_is_a_rejection_with_a_reason_never_an_exception():
    from connectors.model_updates import RejectedUpdate, check_record

    for key in (KEY, None):
        for value in hostile_records():
            with pytest.raises(RejectedUpdate) as err:
                check_record(value, key)
            assert str(err.value) and err.value.kind, value[:80] if value else value
    assert check_record(_signed(GOOD), KEY).version == 1  # a good one still verifies


@pytest.mark.parametrize("key", [KEY, None], ids=["with-key", "without-key"])
def test_item1_the_tracker_rejects_every_hostile_record_at_start_and_while_running_logging_once_per_kind(
        key, tmp_path, caplog):
    from pipelines.serving.versions import ModelCache, UpdateMessage, VersionTracker

    def load(*_):
        raise AssertionError("a rejected record never reaches the loader")

    records = hostile_records()
    at_start = [UpdateMessage(f"upd/0/{i}", v, (1_700_000_000_000 + i, 0, i)) for i, v in enumerate(records)]
    running = [UpdateMessage(f"upd/0/{i + len(records)}", v, (1_800_000_000_000 + i, 0, i + len(records)))
               for i, v in enumerate(records)]
    tracker = VersionTracker(load, key=key, cache=ModelCache(tmp_path / "models"), warn_unsigned=False)
    with caplog.at_level(logging.WARNING, logger="pipelines.serving.versions"):
        assert not tracker.offer(at_start)  # a scorer starting with these on the topic
        assert not tracker.offer(running)  # ... and the same arriving while it runs
    assert tracker.current is None and tracker.rejected_count == 2 * len(records)
    assert sum(tracker.rejected_kinds.values()) == 2 * len(records)
    assert all(r["reason"] and r["kind"] for r in tracker.rejected)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and r.name == "pipelines.serving.versions"]
    assert len(warnings) == len(tracker.rejected_kinds)  # each kind logged once, the rest counted
    assert {"tombstone", "not JSON", "malformed", "oversized"} <= set(tracker.rejected_kinds)


def test_item2_an_id_over_max_id_bytes_is_a_dead_letter_before_scoring():
    from connectors.dataset_spec import FeatureSpec
    from connectors.kafka import KafkaRecord
    from pipelines.serving.featurize import featurize_records
    from pipelines.stream.featurize import StreamFeaturizer

    spec = FeatureSpec(label="y", task="regression", numeric=["x"], categorical=["c"])
    stats = {"numeric": {"x": {"mean": 0.0, "std": 1.0}}, "vocab": {"c": ["a", "b"]}, "label_mean": 0.0,
             "label_std": 1.0}
    featurizer = StreamFeaturizer(spec, stats, keep=["order_id"])
    huge = "x" * 1_000_000  # an event just under the 1 MiB event bound
    events = [{"x": 1.0, "c": "a", "y": 2.0, "order_id": "o-1"}, {"x": 2.0, "c": "b", "order_id": huge},
              {"x": 3.0, "c": "a", "order_id": 12345}]
    items = [KafkaRecord("raw", 0, 10 + i, 1_700_000_000_000 + i, None, json.dumps(e).encode())
             for i, e in enumerate(events)]
    batch, letters = featurize_records(items, featurizer, max_id_bytes=1024)
    assert batch.features.column("src_offset").to_pylist() == [10, 12]
    assert batch.features.column("order_id").to_pylist() == ["o-1", "12345"]
    assert len(batch.event_ms) == 2 and batch.dead_letters == 1
    assert [(d.source, d.payload) for d in letters] == [("raw/0/11", items[1].value)]
    assert "1,000,000 bytes, over --max-id-bytes 1,024" in letters[0].reason
    batch, letters = featurize_records(items, featurizer)  # no bound given: carried as it is
    assert batch.features.num_rows == 3 and not letters


def test_item2_a_prediction_too_large_for_a_message_is_left_out_with_the_reason():
    import datetime as dt

    from connectors.arrow import decode_batch
    from connectors.dataset_spec import FeatureSpec
    from pipelines.serving.codec import encode_predictions
    from pipelines.serving.predictions import prediction_layout

    schema = prediction_layout(FeatureSpec(label="y", task="classification", numeric=["x"]), ["a", "b", "c"],
                               "id").schema
    text = [f.name for f in schema if f.type == pa.string()]
    rows = []
    for i in range(5):
        row = {f.name: dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc) if pa.types.is_timestamp(f.type) else
               None if f.nullable else 0 for f in schema}
        row.update({name: f"r{i}" for name in text})
        rows.append(row)
    rows[2][text[0]] = "x" * 1_050_000  # one row larger than any message may be
    preds = pa.RecordBatch.from_pylist(rows, schema=schema)
    messages, kept, unwritable = encode_predictions(preds, 1_000_000)
    assert [i for i, _ in unwritable] == [2]
    assert "cannot be written to the predictions topic" in unwritable[0][1] and "1,000,000 bytes" in unwritable[0][1]
    back = pa.Table.from_batches([decode_batch(m) for m in messages])
    assert back.column(text[1]).to_pylist() == ["r0", "r1", "r3", "r4"] and kept.num_rows == 4
    messages, kept, unwritable = encode_predictions(preds.slice(0, 2), 1_000_000)  # the usual case
    assert len(messages) == 1 and kept.num_rows == 2 and not unwritable


def test_item9_the_status_page_counts_only_verified_versions_and_lists_rejected_ones_with_the_reason():
    from flowtrain.commands.stream.status import UpdateRecords

    seq = 1_700_000_000_000
    real = [_signed({**GOOD, "version": v, "sequence": seq + v}) for v in (1, 2, 3)]
    forged_unsigned = json.dumps({**GOOD, "version": 2 ** 62, "sequence": seq + 99}).encode()
    forged_missigned = _signed({**GOOD, "version": 4_600_000_000_000_000_000, "sequence": seq + 98}, b"x" * 32)
    records = [real[0], real[1], forged_unsigned, forged_missigned, b"{not json", real[2], real[0],
               json.dumps({**GOOD, "version": float("nan")}).encode()]
    page = UpdateRecords(KEY)
    for i, value in enumerate(records):
        page.add(f"upd/0/{i}", value, seq + 1000 + i)
    assert page.newest()["version"] == 3
    assert page.rejected_count == 5
    versions = page.versions(serving=3, scorer_rejected=[{"version": 9, "published_at": "upd/0/3", "reason": "x"}])
    assert [(v["version"], v["state"]) for v in versions if v["state"] != "rejected"] == \
        [(3, "serving"), (2, "published"), (1, "published")]
    rejected = [v for v in versions if v["state"] == "rejected"]
    assert len(rejected) == 5 and all(v["reason"] for v in rejected)  # upd/0/3 once
    assert any("unsigned" in v["reason"] for v in rejected) and any("bad signature" in v["reason"] for v in rejected)
    assert any("not newer than version 3" in v["reason"] for v in rejected)  # the replay of version 1
    assert all((v["version"] or 0) < 10 for v in versions)
    assert "serving" not in {v["state"] for v in page.versions(3, [], serving_run="another-run")}  # per run

    unkeyed = UpdateRecords(None)  # no key: nothing verifies; well-formed records count, marked unsigned
    for i, value in enumerate(records[:2]):
        unkeyed.add(f"upd/0/{i}", value, seq + i)
    assert [v["state"] for v in unkeyed.versions(None, [])] == ["published (unsigned)"] * 2

    unreadable = UpdateRecords(None, key_error="--update-key-file k: refused")  # a key set but unreadable:
    unreadable.add("upd/0/0", records[0], seq)  # nothing verifies, nothing counts as unsigned instead
    assert unreadable.newest() is None and "cannot be verified" in unreadable.rejected[0]["reason"]

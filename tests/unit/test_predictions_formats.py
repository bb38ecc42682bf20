"""The scorer's predictions in the events' format (issue 33, item 2): Avro/Protobuf events give Avro/Protobuf
predictions, ``--predictions-format`` overrides, JSON events keep Arrow record batches."""
from __future__ import annotations

import datetime as dt

import pyarrow as pa
import pytest

from pipelines.serving.codec import PREDICTION_SCHEMA, PredictionsCodec, predictions_format

UTC = dt.timezone.utc


def _preds() -> pa.RecordBatch:
    t0 = dt.datetime(2026, 12, 2, 3, 0, tzinfo=UTC)
    return pa.RecordBatch.from_pylist([
        {"source": "raw/0/5", "src_partition": 0, "src_offset": 5, "id": "r5", "prediction": 0.75,
         "predicted_class": "hot", "probabilities": [0.125, 0.75, 0.125], "model_version": 3, "model_run": "run-a",
         "event_time": t0, "scoring_time": t0 + dt.timedelta(milliseconds=250), "label": 1.0},
        {"source": "raw/1/9", "src_partition": 1, "src_offset": 9, "id": None, "prediction": 0.5,
         "predicted_class": None, "probabilities": None, "model_version": 3, "model_run": "run-a",
         "event_time": t0, "scoring_time": t0, "label": None},
    ], schema=PREDICTION_SCHEMA)


def test_item2_predictions_default_to_the_events_format_and_the_option_overrides():
    assert predictions_format(None, "avro") == "avro" and predictions_format(None, "protobuf") == "protobuf"
    assert predictions_format(None, "json") == "arrow"  # as before formats: one record batch per message
    assert predictions_format("json", "avro") == "json" and predictions_format("arrow", "protobuf") == "arrow"
    with pytest.raises(ValueError, match="--predictions-format 'xml'"):
        predictions_format("xml", "avro")


@pytest.mark.parametrize("fmt", ["arrow", "json", "avro", "protobuf"])
def test_item2_each_predictions_format_writes_one_record_per_prediction_and_reads_back(fmt):
    preds = _preds()
    codec = PredictionsCodec(fmt)
    messages, kept, bad = codec.encode(preds, 1 << 20)
    assert bad == [] and kept.num_rows == 2 and len(messages) == (1 if fmt == "arrow" else 2)
    rows = [r for m in messages for r in codec.decode(m)]
    want = preds.to_pylist()
    for got, exp in zip(rows, want):
        for k, v in exp.items():
            if k in ("event_time", "scoring_time") and fmt in ("json", "protobuf"):
                v = int(v.timestamp() * 1000)  # milliseconds since the epoch
            assert got[k] == v, (fmt, k)


def test_item2_a_prediction_too_large_for_the_topic_is_left_out_with_its_reason():
    codec = PredictionsCodec("avro")
    preds = _preds()
    big = preds.set_column(3, "id", pa.array(["x" * 5000, None]))
    messages, kept, bad = codec.encode(big, 1000)
    assert len(messages) == 1 and kept.column("src_offset").to_pylist() == [9]
    assert bad[0][0] == 0 and "more than the predictions topic takes (1,000)" in bad[0][1]

"""The scorer's predictions in the events' format (issue 33, item 2): Avro/Protobuf events give Avro/Protobuf
predictions, ``--predictions-format`` overrides, JSON events keep Arrow record batches. Issue 45 item 4: the columns
are `flowtrain predict`'s `pred_*` scheme (the dataset's class names in the probability columns, the id and the label
under their own names), in every format."""
from __future__ import annotations

import datetime as dt

import pyarrow as pa
import pytest

from connectors.dataset_spec import FeatureSpec
from pipelines.serving.codec import PredictionsCodec, avro_schema, detect_format, predictions_format
from pipelines.serving.predictions import prediction_layout

UTC = dt.timezone.utc
SPEC = FeatureSpec(label="state", task="classification", numeric=["temp"])
CLASSES = ["cold", "hot", "ok"]


def _preds(layout=None) -> pa.RecordBatch:
    layout = layout or prediction_layout(SPEC, CLASSES, "reading_id")
    t0 = dt.datetime(2026, 12, 2, 3, 0, tzinfo=UTC)
    return pa.RecordBatch.from_pylist([
        {"pred_source": "raw/0/5", "pred_source_partition": 0, "pred_source_offset": 5, "reading_id": "r5",
         "state": "hot", "pred_probability_cold": 0.125, "pred_probability_hot": 0.75, "pred_probability_ok": 0.125,
         "pred_class": "hot", "pred_model_version": 3, "pred_model_run": "run-a", "pred_event_time": t0,
         "pred_scoring_time": t0 + dt.timedelta(milliseconds=250)},
        {"pred_source": "raw/1/9", "pred_source_partition": 1, "pred_source_offset": 9, "reading_id": None,
         "state": None, "pred_probability_cold": 0.5, "pred_probability_hot": 0.25, "pred_probability_ok": 0.25,
         "pred_class": "cold", "pred_model_version": 3, "pred_model_run": "run-a", "pred_event_time": t0,
         "pred_scoring_time": t0},
    ], schema=layout.schema)


def test_item4_the_stream_names_its_columns_as_flowtrain_predict_does():
    layout = prediction_layout(SPEC, CLASSES, "reading_id")
    assert layout.schema.names == [
        "pred_source", "pred_source_partition", "pred_source_offset", "reading_id", "state", "pred_probability_cold",
        "pred_probability_hot", "pred_probability_ok", "pred_class", "pred_model_version", "pred_model_run",
        "pred_event_time", "pred_scoring_time"]
    binary = prediction_layout(FeatureSpec(label="y", task="classification", numeric=["x"]), ["no", "yes"])
    assert binary.schema.names[3:6] == ["y", "pred_probability_yes", "pred_class"]
    regression = prediction_layout(FeatureSpec(label="price", task="regression", numeric=["x"]), None, "id")
    assert regression.schema.names[3:6] == ["id", "price", "pred_value"]
    # an event column with one of flowtrain's names keeps it; flowtrain's takes the first free suffix
    taken = prediction_layout(SPEC, CLASSES, "pred_class")
    assert "pred_class" in taken.schema.names and taken.names.klass == "pred_class_1"


def test_item2_predictions_default_to_the_events_format_and_the_option_overrides():
    assert predictions_format(None, "avro") == "avro" and predictions_format(None, "protobuf") == "protobuf"
    assert predictions_format(None, "json") == "arrow"  # as before formats: one record batch per message
    assert predictions_format("json", "avro") == "json" and predictions_format("arrow", "protobuf") == "arrow"
    with pytest.raises(ValueError, match="--predictions-format 'xml'"):
        predictions_format("xml", "avro")


@pytest.mark.parametrize("fmt", ["arrow", "json", "avro", "protobuf"])
def test_item2_each_predictions_format_writes_one_record_per_prediction_and_reads_back(fmt):
    preds = _preds()
    codec = PredictionsCodec(fmt, schema=preds.schema)
    messages, kept, bad = codec.encode(preds, 1 << 20)
    assert bad == [] and kept.num_rows == 2 and len(messages) == (1 if fmt == "arrow" else 2)
    assert {detect_format(m) for m in messages} == {"arrow" if fmt == "arrow" else "json" if fmt == "json" else None}
    rows = [r for m in messages for r in codec.decode(m)]
    want = preds.to_pylist()
    for got, exp in zip(rows, want):
        assert list(got) == list(exp), fmt  # the same columns, in order
        for k, v in exp.items():
            if k in ("pred_event_time", "pred_scoring_time") and fmt in ("json", "protobuf"):
                v = int(v.timestamp() * 1000)  # milliseconds since the epoch
            assert got[k] == v, (fmt, k)


def test_item4_avro_and_protobuf_name_fields_only_as_they_can():
    bad = prediction_layout(FeatureSpec(label="y", task="classification", numeric=["x"]), ["no way", "ok", "yes"])
    for fmt in ("avro", "protobuf"):
        with pytest.raises(ValueError, match=f"--predictions-format {fmt}: column.s. 'pred_probability_no way' cannot "
                                             f"be {fmt} field names"):
            PredictionsCodec(fmt, schema=bad.schema)
    PredictionsCodec("json", schema=bad.schema)  # JSON and Arrow take any name
    fields = {f["name"]: f["type"] for f in avro_schema(_preds().schema)["fields"]}
    assert fields["pred_source_offset"] == "long" and fields["pred_class"] == ["null", "string"]
    assert fields["pred_event_time"] == {"type": "long", "logicalType": "timestamp-millis"}


def test_item2_a_prediction_too_large_for_the_topic_is_left_out_with_its_reason():
    preds = _preds()
    codec = PredictionsCodec("avro", schema=preds.schema)
    big = preds.set_column(3, "reading_id", pa.array(["x" * 5000, None]))
    messages, kept, bad = codec.encode(big, 1000)
    assert len(messages) == 1 and kept.column("pred_source_offset").to_pylist() == [9]
    assert bad[0][0] == 0 and "more than the predictions topic takes (1,000)" in bad[0][1]


@pytest.mark.parametrize("fmt", ["arrow", "json", "avro", "protobuf"])
def test_item4_flowtrain_predictions_reads_every_format_back_as_the_scorers_table(fmt, tmp_path):
    """`flowtrain predictions` decodes a topic's messages (without a broker here: its decoder and writer on the
    scorer's own messages): the same columns and values in every format, Avro/Protobuf given the dataset."""
    import json

    import pyarrow.parquet as pq

    from connectors.dataset import FORMAT
    from flowtrain.commands.stream.predictions import PredictionsJob
    from flowtrain.commands.stream.predictions_read import _Decoder, _Writer

    preds = _preds()
    messages, _, _ = PredictionsCodec(fmt, schema=preds.schema).encode(preds, 1 << 20)
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "_manifest.json").write_text(json.dumps({"format": FORMAT, "spec": SPEC.to_dict(),
                                                                "stats": {"classes": CLASSES}}))
    job = PredictionsJob(topic="t", predictions_format="auto" if fmt in ("arrow", "json") else fmt,
                         dataset=str(tmp_path / "ds"), id_column="reading_id")
    tables = list(_Decoder(job).tables(messages))
    got = pa.concat_tables(tables)
    assert got.column_names == preds.schema.names
    assert got.to_pylist() == pa.Table.from_batches([preds]).to_pylist()
    writer = _Writer(str(tmp_path / "p.parquet"))
    for table in tables:
        writer.write(table)
    writer.close()
    assert pq.read_table(tmp_path / "p.parquet").num_rows == 2


def test_item4_bare_avro_without_the_dataset_or_a_registry_says_what_to_give():
    from flowtrain.commands.stream.predictions import PredictionsJob
    from flowtrain.commands.stream.predictions_read import _Decoder
    from flowtrain.errors import FlowtrainError

    preds = _preds()
    messages, _, _ = PredictionsCodec("avro", schema=preds.schema).encode(preds, 1 << 20)
    with pytest.raises(FlowtrainError, match="neither an Arrow record batch nor JSON: give --predictions-format"):
        list(_Decoder(PredictionsJob(topic="t")).tables(messages))
    with pytest.raises(FlowtrainError, match="give --schema-registry URL .* or --dataset DIR"):
        list(_Decoder(PredictionsJob(topic="t", predictions_format="avro")).tables(messages))


def test_item4_flowtrain_predictions_without_a_broker_is_one_line(capsys):
    from flowtrain.cli.main import main

    assert main(["predictions", "--topic", "p", "--bootstrap", "127.0.0.1:1", "--connect-timeout", "1"]) == 2
    assert capsys.readouterr().err.startswith("flowtrain predictions: no Kafka broker answered at 127.0.0.1:1 within")

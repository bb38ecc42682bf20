"""Issue 33 items 1-3 and the formats half of 5: Avro and Protobuf events with a real Schema Registry
(Apicurio, the session's ``schema_registry``) on the real broker. ``flowtrain replay`` writes the same sensor
rows as JSON, as Avro (in the wire format, through one schema evolution step mid-stream) and as Protobuf;
the stream's featurizer (what the fused pipeline step and the scorer run on each micro-batch) gives the same
training rows and the batch model the same predictions (<= 1e-6) from each topic. Bad records are dead
letters with their reason, never an exception."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import uuid

import numpy as np
import pyarrow as pa
import pytest
import torch

from tests.kafka_checks import committed
from tests.procs import stop_group
from tests.scoring_helpers import CLI, batch_model, events, read_topic
from tests.sensor_data import write_csv

pytestmark = [pytest.mark.kafka, pytest.mark.streaming, pytest.mark.timeout(420)]
N = 300


@pytest.fixture(scope="module")
def sensor(shared_data):
    from flowtrain.train.loader import TabularDataset

    dataset, run, _ = shared_data.sensor_run(rows=1500, epochs=6)
    return {"dataset": dataset, "run": run, "data": TabularDataset(dataset)}


def _replay(bootstrap, sensor, csv, topic, *extra):
    from flowtrain.cli.main import main

    rc = main(["replay", "--input", str(csv), "--dataset", sensor["dataset"], "--topic", topic, "--partitions", "1",
               "--bootstrap", bootstrap, *extra])
    assert rc == 0


def _featurize(bootstrap, sensor, topic, fmt, registry=None):
    from connectors.dataset import read_manifest
    from connectors.dataset_spec import FeatureSpec
    from pipelines.stream.featurize import StreamFeaturizer

    manifest = read_manifest(sensor["dataset"])
    featurizer = StreamFeaturizer(FeatureSpec.from_dict(manifest["spec"]), manifest["stats"], keep=["reading_id"],
                                  event_format=fmt, schema_registry=registry)
    records = read_topic(bootstrap, topic)
    return featurizer.featurize_payloads([r.value for r in records], [(r.topic, r.partition, r.offset)
                                                                      for r in records])


def _predictions(sensor, features: pa.RecordBatch) -> np.ndarray:
    from flowtrain.train.loader import table_to_split
    from flowtrain.train.models import Architecture

    arch, state = batch_model(sensor)
    model = Architecture.from_dict(arch, "test").build(sensor["data"])
    model.load_state_dict(state)
    model.eval()
    split = table_to_split(pa.Table.from_batches([features]), sensor["data"].spec)
    with torch.no_grad():
        return torch.softmax(model(split.x_num, split.x_cat), dim=1).numpy()


def _pipeline_rows(bootstrap, sensor, raw_topic, tmp_path, *extra) -> dict:
    """``flowtrain stream pipeline`` (Prism) over the whole raw topic: the features topic's rows, in offset order."""
    import subprocess
    import time

    from connectors.arrow import decode_batch

    tag = uuid.uuid4().hex[:6]
    features, group, out = f"fmt-feat-{tag}", f"fmt-g-{tag}", tmp_path / f"pipe-{tag}"
    out.mkdir()
    log = out / "pipeline.log"
    with open(log, "ab") as fh:
        proc = subprocess.Popen(CLI + ["stream", "pipeline", "--bootstrap", bootstrap, "--raw-topic", raw_topic,
                                       "--features-topic", features, "--dead-letter-topic", f"fmt-dead-{tag}",
                                       "--group-id", group, "--dataset", sensor["dataset"], "--out", str(out),
                                       "--batch-size", "100", *extra],
                                stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            done, end = committed(bootstrap, raw_topic, group)
            if end and done == end:
                break
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"{done}/{end}\n{log.read_text()[-3000:]}"
            time.sleep(1)
    finally:
        stop_group(proc)
    batches = [decode_batch(r.value) for r in read_topic(bootstrap, features)]
    table = pa.Table.from_batches(batches).sort_by("src_offset")
    return {c: table.column(c).to_pylist() for c in table.column_names}


def _rows(out) -> dict:
    training = out.training()
    return {c: training.column(c).to_pylist() for c in training.schema.names if c not in ("source", "src_partition",
                                                                                         "src_offset")}


def _dataset_proto(dataset) -> str:
    import contextlib
    import io

    from flowtrain.cli.main import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["schema", "--dataset", dataset, "--format", "protobuf"]) == 0
    return buf.getvalue()


def _schema_files(tmp_path, dataset):
    """v1: the dataset's schema with an unused field and ``machine`` as an int; v2: that field removed, an optional
    one added, ``machine`` widened to long; v3: ``temp`` (a required feature) dropped."""
    from connectors.dataset import read_manifest
    from connectors.dataset_spec import FeatureSpec
    from pipelines.stream.events import event_schema
    from pipelines.stream.formats import avro_schema

    base = avro_schema(event_schema(FeatureSpec.from_dict(read_manifest(dataset)["spec"])), "sensors")
    base["fields"].append({"name": "reading_id", "type": ["null", "string"], "default": None})

    def typed(fields, name, t):
        return [{**f, "type": ["null", t]} if f["name"] == name else f for f in fields]

    v1 = {**base, "fields": typed(base["fields"], "machine", "int")
          + [{"name": "operator", "type": ["null", "string"], "default": None}]}
    v2 = {**base, "fields": typed(base["fields"], "machine", "long")
          + [{"name": "firmware", "type": ["null", "string"], "default": None}]}
    v3 = {**base, "fields": [f for f in base["fields"] if f["name"] != "temp"]}
    paths = []
    for i, schema in enumerate((v1, v2, v3), 1):
        path = tmp_path / f"v{i}.avsc"
        path.write_text(json.dumps(schema))
        paths.append(str(path))
    return paths


def test_item5_avro_with_registry_through_schema_evolution_and_protobuf_give_the_json_rows_and_predictions(
        bootstrap, schema_registry, sensor, tmp_path):
    rows = events(N, seed=3)  # every 10th without its label
    cols = list(rows[0])
    csv = write_csv(tmp_path / "events.csv", [{c: r.get(c) for c in cols} for r in rows])
    tag = uuid.uuid4().hex[:6]
    topics = {f: f"fmt-{f}-{tag}" for f in ("json", "avro", "protobuf")}
    v1, v2, v3 = _schema_files(tmp_path, sensor["dataset"])
    _replay(bootstrap, sensor, csv, topics["json"])
    reg = ["--schema-registry", schema_registry]
    _replay(bootstrap, sensor, csv, topics["avro"], "--event-format", "avro", *reg, "--schema-file", v1,
            "--limit", str(N // 2))
    _replay(bootstrap, sensor, csv, topics["avro"], "--event-format", "avro", *reg, "--schema-file", v2,
            "--skip", str(N // 2))
    proto = tmp_path / "sensors.proto"  # the dataset's message with the id the scorer carries
    proto.write_text(_dataset_proto(sensor["dataset"]).replace("}", "  optional string reading_id = 99;\n}"))
    _replay(bootstrap, sensor, csv, topics["protobuf"], "--event-format", "protobuf", *reg, "--schema-file", str(proto))

    ref = _featurize(bootstrap, sensor, topics["json"], "json")
    assert ref.training() is not None and ref.training().num_rows > N // 2
    ref_pred = _predictions(sensor, ref.features)
    for fmt in ("avro", "protobuf"):
        out = _featurize(bootstrap, sensor, topics[fmt], fmt, schema_registry)
        assert [d.reason for d in out.dead_letters] == [d.reason for d in ref.dead_letters], fmt
        assert out.unlabelled == ref.unlabelled, fmt
        got, want = _rows(out), _rows(ref)
        assert set(got) == set(want)
        for col in want:
            if isinstance(want[col][0], float):
                np.testing.assert_allclose(np.array(got[col], float), np.array(want[col], float), atol=1e-6,
                                           err_msg=f"{fmt} {col}")
            else:
                assert got[col] == want[col], (fmt, col)
        np.testing.assert_allclose(_predictions(sensor, out.features), ref_pred, atol=1e-6, err_msg=fmt)

    # the streaming feature pipeline itself (Prism) on the Avro topic: the features topic holds the JSON run's rows
    features = _pipeline_rows(bootstrap, sensor, topics["avro"], tmp_path, "--event-format", "avro", *reg)
    want = _rows(ref)
    for col in ("label", *[c for c in want if c.startswith(("num__", "cat__"))]):
        np.testing.assert_allclose(np.array(features[col], float), np.array(want[col], float), atol=1e-6,
                                   err_msg=f"pipeline {col}")

    # the registry holds both writer schemas of the Avro topic, the Protobuf one under its subject
    from pipelines.stream.formats import SchemaRegistry

    client = SchemaRegistry(schema_registry)
    assert client._call("GET", f"/subjects/{topics['avro']}-value/versions") == [1, 2]
    assert client._call("GET", f"/subjects/{topics['protobuf']}-value/versions") == [1]

    # a schema that drops a required feature: its events are dead letters naming the field, the stream goes on
    bad_topic = f"fmt-bad-{tag}"
    _replay(bootstrap, sensor, csv, bad_topic, "--event-format", "avro", *reg, "--schema-file", v3, "--limit", "5")
    out = _featurize(bootstrap, sensor, bad_topic, "avro", schema_registry)
    assert out.features is None and len(out.dead_letters) == 5
    assert all("drops required field(s) temp" in d.reason for d in out.dead_letters), out.dead_letters[0].reason


@pytest.mark.parametrize("part", ["pipeline", "score"])
def test_item3_a_registry_that_is_down_makes_the_stream_job_wait_and_sigterm_stops_it(bootstrap, sensor, tmp_path,
                                                                                       part):
    """``stream pipeline`` / ``stream score`` with ``--schema-registry`` on a closed loopback port: the job says
    once that it waits for the registry (as for brokers), keeps waiting (no failure), and SIGTERM stops it at
    once with exit status 0 and a line saying nothing was read. (The shared session registry is never stopped.)"""
    from connectors.kafka import ensure_topic

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: every connection is refused
    url = f"http://127.0.0.1:{port}/apis/ccompat/v7"
    tag = uuid.uuid4().hex[:6]
    raw = f"fmt-down-{tag}"
    ensure_topic(bootstrap, raw, partitions=1)
    out = tmp_path / "run"
    out.mkdir()
    topics = (["--features-topic", f"{raw}-f", "--dead-letter-topic", f"{raw}-d", "--group-id", f"g-{tag}"]
              if part == "pipeline" else
              ["--updates-topic", f"{raw}-u", "--predictions-topic", f"{raw}-p", "--score-dead-letter-topic",
               f"{raw}-sd", "--score-group-id", f"sg-{tag}"])
    log = out / "job.log"
    proc = subprocess.Popen(CLI + ["stream", part, "--bootstrap", bootstrap, "--raw-topic", raw, *topics,
                                   "--dataset", sensor["dataset"], "--out", str(out), "--event-format", "avro",
                                   "--schema-registry", url],
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "waiting for schema registry" not in log.read_text(errors="replace"):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        time.sleep(3)  # it keeps waiting: not a failure, and one line for the outage
        text = log.read_text(errors="replace")
        assert proc.poll() is None, text[-3000:]
        assert text.count("waiting for schema registry") == 1, text[-3000:]
        assert f"stream {part}: waiting for schema registry {url} (URLError: [Errno 111] Connection refused)" in text
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()[-3000:]
        assert f"stream {part}: stopped while waiting for the schema registry; nothing was read" in log.read_text()
    finally:
        stop_group(proc)


def test_item3_wrong_magic_byte_truncated_payload_and_unknown_schema_id_are_dead_letters(schema_registry, sensor):
    from connectors.dataset import read_manifest
    from connectors.dataset_spec import FeatureSpec
    from pipelines.stream.events import event_schema
    from pipelines.stream.formats import event_format, frame

    spec = FeatureSpec.from_dict(read_manifest(sensor["dataset"])["spec"])
    good = {"ts": "2024-03-01T00:00:00", "temp": 61.0, "pressure": 1.1, "humidity": 40.0, "site": "north",
            "machine": 3, "state": "ok"}
    for name in ("avro", "protobuf"):
        writer = event_format(name, event_schema(spec), registry=schema_registry, subject=f"bad-{name}-value")
        value = writer.encode(good)
        reader = event_format(name, event_schema(spec), registry=schema_registry)
        payloads = [value, b"\x01" + value[1:], value[:-3], frame(987654, value[5:], None if name == "avro" else (0,)),
                    b"\x00\x00", None, b'{"temp": 1}']
        table, letters = reader.decode(payloads, [("t", 0, i) for i in range(len(payloads))])
        assert table.num_rows == 1 and table.column("temp").to_pylist() == [61.0], name
        reasons = [d.reason for d in letters]
        assert len(reasons) == 6, (name, reasons)
        assert "magic byte 1" in reasons[0]
        assert "truncated" in reasons[1] or "undecodable" in reasons[1], reasons[1]
        assert reasons[2].startswith("unknown schema id 987654"), reasons[2]
        assert "truncated" in reasons[3] and "no value" in reasons[4] and "magic byte 123" in reasons[5]


def test_item2_the_scorer_reads_avro_events_from_the_registry_and_predicts_what_json_events_give(
        bootstrap, schema_registry, sensor, tmp_path):
    """``flowtrain stream score --event-format avro --schema-registry`` (Prism) on events a producer wrote with an
    evolved schema: every event predicted (by its id) as the batch model predicts the JSON events' features; the
    predictions are Avro records in the wire format, their schema registered under ``<predictions topic>-value``."""
    import flowtrain
    from connectors.kafka import ensure_topic
    from pipelines.stream.formats import SchemaRegistry
    from tests.procs import stop_group
    from tests.scoring_helpers import KEY, dead_letters, probabilities, publish, publisher, scorer, topic_names

    rows = events(120, seed=4)
    cols = list(rows[0])
    csv = write_csv(tmp_path / "events.csv", [{c: r.get(c) for c in cols} for r in rows])
    names = topic_names()
    ensure_topic(bootstrap, names["updates"])
    _, v2, _ = _schema_files(tmp_path, sensor["dataset"])
    _replay(bootstrap, sensor, csv, names["raw"], "--event-format", "avro", "--schema-registry", schema_registry,
            "--schema-file", v2)
    json_topic = f"fmt-scorejson-{uuid.uuid4().hex[:6]}"
    _replay(bootstrap, sensor, csv, json_topic)
    ref = _featurize(bootstrap, sensor, json_topic, "json")
    want = dict(zip(ref.features.column("reading_id").to_pylist(), _predictions(sensor, ref.features)))

    key_file = tmp_path / "update.key"
    key_file.write_bytes(KEY)
    key_file.chmod(0o600)
    arch, state = batch_model(sensor)
    publish(bootstrap, names, publisher({"key_file": str(key_file)}, tmp_path / "trainer"), 1, arch, state)
    proc = scorer(bootstrap, names, sensor["dataset"], tmp_path / "run", "--update-key-file", str(key_file),
                  "--event-format", "avro", "--schema-registry", schema_registry)
    log = tmp_path / "run" / "scorer.log"
    deadline = time.monotonic() + 180
    try:
        while True:  # until predictions + dead letters cover every raw event
            messages = read_topic(bootstrap, names["pred"])
            # the predictions topic as a table (`flowtrain predictions`, #45 item 4), Avro through the registry
            preds = flowtrain.predictions(names["pred"], bootstrap=bootstrap, predictions_format="avro",
                                          schema_registry=schema_registry).to_pylist() if messages else []
            if len({p["pred_source"] for p in preds} | {d["source"] for d in dead_letters(bootstrap, names["dead"])}) \
                    >= len(rows):
                break
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, f"{len(preds)} predictions of {len(rows)}\n{log.read_text()[-3000:]}"
            time.sleep(0.5)
    finally:
        stop_group(proc)
    messages = read_topic(bootstrap, names["pred"])  # all of them, the scorer stopped
    table = flowtrain.predictions(names["pred"], bootstrap=bootstrap, predictions_format="avro",
                                  schema_registry=schema_registry)
    preds = table.to_pylist()
    assert len(messages) == len(preds)  # one Avro record per prediction, not Arrow batches
    ids = {int.from_bytes(m.value[1:5], "big") for m in messages}
    assert len(ids) == 1 and messages[0].value[0] == 0  # the wire format: magic byte, one registered schema id
    kind, text = SchemaRegistry(schema_registry).schema(ids.pop())
    assert kind == "AVRO" and json.loads(text)["name"] == "Prediction"
    classes = sensor["data"].classes
    assert table.column_names[:4] == ["pred_source", "pred_source_partition", "pred_source_offset", "reading_id"]
    assert [c for c in table.column_names if c.startswith("pred_probability_")] == [
        f"pred_probability_{c}" for c in classes]  # flowtrain predict's names, the dataset's classes
    assert {p["reading_id"] for p in preds} == set(want)
    for p in preds:
        np.testing.assert_allclose(probabilities(p, classes), want[p["reading_id"]], atol=1e-6, err_msg=p["reading_id"])


@pytest.mark.parametrize("fmt", ["avro", "protobuf"])
def test_item2_the_predictions_schema_registers_and_a_registry_aware_reader_reads_the_predictions(
        schema_registry, fmt):
    """The scorer's Avro / Protobuf prediction schema is accepted by the real registry (Apicurio) and a reader that
    knows only the registry (the schema by the record's id) reads the predictions back."""
    import datetime as dt

    from connectors.dataset_spec import FeatureSpec
    from pipelines.serving.codec import PredictionsCodec
    from pipelines.serving.predictions import prediction_layout
    from pipelines.stream.formats import SchemaRegistry

    t0 = dt.datetime(2026, 12, 2, 3, 0, tzinfo=dt.timezone.utc)
    layout = prediction_layout(FeatureSpec(label="state", task="classification", numeric=["temp"]),
                               ["cold", "hot", "ok"], "reading_id")
    preds = pa.RecordBatch.from_pylist([
        {"pred_source": "raw/0/5", "pred_source_partition": 0, "pred_source_offset": 5, "reading_id": "r5",
         "state": "hot", "pred_probability_cold": 0.125, "pred_probability_hot": 0.75, "pred_probability_ok": 0.125,
         "pred_class": "hot", "pred_model_version": 3, "pred_model_run": "run-a", "pred_event_time": t0,
         "pred_scoring_time": t0}], schema=layout.schema)
    subject = f"fmt-pred-{uuid.uuid4().hex[:6]}-value"
    writer = PredictionsCodec(fmt, SchemaRegistry(schema_registry), subject, layout.schema)
    messages, _, bad = writer.encode(preds, 1 << 20)
    assert not bad and len(messages) == 1 and messages[0][0] == 0
    got = PredictionsCodec(fmt, SchemaRegistry(schema_registry)).decode(messages[0])[0]  # the schema by its id
    assert got["pred_source"] == "raw/0/5" and got["pred_probability_hot"] == 0.75 and got["state"] == "hot"
    assert got["pred_class"] == "hot" and got["pred_model_version"] == 3 and got["reading_id"] == "r5"

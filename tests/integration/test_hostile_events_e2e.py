"""Issue 44 items 1 and 3 end to end: hostile Avro events on a real topic, the schemas in the real registry
(Apicurio, the session's ``schema_registry``), ``flowtrain stream pipeline`` and ``flowtrain stream score`` on
Kafka + Prism, then ``stream train`` on what the pipeline wrote. Among 60 good events (a producer's, through the
registry) the raw topic holds:

* an event nested 6,000 deep through a recursive schema (about 48 KB; it ended the process with SIGSEGV),
* an event of a schema the registry accepted but Python cannot parse (arrays nested 1,000 deep:
  ``RecursionError``, which raised out of the decoder and failed every retry of that offset),
* an event of a schema nesting 40 records (more than the documented 32),
* an event of a schema id the registry does not know.

One job each (module-scoped), several assertions: both stay up, each hostile event is a dead letter with its
reason in the pipeline and in the scorer, every good event is a prediction and every labelled one a features row exactly once, and
the trainer trains every labelled one exactly once (its ledger)."""
from __future__ import annotations

import json
import subprocess
import time
import uuid
from collections import Counter

import pytest
from kafka import KafkaProducer

from tests.hostile_registry import nested_event, recursive_schema
from tests.kafka_checks import committed
from tests.procs import stop_group
from tests.scoring_helpers import (
    CLI,
    KEY,
    batch_model,
    dead_letters,
    events,
    publish,
    publisher,
    read_topic,
    scorer,
)
from tests.sensor_data import write_csv

pytestmark = [pytest.mark.kafka, pytest.mark.streaming, pytest.mark.timeout(600)]
GOOD = 60


def _nested_records(n: int) -> dict:
    t = "long"
    for i in range(n):
        t = {"type": "record", "name": f"L{i}", "fields": [{"name": "v", "type": t}]}
    return t


@pytest.fixture(scope="module")
def hostile(bootstrap, schema_registry, tmp_path_factory):
    """The sensor dataset and its batch model, and the raw topic: 30 good events, the 4 hostile ones, 30 more."""
    from connectors.dataset import read_manifest
    from connectors.dataset_spec import FeatureSpec
    from flowtrain.cli.main import main
    from flowtrain.train.loader import TabularDataset
    from pipelines.stream.events import event_schema
    from pipelines.stream.formats import SchemaRegistry, avro_schema, frame
    from tests.sensor_data import make_sensor_run

    base = tmp_path_factory.mktemp("hostile")
    dataset, run, _ = make_sensor_run(base, rows=600, epochs=1)
    sensor = {"dataset": dataset, "run": run, "data": TabularDataset(dataset)}
    spec = FeatureSpec.from_dict(read_manifest(dataset)["spec"])
    fields = event_schema(spec)
    writer = avro_schema(fields, "sensors")
    writer["fields"].append({"name": "reading_id", "type": ["null", "string"], "default": None})
    (base / "writer.avsc").write_text(json.dumps(writer))
    rows = events(GOOD, seed=7)
    csv = write_csv(base / "events.csv", [{c: r.get(c) for c in rows[0]} for r in rows])
    tag = uuid.uuid4().hex[:6]
    raw = f"hostile-raw-{tag}"
    registry = SchemaRegistry(schema_registry)
    ids = {"recursive": registry.register(f"{raw}-recursive", json.dumps(recursive_schema(fields)), "AVRO"),
           "deep json": registry.register(f"{raw}-deepjson", '{"type": "array", "items": ' * 1000 + '"long"'
                                          + "}" * 1000, "AVRO"),
           "40 records": registry.register(f"{raw}-nested", json.dumps(_nested_records(40)), "AVRO")}
    ids["unknown"] = max(ids.values()) + 100_000
    hostile_values = [nested_event(ids["recursive"], len(fields.fields), 6000), frame(ids["deep json"], b"\x02"),
                      frame(ids["40 records"], b"\x02"), frame(ids["unknown"], b"\x00")]

    def replay(*extra):
        assert main(["replay", "--input", csv, "--dataset", dataset, "--topic", raw, "--partitions", "1",
                     "--bootstrap", bootstrap, "--event-format", "avro", "--schema-registry", schema_registry,
                     "--schema-file", str(base / "writer.avsc"), *extra]) == 0

    replay("--limit", str(GOOD // 2))
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    for value in hostile_values:
        producer.send(raw, value=value).get(timeout=30)
    producer.close()
    replay("--skip", str(GOOD // 2))
    hostile_offsets = dict(zip(ids, range(GOOD // 2, GOOD // 2 + len(hostile_values))))
    offsets = [o for o in range(GOOD + len(hostile_values)) if o not in hostile_offsets.values()]
    # a good event without pressure is the dataset's own dead letter (as in the batch ETL), in both parts
    good = {o for o, r in zip(offsets, rows) if r["pressure"] is not None}
    labelled = {o for o, r in zip(offsets, rows) if o in good and r.get("state") is not None}
    return {"sensor": sensor, "raw": raw, "ids": ids, "hostile": hostile_offsets, "good": good,
            "no_pressure": set(offsets) - good, "labelled": labelled, "base": base, "url": schema_registry,
            "ids_of_good": {r["reading_id"] for o, r in zip(offsets, rows) if o in good}}


def _expected_reasons(h) -> dict[str, str]:
    ids = h["ids"]
    return {"recursive": f"schema id {ids['recursive']}: refused: the Avro schema is recursive: flowtrain.Event > "
                         f"flowtrain.Event",
            "deep json": f"schema id {ids['deep json']}: nested too deeply to be read",
            "40 records": f"schema id {ids['40 records']}: refused: the Avro schema nests more than 32 levels",
            "unknown": f"unknown schema id {ids['unknown']}: the schema registry {h['url']} does not know it"}


@pytest.fixture(scope="module")
def jobs(bootstrap, hostile):
    """``stream pipeline`` and ``stream score`` (both on Prism, at once) over the whole raw topic; the scorer serves
    the batch model, published as the trainer publishes a version. Both must still run once everything is read."""
    from connectors.kafka import ensure_topic
    from pipelines.serving.codec import PredictionsCodec
    from pipelines.stream.formats import SchemaRegistry

    base, raw, tag = hostile["base"], hostile["raw"], uuid.uuid4().hex[:6]
    pipe = {"features": f"hostile-feat-{tag}", "dead": f"hostile-dead-{tag}", "group": f"hostile-g-{tag}"}
    score = {"raw": raw, "pred": f"hostile-pred-{tag}", "dead": f"hostile-sdead-{tag}", "updates": f"hostile-upd-{tag}",
             "group": f"hostile-sg-{tag}"}
    ensure_topic(bootstrap, score["updates"])
    key_file = base / "update.key"
    key_file.write_bytes(KEY)
    key_file.chmod(0o600)
    arch, state = batch_model(hostile["sensor"])
    publish(bootstrap, score, publisher({"key_file": str(key_file)}, base / "trainer"), 1, arch, state)
    out = base / "pipeline"
    out.mkdir()
    log = out / "pipeline.log"
    pipeline = subprocess.Popen(
        CLI + ["stream", "pipeline", "--bootstrap", bootstrap, "--raw-topic", raw, "--features-topic",
               pipe["features"], "--dead-letter-topic", pipe["dead"], "--group-id", pipe["group"], "--dataset",
               hostile["sensor"]["dataset"], "--out", str(out), "--batch-size", "16", "--event-format", "avro",
               "--schema-registry", hostile["url"]],
        stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)
    scoring = scorer(bootstrap, score, hostile["sensor"]["dataset"], base / "scorer", "--update-key-file",
                     str(key_file), "--event-format", "avro", "--schema-registry", hostile["url"])
    score_log = base / "scorer" / "scorer.log"
    codec = PredictionsCodec("avro", SchemaRegistry(hostile["url"]))  # with a registry: Avro records, as the events

    def predictions(topic) -> list[dict]:
        return [p for m in read_topic(bootstrap, topic) for p in codec.decode(m.value)]

    n = len(hostile["good"]) + len(hostile["no_pressure"]) + len(hostile["hostile"])
    try:
        deadline = time.monotonic() + 300
        while True:
            done, end = committed(bootstrap, raw, pipe["group"])
            preds, dead = predictions(score["pred"]), dead_letters(bootstrap, score["dead"])
            if end and done == end and len({p["pred_source"] for p in preds} | {d["source"] for d in dead}) >= n:
                break
            for proc, where in ((pipeline, log), (scoring, score_log)):
                assert proc.poll() is None, f"{where.name} ended: {where.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"pipeline {done}/{end}, scorer {len(preds)} + {len(dead)}\n" \
                                                f"{log.read_text()[-2000:]}\n{score_log.read_text()[-2000:]}"
            time.sleep(1)
        time.sleep(3)  # a while longer: still up, nothing more written
        alive = {"pipeline": pipeline.poll() is None, "scorer": scoring.poll() is None}
    finally:
        stop_group(pipeline)
        stop_group(scoring)
    from connectors.arrow import decode_batch

    features = [row for m in read_topic(bootstrap, pipe["features"]) for row in decode_batch(m.value).to_pylist()]
    return {"alive": alive, "features": features, "pipeline_dead": dead_letters(bootstrap, pipe["dead"]),
            "predictions": predictions(score["pred"]), "scorer_dead": dead_letters(bootstrap, score["dead"]),
            "pipe": pipe}


def _by_offset(letters) -> dict[int, str]:
    out = {}
    for d in letters:
        offset = int(d["source"].rsplit("/", 1)[1])
        assert offset not in out, f"offset {offset} dead-lettered twice"
        out[offset] = d["reason"]
    return out


def test_item1_item3_the_pipeline_and_the_scorer_stay_up(jobs):
    assert jobs["alive"] == {"pipeline": True, "scorer": True}


@pytest.mark.parametrize("part", ["pipeline", "scorer"])
def test_item1_item3_each_hostile_event_is_a_dead_letter_with_its_reason(jobs, hostile, part):
    reasons = _by_offset(jobs[f"{part}_dead"])
    assert set(reasons) == set(hostile["hostile"].values()) | hostile["no_pressure"], reasons
    for name, want in _expected_reasons(hostile).items():
        assert reasons[hostile["hostile"][name]].startswith(want), (name, reasons[hostile["hostile"][name]])
    assert all(reasons[o].startswith("numeric feature 'pressure'") for o in hostile["no_pressure"]), reasons


def test_item1_item3_every_good_event_is_a_prediction_and_each_labelled_one_a_features_row_exactly_once(jobs, hostile):
    rows = Counter(r["src_offset"] for r in jobs["features"])  # a training row per labelled one (an unlabelled
    assert set(rows) == hostile["labelled"] and set(rows.values()) == {1}  # event is counted as such, scored only)
    preds = Counter(int(p["pred_source"].rsplit("/", 1)[1]) for p in jobs["predictions"])
    assert set(preds) == set(hostile["good"]) and set(preds.values()) == {1}
    assert {p["reading_id"] for p in jobs["predictions"]} == hostile["ids_of_good"]  # the --id-column, by its name


def test_item1_item3_the_trainer_trains_every_labelled_event_exactly_once(bootstrap, jobs, hostile):
    """``stream train`` on the pipeline's features topic (from the batch model), until it is idle: its ledger
    holds every labelled good event once (the hostile ones never reached it)."""
    out = hostile["base"] / "train"
    pipe = jobs["pipe"]
    proc = subprocess.run(CLI + ["stream", "train", "--bootstrap", bootstrap, "--raw-topic", hostile["raw"],
                                 "--features-topic", pipe["features"], "--dead-letter-topic", f"{pipe['dead']}-t",
                                 "--updates-topic", f"{pipe['features']}-u", "--group-id", f"{pipe['group']}-t",
                                 "--dataset", hostile["sensor"]["dataset"], "--out", str(out), "--ledger",
                                 "--checkpoint-every", "2", "--idle-exit", "3", "--init-weights",
                                 str(hostile["sensor"]["run"] / "model.pt")],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ledger = Counter()
    for line in (out / "ledger.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "offset" in r:  # a trained row (raw partition and offset); the others are rejected feature messages
            ledger[(r["partition"], r["offset"])] += 1
    assert set(ledger) == {(0, o) for o in hostile["labelled"]} and set(ledger.values()) == {1}

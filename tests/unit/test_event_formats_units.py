"""Issue 33 items 1-3 without a broker: the event-format registry (JSON unchanged, Avro, Protobuf), the dataset
spec as an Avro schema and a Protobuf message and back, the Confluent wire format, schema resolution, and the
registry client waiting for a registry that does not answer yet."""
from __future__ import annotations

import json
import random
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from connectors.dataset_spec import FeatureSpec

SPEC = FeatureSpec(label="state", task="classification", numeric=["temp", "pressure"], optional_numeric=["humidity"],
                   categorical=["site", "machine"], time_column="ts")


def _events(n=200):
    rng = random.Random(0)
    out = []
    for i in range(n):
        e = {"ts": f"2024-03-01T00:{i % 60:02d}:00", "temp": rng.uniform(40, 80), "pressure": rng.choice([None, 1.0 + i]),
             "humidity": None if i % 7 == 0 else rng.uniform(20, 80), "site": rng.choice(["north", "south", 3, 2.5]),
             "machine": rng.randint(1, 6), "state": rng.choice(["ok", "warn", "fail"])}
        if i % 10 == 4:
            del e["state"]
        out.append(e)
    return out


def _sources(n):
    return [("raw", 0, i) for i in range(n)]


def test_item1_json_format_is_parse_batch_unchanged_with_its_dead_letters():
    from pipelines.stream.events import event_schema
    from pipelines.stream.formats import event_format
    from pipelines.stream.parse import parse_batch
    from pipelines.stream.replay import MALFORMED_KINDS, malform_event

    schema = event_schema(SPEC)
    rng = random.Random(1)
    payloads = [json.dumps(e).encode() for e in _events()]
    payloads += [malform_event(_events(1)[0], k, rng, schema) for k in MALFORMED_KINDS if k != "event too large"]
    want_table, want_letters = parse_batch(payloads, _sources(len(payloads)), schema)
    table, letters = event_format("json", schema).decode(payloads, _sources(len(payloads)))
    assert table.equals(want_table)
    assert [(d.source, d.reason) for d in letters] == [(d.source, d.reason) for d in want_letters]
    assert len(letters) == len(MALFORMED_KINDS) - 1
    with pytest.raises(ValueError, match="json takes no --schema-registry"):
        event_format("json", schema, registry="http://127.0.0.1:1/apis/ccompat/v7")


@pytest.mark.parametrize("name", ["avro", "protobuf"])
def test_item1_avro_and_protobuf_events_decode_to_the_json_events_table(name):
    from pipelines.stream.events import ParseBounds, event_schema
    from pipelines.stream.formats import event_format
    from pipelines.stream.parse import parse_batch

    schema = event_schema(SPEC)
    events = _events()
    want, _ = parse_batch([json.dumps(e).encode() for e in events], _sources(len(events)), schema)
    fmt = event_format(name, schema)
    payloads = [fmt.encode(e) for e in events]
    table, letters = fmt.decode(payloads, _sources(len(events)))
    assert letters == [] and table.equals(want)
    # a NaN that JSON cannot carry is a dead letter with JSON's reason; bounds apply after decoding
    bad = fmt.encode({**events[0], "temp": float("nan")})
    table, letters = fmt.decode([bad, b"x" * 100], _sources(2), ParseBounds(max_event_bytes=90))
    assert table is None and letters[0].reason.startswith("NaN: field 'temp'")
    assert letters[1].reason.startswith("event too large")


def test_item1_the_dataset_spec_maps_to_an_avro_schema_and_a_protobuf_message_and_back(tmp_path):
    from pipelines.stream.events import EventField, EventSchema, event_schema
    from pipelines.stream.formats import avro_schema, fields_of_avro, fields_of_proto, proto_text

    schema = event_schema(SPEC)
    avro = avro_schema(schema, "sensors")
    back = fields_of_avro(json.dumps(avro))
    assert [f.name for f in back] == schema.names
    assert {f.name: f.type for f in back} == {"state": "string", "temp": "double", "pressure": "double",
                                              "humidity": "double", "site": "string", "machine": "string",
                                              "ts": "string"}
    assert [f.name for f in back if not f.has_default] == [f.name for f in schema.fields if f.required]
    proto = proto_text(schema, "sensors")
    assert "message sensors {" in proto and "optional double temp = 2;" in proto
    assert [(f.name, f.type) for f in fields_of_proto(proto)] == [(f.name, f.type) for f in back]
    with pytest.raises(ValueError, match="column 'a b' is not a valid Avro field name"):
        avro_schema(EventSchema((EventField("a b", (float,), None),)))


def test_item1_flowtrain_schema_prints_the_datasets_schema_and_checks_a_writers(tmp_path, capsys):
    from connectors.dataset import FORMAT, MANIFEST
    from flowtrain.cli.main import main

    (tmp_path / MANIFEST).write_text(json.dumps({"format": FORMAT, "spec": SPEC.to_dict(), "stats": {}}))
    assert main(["schema", "--dataset", str(tmp_path), "--format", "avro"]) == 0
    avro = json.loads(capsys.readouterr().out)
    assert avro["type"] == "record" and [f["name"] for f in avro["fields"]][:2] == ["state", "temp"]
    assert main(["schema", "--dataset", str(tmp_path), "--format", "protobuf"]) == 0
    assert "optional double temp = 2;" in capsys.readouterr().out
    dropped = {**avro, "fields": [f for f in avro["fields"] if f["name"] != "pressure"]}
    (tmp_path / "v2.avsc").write_text(json.dumps(dropped))
    assert main(["schema", "--dataset", str(tmp_path), "--format", "avro", "--check", str(tmp_path / "v2.avsc")]) == 1
    assert "drops required field(s) pressure" in capsys.readouterr().err


def test_item3_the_confluent_wire_format_and_its_broken_records():
    from pipelines.stream.formats import WireError, frame, unframe

    assert frame(7, b"abc") == b"\x00\x00\x00\x00\x07abc"
    assert frame(7, b"abc", (0,)) == b"\x00\x00\x00\x00\x07\x00abc"
    assert unframe(frame(300, b"p", (1, 2)), protobuf=True) == (300, (1, 2), b"p")
    assert unframe(frame(300, b"p", (0,)), protobuf=True) == (300, (0,), b"p")
    for value, reason in ((b"\x01\x00\x00\x00\x07x", "magic byte 1"), (b"\x00\x00", "truncated"),
                          (None, "no value")):
        with pytest.raises(WireError, match=reason):
            unframe(value)


def test_item3_evolved_avro_and_protobuf_writers_resolve_by_name_and_a_dropped_feature_is_a_dead_letter(tmp_path):
    from pipelines.stream.events import event_schema
    from pipelines.stream.formats import avro_schema, event_format, proto_text

    schema = event_schema(SPEC)
    events = _events(20)
    base = event_format("avro", schema)
    want, _ = base.decode([base.encode(e) for e in events], _sources(20))
    avro = avro_schema(schema, "sensors")
    fields = [({**f, "type": ["null", "long"]} if f["name"] == "machine" else f) for f in avro["fields"]
              if f["name"] != "humidity"] + [{"name": "firmware", "type": ["null", "string"], "default": None}]
    (tmp_path / "v2.avsc").write_text(json.dumps({**avro, "fields": fields}))
    writer = event_format("avro", schema, schema_file=str(tmp_path / "v2.avsc"))
    table, letters = writer.decode([writer.encode({**e, "firmware": "1.2"}) for e in events], _sources(20))
    assert letters == []
    assert table.drop_columns(["humidity"]).equals(want.drop_columns(["humidity"]))
    assert table.column("humidity").null_count == 20  # removed by the writer: null (the training mean)
    proto = proto_text(schema).replace("optional string machine = 6;", "optional int64 machine = 16;") \
        .replace("optional double temp = 2;", "")
    (tmp_path / "v3.proto").write_text(proto)
    writer = event_format("protobuf", schema, schema_file=str(tmp_path / "v3.proto"))
    table, letters = writer.decode([writer.encode(e) for e in events], _sources(20))
    assert table is None and len(letters) == 20
    assert letters[0].reason == "the writer's schema: drops required field(s) temp (the dataset needs them)"


class _Registry(BaseHTTPRequestHandler):
    """A stand-in answering one schema by id: only the client's waiting is under test here (the real registry,
    Apicurio, is in tests/integration/test_event_formats_registry.py)."""

    def do_GET(self):  # noqa: N802
        body = json.dumps({"schema": '{"type": "record", "name": "E", "fields": []}'}).encode()
        self.send_response(200 if self.path.endswith("/schemas/ids/1") else 404)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_item3_a_registry_that_is_down_is_waited_for_not_a_failure():
    from pipelines.stream.formats import RegistryUnavailable, SchemaRegistry

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/apis/ccompat/v7"
    with pytest.raises(RegistryUnavailable, match="did not answer"):
        SchemaRegistry(url, wait_s=0.5).schema(1)
    servers, waits = [], []

    def come_up():  # the port opens only now: until then every connection is refused
        servers.append(HTTPServer(("127.0.0.1", port), _Registry))
        threading.Thread(target=servers[0].serve_forever, daemon=True).start()

    starter = threading.Timer(1.5, come_up)
    starter.start()
    try:
        t0 = time.monotonic()
        found = SchemaRegistry(url, wait_s=30, on_wait=waits.append).schema(1)
        assert found[0] == "AVRO" and time.monotonic() - t0 >= 1.0
        assert waits and waits[0].startswith("waiting for schema registry") and waits[-1] is None
        assert SchemaRegistry(url, wait_s=5).schema(2) is None  # an unknown id: None (dead letters), no wait
    finally:
        starter.cancel()
        for server in servers:
            server.shutdown()
            server.server_close()


def test_item2_event_format_options_on_replay_and_every_stream_part_match_the_engines():
    from flowtrain.commands.stream.options import ReplayJob, StreamJob, StreamPipelineJob, StreamScoreJob
    from pipelines.serving.config import ScoreConfig
    from pipelines.stream.formats import FORMATS
    from pipelines.stream.pipeline import StreamConfig

    for cls in (ReplayJob, StreamJob, StreamPipelineJob, StreamScoreJob):
        job = cls()
        assert (job.event_format, job.schema_registry, job.schema_file) == ("json", None, None), cls
    for cls in (StreamConfig, ScoreConfig):
        fields = cls.__dataclass_fields__
        assert (fields["event_format"].default, fields["schema_registry"].default) == ("json", None)
    from pipelines.stream.options import EVENT_FORMATS

    assert EVENT_FORMATS == tuple(FORMATS)


def test_item3_a_broken_avro_value_inside_a_batch_is_its_own_dead_letter_and_the_others_are_rows():
    """Values of one writer schema are read as one Avro block; a truncated value or one with bytes after its
    record shifts what follows: the batch is read value by value then, each broken one named."""
    from pipelines.stream.events import event_schema
    from pipelines.stream.formats import event_format

    schema = event_schema(SPEC)
    fmt = event_format("avro", schema)
    events = _events(50)
    payloads = [fmt.encode(e) for e in events]
    want, _ = fmt.decode(payloads, _sources(50))
    broken = list(payloads)
    broken[10], broken[20], broken[49] = broken[10][:-2], broken[20] + b"\x00\x00", broken[49] + b"\x02"
    table, letters = fmt.decode(broken, _sources(50))
    assert [d.source for d in letters] == ["raw/0/10", "raw/0/20", "raw/0/49"]
    assert letters[0].reason.startswith("undecodable avro: truncated payload")
    assert letters[1].reason.startswith("undecodable avro: 2 byte(s) after the record")
    assert letters[2].reason.startswith("undecodable avro: 1 byte(s) after the record")
    keep = [i for i in range(50) if i not in (10, 20, 49)]
    assert table.equals(want.take(keep))


def test_item2_replay_in_avro_needs_the_datasets_schema_and_json_takes_no_registry(tmp_path):
    import subprocess
    import sys

    csv = tmp_path / "t.csv"
    csv.write_text("a,b\n1,2\n")
    cli = [sys.executable, "-m", "flowtrain.cli", "replay", "--input", str(csv), "--bootstrap", "127.0.0.1:1",
           "--topic", "t"]
    out = subprocess.run(cli + ["--event-format", "avro"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--event-format avro needs --dataset DIR" in out.stderr, out.stderr
    out = subprocess.run(cli + ["--event-format", "xml"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--event-format" in out.stderr and "xml" in out.stderr, out.stderr

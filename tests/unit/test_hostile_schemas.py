"""Issue 44 items 1, 2, 3, 6 and 7: no writer schema can crash or stall the stream's decoders or the file readers.

A recursive Avro schema plus one event nested 6,000 deep ended the process with SIGSEGV in fastavro's C decoder;
the same from a container file 20,000 deep. Each hostile decode here runs in a subprocess, so a regression is a
failed test (its exit status), not a dead pytest. A registry that answers oddly (the hostile registry of
``tests/hostile_registry.py``: a real HTTP server) made ``featurize_payloads`` raise; every such answer is now a
dead letter with its reason, asked once (kept briefly), and the decoders kept are bounded."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from connectors.dataset_spec import FeatureSpec
from tests.hostile_registry import HostileRegistry, nested_event, recursive_schema

SPEC = FeatureSpec(label="y", task="classification", numeric=["x1"], categorical=["city"])
STATS = {"numeric": {"x1": {"mean": 0.0, "std": 1.0}}, "vocab": {"city": ["a", "b"]}, "classes": ["no", "yes"]}
EVENT = {"x1": 0.5, "city": "a", "y": "yes"}


def _events():
    from pipelines.stream.events import event_schema

    return event_schema(SPEC)


def _good(schema_id: int, n: int) -> list[bytes]:
    """``n`` events framed with ``schema_id`` (the dataset's own Avro schema)."""
    from pipelines.stream.formats import AvroFormat, frame

    fmt = AvroFormat(_events())
    return [frame(schema_id, fmt.encode_payload({**EVENT, "x1": float(i)})) for i in range(n)]


def _run(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``script`` in a fresh interpreter (a crash there is its exit status here)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=os.getcwd())


_FEATURIZE = """
    import json, sys
    from connectors.dataset_spec import FeatureSpec
    from connectors.kafka import KafkaRecord
    from pipelines.serving.featurize import featurize_records
    from pipelines.stream.featurize import StreamFeaturizer
    spec = FeatureSpec(label="y", task="classification", numeric=["x1"], categorical=["city"])
    stats = {"numeric": {"x1": {"mean": 0.0, "std": 1.0}}, "vocab": {"city": ["a", "b"]}, "classes": ["no", "yes"]}
    payloads = [bytes.fromhex(h) for h in json.load(open(sys.argv[2]))]
    sources = [("raw", 0, i) for i in range(len(payloads))]
    out = {}
    # the stream pipeline's step, then the scorer's, each with its own decoders
    pipe = StreamFeaturizer(spec, stats, event_format="avro", schema_registry=sys.argv[1])
    got = pipe.featurize_payloads(payloads, sources)
    out["pipeline"] = [got.features.num_rows, [(d.source, d.reason) for d in got.dead_letters]]
    score = StreamFeaturizer(spec, stats, event_format="avro", schema_registry=sys.argv[1])
    records = [KafkaRecord("raw", 0, i, 0, None, p) for i, p in enumerate(payloads)]
    batch, letters = featurize_records(records, score)
    out["scorer"] = [batch.features.num_rows, [(d.source, d.reason) for d in letters]]
    print(json.dumps(out))
"""


def test_item1_a_recursive_schema_and_an_event_nested_6000_deep_is_a_dead_letter_not_a_segfault(tmp_path):
    """The pipeline's and the scorer's featurizer on [good, hostile, good x 5]: the hostile event (about 24 KB,
    under --max-event-bytes) is a dead letter naming its schema id and the recursion, the others are rows."""
    from pipelines.stream.formats import avro_schema

    events = _events()
    hostile = nested_event(1, len(events.fields), 6000)
    payloads = _good(2, 1) + [hostile] + _good(2, 5)
    (tmp_path / "payloads.json").write_text(json.dumps([p.hex() for p in payloads]))
    with HostileRegistry({1: {"schema": json.dumps(recursive_schema(events))},
                          2: {"schema": json.dumps(avro_schema(events))}}) as reg:
        proc = _run(_FEATURIZE, reg.url, str(tmp_path / "payloads.json"))
        assert proc.returncode == 0, f"rc {proc.returncode} ({'SIGSEGV' if proc.returncode == -11 else ''})\n" \
                                     f"{proc.stderr[-3000:]}"
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        assert reg.asked[1] == 2 and reg.asked[2] == 2  # once per featurizer (its decoders are its own)
    assert len(hostile) < 64 * 1024
    for part in ("pipeline", "scorer"):
        rows, letters = out[part]
        assert rows == 6, part
        assert [s for s, _ in letters] == ["raw/0/1"], part
        assert letters[0][1].startswith("schema id 1: refused: the Avro schema is recursive: flowtrain.Event > "
                                        "flowtrain.Event"), letters[0][1]


def test_item1_a_recursive_or_too_deep_schema_file_is_one_line_naming_the_file(tmp_path):
    from connectors.avro_schema import MAX_AVRO_DEPTH, check_avro_schema
    from pipelines.stream.formats import avro_schema, event_format

    events = _events()
    path = tmp_path / "node.avsc"
    path.write_text(json.dumps(recursive_schema(events)))
    with pytest.raises(ValueError) as err:
        event_format("avro", events, schema_file=str(path))
    assert str(err.value).startswith(f"--schema-file {path}: refused: the Avro schema is recursive") and \
        "\n" not in str(err.value)
    # recursion through another record, and a named type used by name after its definition (not recursion)
    a = {"type": "record", "name": "A", "fields": [{"name": "b", "type": {"type": "record", "name": "B", "fields": [
        {"name": "a", "type": ["null", "A"]}]}}]}
    with pytest.raises(ValueError, match="recursive: A > B > A"):
        check_avro_schema(a)
    sibling = {"type": "record", "name": "R", "fields": [
        {"name": "p", "type": {"type": "record", "name": "P", "fields": [{"name": "x", "type": "long"}]}},
        {"name": "q", "type": ["null", "P"]}, {"name": "m", "type": {"type": "map", "values": "P"}}]}
    assert check_avro_schema(sibling) == 3
    assert check_avro_schema(avro_schema(events)) == 1

    def nested(n):
        t = "long"
        for i in range(n):
            t = {"type": "record", "name": f"L{i}", "fields": [{"name": "v", "type": t}]}
        return t

    assert check_avro_schema(nested(MAX_AVRO_DEPTH)) == MAX_AVRO_DEPTH
    with pytest.raises(ValueError, match=f"nests more than {MAX_AVRO_DEPTH} levels"):
        check_avro_schema(nested(MAX_AVRO_DEPTH + 1))
    arrays = {"type": "array", "items": "long"}
    for _ in range(MAX_AVRO_DEPTH):
        arrays = {"type": "array", "items": arrays}
    with pytest.raises(ValueError, match="nests more than"):
        check_avro_schema(arrays)
    # a schema nested far deeper than Python's recursion limit is refused at the bound, not a RecursionError
    deep = json.loads('{"type": ' * 900 + '"long"' + "}" * 900)
    with pytest.raises(ValueError, match="nests more than"):
        check_avro_schema(deep)


def _deep_file(path, depth: int) -> None:
    """An Avro container file of one record of a recursive schema nested ``depth`` deep (written by hand:
    fastavro's writer recurses in C too)."""
    import io

    import fastavro

    from pipelines.stream.formats.avro import _long

    node = {"type": "record", "name": "Node", "fields": [{"name": "x", "type": "double"},
                                                         {"name": "next", "type": ["null", "Node"]}]}
    head = io.BytesIO()
    fastavro.writer(head, fastavro.parse_schema(node), [], codec="null")
    header, sync = head.getvalue(), head.getvalue()[-16:]
    data = (b"\x00" * 8 + b"\x02") * depth + b"\x00" * 8 + b"\x00"
    path.write_bytes(header + _long(1) + _long(len(data)) + data + sync)


def test_item2_an_avro_file_nested_20000_deep_is_one_line_naming_it_in_batch_and_every_reader(tmp_path, capsys):
    """Every Avro reader (batch's pre-flight and ETL, predict's) refuses the file from its header (in a subprocess:
    each ended with SIGSEGV); then ``flowtrain batch --input deep.avro`` (it ended with "Segmentation fault", rc
    139, run.json "running"): exit status 2, one line naming the file, run.json failed with it."""
    from flowtrain.cli.main import main

    deep = tmp_path / "deep.avro"
    _deep_file(deep, 20_000)
    proc = _run("""
        import sys
        from connectors.files import avro_head, check_avro_file
        from connectors.files.read import iter_unit
        from connectors.files.units import FileReadError, FileUnit
        for read in (check_avro_file, avro_head, lambda p: list(iter_unit(FileUnit(p, "avro", None, 0)))):
            try:
                read(sys.argv[1])
                print("read")
            except FileReadError as err:
                print(str(err).splitlines()[0][:60])
    """, str(deep))
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stderr[-3000:]}"
    assert proc.stdout.splitlines() == [f"{deep}: refused: its Avro schema is recursive"[:60]] * 3
    out = tmp_path / "run"
    assert main(["batch", "--input", str(deep), "--label", "x", "--numeric", "y", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith("WARNING:root:apitools")]
    assert lines == [f"flowtrain batch: {deep}: refused: its Avro schema is recursive: Node > Node (a record that "
                     f"holds itself lets a value nest without bound; a table row cannot); a table's rows are records "
                     f"of columns"], err
    marker = json.loads((out / "run.json").read_text())
    assert marker["status"] == "failed" and marker["error"].startswith(f"{deep}: refused")


def test_item2_a_run_whose_process_died_is_found_dead_by_the_next_command_on_its_out(tmp_path):
    """A run that dies without a word (here a real SIGSEGV) leaves run.json "running"; the next run on that --out
    holds the directory's lock, so it knows no process runs it: it records the run failed (naming its pid and
    host) and says so, and the usual rules for a failed run apply. The stream trainer's directory alike."""
    import socket

    from flowtrain.train.rundir.rules import RunDirError, mark_complete, prepare_run_dir, prepare_stream_dir

    out, stream = tmp_path / "run", tmp_path / "stream"
    options = {"input": ["a.csv"], "label": "y", "epochs": 2}
    proc = _run("""
        import ctypes, json, os, sys
        from flowtrain.train.rundir.rules import prepare_run_dir, prepare_stream_dir
        prepare_run_dir(sys.argv[1], json.loads(sys.argv[2]))
        open(os.path.join(sys.argv[1], "model.pt"), "wb").close()  # it left a model: kept unless replaced
        prepare_stream_dir(sys.argv[3], {"dataset": "d"})
        print(os.getpid(), flush=True)
        ctypes.string_at(0)
    """, str(out), json.dumps(options), str(stream))
    assert proc.returncode == -signal.SIGSEGV, proc.stderr[-2000:]
    pid = int(proc.stdout.split()[0])
    assert json.loads((out / "run.json").read_text())["status"] == "running"
    # another run of other options: refused as before (the run left a model), and the dead run recorded failed
    with pytest.raises(RunDirError, match="it failed: its process died"):
        prepare_run_dir(out, {**options, "label": "z"})
    marker = json.loads((out / "run.json").read_text())
    assert marker["status"] == "failed" and "pid" not in marker
    assert marker["error"].startswith(f"its process (pid {pid} on host {socket.gethostname()}) died without "
                                      f"recording the run's end")
    run = prepare_run_dir(out, options)  # the same options: replaced, as any earlier run of them
    assert "replaced the earlier run" in run.note
    mark_complete(out)
    # the stream trainer continues its run (from its checkpoint); the death is recorded and said first
    stream_marker = json.loads((stream / "run.json").read_text())
    assert stream_marker["status"] == "running" and stream_marker["pid"] == pid
    prepare_stream_dir(stream, {"dataset": "d"})
    marker = json.loads((stream / "run.json").read_text())
    assert marker["status"] == "running" and marker["pid"] == os.getpid() and marker["run_id"] == \
        stream_marker["run_id"]


def _featurizer(url: str, fmt: str = "avro"):
    from pipelines.stream.featurize import StreamFeaturizer

    return StreamFeaturizer(SPEC, STATS, event_format=fmt, schema_registry=url)


def test_item3_every_odd_registry_answer_is_a_dead_letter_with_its_reason_asked_once():
    """Answers that raised out of ``featurize_payloads``: a schema text nested 100,000 deep (RecursionError), a
    JSON list (AttributeError), no "schema" key (KeyError), HTTP 400 (RegistryError); also an answer body
    nested 100,000 deep, one that is not JSON, a schema of another type, and an unknown id. Each is a dead
    letter with its reason; the events of the good schema are rows; asking again within the retry time asks
    the registry nothing more."""
    from pipelines.stream.formats import avro_schema

    answers = {1: {"schema": json.dumps(avro_schema(_events()))},
               2: {"schema": "[" * 100_000 + "]" * 100_000},
               3: [1, 2],
               4: {"schemaType": "AVRO", "references": []},
               5: 400,
               6: b"[" * 100_000 + b"]" * 100_000,
               7: b"<html>gateway</html>",
               8: {"schema": "syntax = \"proto3\"; message E { double x1 = 1; }", "schemaType": "PROTOBUF"},
               9: {"schema": "{}", "schemaType": 5}}
    with HostileRegistry(answers) as reg:
        payloads = _good(1, 2) + [p for i in range(2, 11) for p in _good(i, 2)] + _good(1, 2)
        sources = [("raw", 0, i) for i in range(len(payloads))]
        featurizer = _featurizer(reg.url)
        out = featurizer.featurize_payloads(payloads, sources)
        assert out.features.num_rows == 4 and len(out.dead_letters) == 18  # counts in = out + rejected
        reasons = {int(d.source.rsplit("/", 1)[1]) // 2 + 1: d.reason for d in out.dead_letters}  # by schema id
        assert reasons[2].startswith("schema id 2: nested too deeply to be read") or \
            reasons[2].startswith("schema id 2: not an Avro record schema"), reasons[2]
        for i in (3, 4, 9):
            assert reasons[i].startswith(f"schema id {i}: schema registry {reg.url}: the answer for schema id {i} is "
                                         f"not a schema"), reasons[i]
        assert reasons[5].startswith(f"schema id 5: schema registry {reg.url}/schemas/ids/5: HTTP 400")
        assert reasons[6] == f"schema id 6: schema registry {reg.url}/schemas/ids/6: the answer is not JSON " \
                             f"(RecursionError)"
        assert reasons[7].endswith("the answer is not JSON (JSONDecodeError)")
        assert reasons[8] == "schema id 8 is PROTOBUF, not AVRO (--event-format avro)"
        assert reasons[10] == f"unknown schema id 10: the schema registry {reg.url} does not know it"
        asked = dict(reg.asked)
        assert all(asked[i] == 1 for i in range(1, 11)), asked
        again = featurizer.featurize_payloads(payloads, sources)
        assert [d.reason for d in again.dead_letters] == [d.reason for d in out.dead_letters]
        assert dict(reg.asked) == asked  # kept: the same offsets on a retry ask nothing


def test_item6_the_decoders_kept_are_bounded_and_unknown_ids_are_kept_briefly():
    with HostileRegistry({}) as reg:  # every id unknown
        featurizer = _featurizer(reg.url)
        payloads = [p for i in range(1000, 1300) for p in _good(i, 1)]
        out = featurizer.featurize_payloads(payloads, [("raw", 0, i) for i in range(300)])
        assert out.features is None and len(out.dead_letters) == 300
        assert sum(reg.asked.values()) == 300  # one request per id, none twice
        assert not featurizer.format.registry._schemas  # the client keeps no unknown id (the format, briefly)
        from pipelines.stream.formats.plans import MAX_PLANS, PlanCache, Retry
        from pipelines.stream.formats.registry import MAX_SCHEMAS

        assert len(featurizer.format._plans) == MAX_PLANS and MAX_SCHEMAS >= MAX_PLANS
    cache = PlanCache(max_plans=3, retry_s=0.2)
    cache.put(1, Retry("unknown"))
    cache.put(2, "a lasting reason")
    assert cache.get(1) == "unknown" and isinstance(cache.get(1), Retry)
    time.sleep(0.3)
    assert cache.get(1) is None and cache.get(2) == "a lasting reason"  # a Retry goes; the rest stays
    for key in (3, 4, 5):
        cache.put(key, "x")
    assert len(cache) == 3 and cache.get(2) is None  # the least recently used went first


def test_item6_protobuf_message_indexes_the_schema_lacks_are_dead_letters_and_keep_nothing():
    """3,000 events with distinct message indexes built 3,000 decoders and were decoded as message 0."""
    from pipelines.stream.events import event_schema
    from pipelines.stream.formats import ProtobufFormat, frame, proto_text

    events = event_schema(SPEC)
    with HostileRegistry({5: {"schema": proto_text(events), "schemaType": "PROTOBUF"}}) as reg:
        featurizer = _featurizer(reg.url, "protobuf")
        body = ProtobufFormat(events).encode_payload(EVENT)
        nested = [frame(5, body, (0, k)) for k in range(1, 1501)]
        beyond = [frame(5, body, (k,)) for k in range(1, 1501)]
        good = [frame(5, body, (0,))] * 3
        payloads = good + nested + beyond
        out = featurizer.featurize_payloads(payloads, [("raw", 0, i) for i in range(len(payloads))])
        assert out.features.num_rows == 3 and len(out.dead_letters) == 3000
        assert out.dead_letters[0].reason == "schema id 5: message indexes [0, 1] name a nested message; events " \
                                             "are top-level messages of the schema"
        assert out.dead_letters[1500].reason == "schema id 5: message index 1: the schema has 1 message(s)"
        from pipelines.stream.formats.plans import MAX_PLANS

        assert len(featurizer.format._plans) <= MAX_PLANS and reg.asked[5] == 1


def test_item7_a_proto_padded_with_spaces_parses_in_linear_time():
    """``message E {`` followed by 20,000 spaces took 9.8 s per decoder (the field regex backtracked); a
    registry accepts such a schema. Now: the decoder of a padded schema, and refusals of broken ones, in well
    under a second."""
    from pipelines.stream.events import event_schema
    from pipelines.stream.formats import ProtobufFormat, fields_of_proto, frame, proto_text

    events = event_schema(SPEC)
    text = proto_text(events)
    # the slow case: a message body of white space only (the old regex tried every position, each to the end)
    padded = text.replace(";", ";" + " \n" * 5_000, 1) + "message Pad {" + " " * 20_000 + "}\n"
    t0 = time.perf_counter()
    assert fields_of_proto(padded) == fields_of_proto(text) and fields_of_proto(padded, 1) == []
    for broken in ("message E {" + " " * 20_000, "/*" * 50_000, "message E { optional" + " double" * 20_000):
        with pytest.raises(ValueError):
            fields_of_proto(broken)
    with HostileRegistry({3: {"schema": padded, "schemaType": "PROTOBUF"}}) as reg:
        featurizer = _featurizer(reg.url, "protobuf")
        body = ProtobufFormat(events).encode_payload(EVENT)
        out = featurizer.featurize_payloads([frame(3, body, (0,))], [("raw", 0, 0)])
        assert out.features.num_rows == 1
    assert time.perf_counter() - t0 < 2.0
    # the .proto features flowtrain reads: nested definitions skipped, a oneof's fields the message's
    fields = fields_of_proto('syntax = "proto3"; /* { */ message A { oneof o { string a = 1; int64 b = 2; } '
                             'message N { int32 z = 1; } enum K { X = 0; } reserved 5; double c = 3 [packed = true]; }'
                             ' message B { bool ok = 1; }')
    assert [(f.name, f.type, f.number) for f in fields] == [("a", "string", 1), ("b", "int64", 2), ("c", "double", 3)]
    assert [(f.name, f.number) for f in fields_of_proto("message A {} message B { bool ok = 7; }", 1)] == [("ok", 7)]

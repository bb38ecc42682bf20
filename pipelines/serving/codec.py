"""The predictions' encodings on the predictions topic (``--predictions-format``): Arrow record batches, or one JSON
object, Avro record or Protobuf message per prediction, with or without a Schema Registry (``PredictionsCodec``:
encode and decode). The columns are a stream's own (``pipelines.serving.predictions.prediction_layout``: the
``pred_*`` scheme of ``flowtrain predict``, with the dataset's class names); the Avro schema (``avro_schema``) and
the Protobuf message (``proto_text``) are made from them, one field per column."""
from __future__ import annotations

import io
import json
import re

import fastavro
import pyarrow as pa

from connectors.arrow import decode_batch, encode_batches
from pipelines.serving.options import PREDICTIONS_FORMATS
from pipelines.stream.formats.registry import AVRO, PROTOBUF, RegistryError, RegistryUnavailable
from pipelines.stream.formats.wire import frame, unframe

__all__ = ["PREDICTIONS_FORMATS", "PredictionsCodec", "avro_schema", "proto_text", "proto_fields",
           "predictions_format", "encode_predictions", "detect_format"]

#: --predictions-format: ``arrow`` (one Arrow record batch per message: what JSON events give), ``json`` (one
#: JSON object per prediction), ``avro`` / ``protobuf`` (one record per prediction; with ``--schema-registry`` in
#: its wire format, the schema registered under ``<predictions topic>-value``). Default: the events' format.

#: A name Avro and Protobuf take for a field.
_FIELD_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: (Avro type, Protobuf type) of each Arrow type a prediction column has.
_TYPES = {pa.string(): ("string", "string"), pa.int64(): ("long", "int64"), pa.float64(): ("double", "double")}


def _is_time(t: pa.DataType) -> bool:
    return pa.types.is_timestamp(t)


def _check_names(schema: pa.Schema, fmt: str) -> None:
    bad = [n for n in schema.names if not _FIELD_NAME.match(n)]
    if bad:
        raise ValueError(f"--predictions-format {fmt}: column(s) {', '.join(map(repr, bad))} cannot be {fmt} field "
                         f"names (letters, digits and _; a class name or --id-column with other characters): use "
                         f"--predictions-format arrow or json")


def avro_schema(schema: pa.Schema) -> dict:
    """The predictions' Arrow schema as an Avro record: nullable columns as unions with null (default null), times
    as timestamp-millis."""
    _check_names(schema, "avro")
    fields = []
    for f in schema:
        if _is_time(f.type):
            t: object = {"type": "long", "logicalType": "timestamp-millis"}
        elif f.type in _TYPES:
            t = _TYPES[f.type][0]
        else:
            raise ValueError(f"prediction column {f.name!r} has type {f.type}, which no Avro field holds here")
        fields.append({"name": f.name, "type": t} if not f.nullable else
                      {"name": f.name, "type": ["null", t], "default": None})
    return {"type": "record", "name": "Prediction", "namespace": "flowtrain", "fields": fields}


def proto_fields(schema: pa.Schema) -> list[tuple[str, str]]:
    """(name, Protobuf type) of each column, numbered from 1 in this order; times are int64 milliseconds (UTC)."""
    _check_names(schema, "protobuf")
    out = []
    for f in schema:
        if _is_time(f.type):
            out.append((f.name, "int64"))
        elif f.type in _TYPES:
            out.append((f.name, _TYPES[f.type][1]))
        else:
            raise ValueError(f"prediction column {f.name!r} has type {f.type}, which no Protobuf field holds here")
    return out


def proto_text(fields: list[tuple[str, str]]) -> str:
    """The .proto (proto2) of the prediction message."""
    return 'syntax = "proto2";\npackage flowtrain;\n\nmessage Prediction {\n' + "".join(
        f"  optional {t} {name} = {i};\n" for i, (name, t) in enumerate(fields, 1)) + "}\n"


_PROTO_LINE = re.compile(r"^\s*optional\s+(string|int64|double|float)\s+([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(\d+)\s*;")


def _fields_of_proto(text: str) -> list[tuple[str, str]]:
    """The fields of a prediction .proto that ``proto_text`` wrote (read back from a registry)."""
    found = sorted((int(n), name, t) for t, name, n in (m.groups() for m in map(_PROTO_LINE.match, text.splitlines())
                                                         if m))
    if "message Prediction" not in text or not found or [n for n, _, _ in found] != list(range(1, len(found) + 1)):
        raise ValueError("the record's Protobuf schema is not flowtrain's prediction message")
    return [(name, t) for _, name, t in found]


def _message_class(fields: list[tuple[str, str]]):
    """The Protobuf class of a prediction message with these fields, from a descriptor built here (no protoc)."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    F = descriptor_pb2.FieldDescriptorProto
    proto = descriptor_pb2.FileDescriptorProto(name="flowtrain_prediction.proto", package="flowtrain",
                                               syntax="proto2")
    message = proto.message_type.add(name="Prediction")
    kinds = {"string": F.TYPE_STRING, "int64": F.TYPE_INT64, "double": F.TYPE_DOUBLE, "float": F.TYPE_FLOAT}
    for i, (name, t) in enumerate(fields, 1):
        message.field.add(name=name, number=i, type=kinds[t], label=F.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("flowtrain.Prediction"))


def predictions_format(chosen: str | None, event_format: str) -> str:
    """The format the scorer writes predictions in: ``chosen`` (``--predictions-format``), else the events' own
    (JSON events: Arrow record batches, as before event formats)."""
    if chosen is None:
        return "arrow" if event_format == "json" else event_format
    if chosen not in PREDICTIONS_FORMATS:
        raise ValueError(f"--predictions-format {chosen!r}: expected one of {', '.join(PREDICTIONS_FORMATS)}")
    return chosen


def detect_format(value: bytes) -> str | None:
    """The format of one message of a predictions topic when its bytes say it: ``arrow`` (an Arrow IPC stream),
    ``json`` (an object), ``wire`` (the Confluent wire format: Avro or Protobuf with a registry); None (a bare
    Avro or Protobuf record: give the format)."""
    if value[:4] == b"\xff\xff\xff\xff":
        return "arrow"
    if value[:1] == b"{":
        return "json"
    if value[:1] == b"\x00" and len(value) > 5:
        return "wire"
    return None


class PredictionsCodec:
    """Predictions as the scorer writes them (``fmt``: one of ``PREDICTIONS_FORMATS``) and back.

    ``schema``: the predictions' Arrow schema (``prediction_layout(...).schema``); Avro and Protobuf records are made
    from it (``avro_schema``, ``proto_text``), and it is what decoding a bare Avro or Protobuf record (no registry)
    needs. ``encode(preds, max_bytes)`` -> (messages, the rows they hold, [(row, reason)] of rows that cannot be
    written); ``decode(value)`` -> the predictions of one message as dicts (times as milliseconds since the epoch in
    JSON and Protobuf, datetimes otherwise). With a ``registry`` (a ``pipelines.stream.formats.SchemaRegistry``)
    Avro and Protobuf records are in the Confluent wire format: the schema is registered under ``subject`` on the
    first ``encode``, and read by id on ``decode``."""

    def __init__(self, fmt: str, registry=None, subject: str | None = None, schema: pa.Schema | None = None):
        if fmt not in PREDICTIONS_FORMATS:
            raise ValueError(f"--predictions-format {fmt!r}: expected one of {', '.join(PREDICTIONS_FORMATS)}")
        self.fmt, self.registry, self.subject, self.schema = fmt, registry, subject, schema
        self.schema_id: int | None = None
        self._parsed = self._cls = None
        self._readers: dict[int, tuple] = {}  # schema id -> (parsed Avro schema | (Protobuf class, fields))
        if fmt in ("avro", "protobuf") and schema is not None:
            _ = self.schema_text  # the names checked now: a scorer that cannot write its predictions does not start

    def __getstate__(self):
        return {"fmt": self.fmt, "registry": self.registry, "subject": self.subject, "schema_id": self.schema_id,
                "schema": self.schema}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._parsed = self._cls = None
        self._readers = {}

    @property
    def times(self) -> set[str]:
        return {f.name for f in self.schema if _is_time(f.type)} if self.schema is not None else set()

    @property
    def schema_text(self) -> str | None:
        """The schema of the predictions (Avro JSON, a .proto); None for Arrow and JSON."""
        if self.fmt not in ("avro", "protobuf"):
            return None
        if self.schema is None:
            raise ValueError(f"{self.fmt} predictions need their schema (the dataset's columns and classes)")
        if self.fmt == "avro":
            return json.dumps(avro_schema(self.schema))
        return proto_text(proto_fields(self.schema))

    def register(self) -> int | None:
        """Registers the predictions' schema (Avro, Protobuf, with a registry) once; its id, else None."""
        if self.registry is None or self.fmt not in ("avro", "protobuf"):
            return None
        if self.schema_id is None:
            if not self.subject:
                raise ValueError("registering the predictions' schema needs a subject (the predictions topic's)")
            self.schema_id = self.registry.register(self.subject, self.schema_text,
                                                    AVRO if self.fmt == "avro" else PROTOBUF)
        return self.schema_id

    # --- writing -----------------------------------------------------------------------------------------------
    def encode(self, preds: pa.RecordBatch, max_bytes: int) -> tuple[list[bytes], pa.RecordBatch,
                                                                      list[tuple[int, str]]]:
        if self.fmt == "arrow":
            return encode_predictions(preds, max_bytes)
        messages, good, bad = [], [], []
        for i, row in enumerate(preds.to_pylist()):
            try:
                value = self.encode_row(row)
            except (RegistryError, RegistryUnavailable):
                raise  # the registry's answer, not this row's fault: the micro-batch fails (and is retried)
            except Exception as err:  # noqa: BLE001 - this row's reason; the others are written
                bad.append((i, f"its prediction cannot be written as {self.fmt}: {type(err).__name__}: "
                               f"{str(err)[:500]}"))
                continue
            if len(value) > max_bytes:
                bad.append((i, f"its prediction is {len(value):,} bytes as {self.fmt}, more than the predictions "
                               f"topic takes ({max_bytes:,})"))
                continue
            messages.append(value)
            good.append(i)
        kept = preds if len(good) == preds.num_rows else preds.take(pa.array(good, pa.int64()))
        return messages, kept, bad

    def encode_row(self, row: dict) -> bytes:
        """One prediction (a dict of the schema's columns) as one message value."""
        times = self.times
        if self.fmt == "json":
            return json.dumps({k: (_epoch_ms(v) if k in times or _is_datetime(v) else v) for k, v in row.items()},
                              allow_nan=False).encode()
        if self.fmt == "avro":
            if self._parsed is None:
                self._parsed = fastavro.parse_schema(json.loads(self.schema_text))
            buf = io.BytesIO()
            fastavro.schemaless_writer(buf, self._parsed, row)
            payload, indexes = buf.getvalue(), None
        elif self.fmt == "protobuf":
            if self._cls is None:
                self._cls = _message_class(proto_fields(self.schema))
            msg = self._cls()
            for name, _ in proto_fields(self.schema):
                value = row.get(name)
                if value is not None:
                    setattr(msg, name, _epoch_ms(value) if name in times else value)
            payload, indexes = msg.SerializeToString(), (0,)
        else:
            raise ValueError("arrow predictions are record batches of many predictions, not one record each")
        if self.registry is None:
            return payload
        return frame(self.register(), payload, indexes)

    # --- reading -----------------------------------------------------------------------------------------------
    def decode(self, value: bytes) -> list[dict]:
        """The predictions one message holds (``ValueError`` naming what is wrong)."""
        if self.fmt == "arrow":
            return decode_batch(value).to_pylist()
        if self.fmt == "json":
            return [json.loads(value)]
        body, schema_id = value, None
        if self.registry is not None:
            schema_id, _, body = unframe(value, protobuf=self.fmt == "protobuf")
        if self.fmt == "avro":
            return [fastavro.schemaless_reader(io.BytesIO(body), self._reader(schema_id))]
        cls, fields = self._reader(schema_id)
        msg = cls()
        msg.ParseFromString(body)
        return [{name: getattr(msg, name) if msg.HasField(name) else None for name, _ in fields}]

    def _reader(self, schema_id: int | None):
        """The parsed Avro schema, or (Protobuf class, fields), of a record: the registry's by id, else ours."""
        if schema_id in self._readers:
            return self._readers[schema_id]
        if schema_id is None:
            if self.schema is None:
                raise ValueError(f"bare {self.fmt} predictions cannot be read without their schema: give the "
                                 f"dataset (--dataset, and --id-column as the scorer had it) or a --schema-registry")
            text = self.schema_text
        else:
            found = self.registry.schema(schema_id)
            if found is None:
                raise ValueError(f"unknown schema id {schema_id}: the schema registry {self.registry.url} does "
                                 f"not know it")
            text = found[1]
        if self.fmt == "avro":
            reader = fastavro.parse_schema(json.loads(text))
        else:
            fields = _fields_of_proto(text)
            reader = (_message_class(fields), fields)
        self._readers[schema_id] = reader
        return reader


def _is_datetime(value) -> bool:
    return hasattr(value, "timestamp") and hasattr(value, "tzinfo")


def _epoch_ms(value) -> int | None:
    """A time (a datetime, or already milliseconds) as milliseconds since the epoch."""
    if value is None or isinstance(value, int):
        return value
    return int(round(value.timestamp() * 1000))


def encode_predictions(preds: pa.RecordBatch, max_bytes: int) -> tuple[list[bytes], pa.RecordBatch,
                                                                       list[tuple[int, str]]]:
    """``(messages, the rows they hold, [(row, reason)] of rows that cannot be written)``: messages of
    at most ``max_bytes``; a row that fits no message on its own (or fails to encode) is left out
    with the reason, so one event never stops the scorer (the caller makes it a dead letter)."""
    try:
        return encode_batches(preds, max_bytes), preds, []
    except Exception:  # noqa: BLE001 - find the row(s), below
        pass
    good, bad = [], []
    for i in range(preds.num_rows):
        try:
            encode_batches(preds.slice(i, 1), max_bytes)
            good.append(i)
        except Exception as err:  # noqa: BLE001 - this row's reason
            bad.append((i, f"its prediction cannot be written to the predictions topic: {str(err)[:500]}"))
    kept = preds.take(pa.array(good, pa.int64()))
    return (encode_batches(kept, max_bytes) if good else []), kept, bad

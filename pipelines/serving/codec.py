"""The predictions' encodings on the predictions topic (``--predictions-format``): ``PREDICTION_SCHEMA`` as Arrow
record batches, or one JSON object, Avro record (``PREDICTION_AVRO``) or Protobuf message (``PREDICTION_PROTO``) per
prediction, with or without a Schema Registry (``PredictionsCodec``: encode and decode). The schema's columns:
``pipelines.serving.predictions``."""
from __future__ import annotations

import io
import json

import fastavro
import pyarrow as pa

from connectors.arrow import decode_batch, encode_batches
from pipelines.serving.options import PREDICTIONS_FORMATS
from pipelines.stream.formats.registry import AVRO, PROTOBUF, RegistryError, RegistryUnavailable
from pipelines.stream.formats.wire import frame, unframe

__all__ = ["PREDICTION_SCHEMA", "PREDICTIONS_FORMATS", "PREDICTION_AVRO", "PREDICTION_PROTO", "PredictionsCodec",
           "predictions_format", "encode_predictions"]

PREDICTION_SCHEMA = pa.schema([
    ("source", pa.string()),
    ("src_partition", pa.int64()),
    ("src_offset", pa.int64()),
    ("id", pa.string()),
    ("prediction", pa.float32()),
    ("predicted_class", pa.string()),
    ("probabilities", pa.list_(pa.float32())),
    ("model_version", pa.int64()),
    ("model_run", pa.string()),
    ("event_time", pa.timestamp("ms", tz="UTC")),
    ("scoring_time", pa.timestamp("ms", tz="UTC")),
    ("label", pa.float32()),
])


#: ``--predictions-format``: ``arrow`` (one Arrow record batch per message: what JSON events give), ``json`` (one
#: JSON object per prediction), ``avro`` / ``protobuf`` (one record per prediction; with ``--schema-registry`` in
#: its wire format, the schema registered under ``<predictions topic>-value``). Default: the events' format.

#: A prediction as an Avro record (the fields of ``PREDICTION_SCHEMA``; times as timestamp-millis).
PREDICTION_AVRO = {"type": "record", "name": "Prediction", "namespace": "flowtrain", "fields": [
    {"name": "source", "type": "string"},
    {"name": "src_partition", "type": "long"},
    {"name": "src_offset", "type": "long"},
    {"name": "id", "type": ["null", "string"], "default": None},
    {"name": "prediction", "type": ["null", "float"], "default": None},
    {"name": "predicted_class", "type": ["null", "string"], "default": None},
    {"name": "probabilities", "type": ["null", {"type": "array", "items": "float"}], "default": None},
    {"name": "model_version", "type": "long"},
    {"name": "model_run", "type": ["null", "string"], "default": None},
    {"name": "event_time", "type": {"type": "long", "logicalType": "timestamp-millis"}},
    {"name": "scoring_time", "type": {"type": "long", "logicalType": "timestamp-millis"}},
    {"name": "label", "type": ["null", "float"], "default": None},
]}

#: (name, Protobuf type, repeated) of the Protobuf message's fields, numbered from 1 in this order; times are
#: milliseconds since the epoch (UTC).
_PROTO_FIELDS = (("source", "string", False), ("src_partition", "int64", False), ("src_offset", "int64", False),
                 ("id", "string", False), ("prediction", "float", False), ("predicted_class", "string", False),
                 ("probabilities", "float", True), ("model_version", "int64", False), ("model_run", "string", False),
                 ("event_time", "int64", False), ("scoring_time", "int64", False), ("label", "float", False))
#: A prediction as a Protobuf message (proto2; the text registered for it).
PREDICTION_PROTO = 'syntax = "proto2";\npackage flowtrain;\n\nmessage Prediction {\n' + "".join(
    f"  {'repeated' if rep else 'optional'} {t} {name} = {i};\n"
    for i, (name, t, rep) in enumerate(_PROTO_FIELDS, 1)) + "}\n"
_TIMES = ("event_time", "scoring_time")


def predictions_format(chosen: str | None, event_format: str) -> str:
    """The format the scorer writes predictions in: ``chosen`` (``--predictions-format``), else the events' own
    (JSON events: Arrow record batches, as before event formats)."""
    if chosen is None:
        return "arrow" if event_format == "json" else event_format
    if chosen not in PREDICTIONS_FORMATS:
        raise ValueError(f"--predictions-format {chosen!r}: expected one of {', '.join(PREDICTIONS_FORMATS)}")
    return chosen


def _prediction_message_class():
    """The Protobuf class of ``PREDICTION_PROTO``, from a descriptor built here (no protoc)."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    F = descriptor_pb2.FieldDescriptorProto
    proto = descriptor_pb2.FileDescriptorProto(name="flowtrain_prediction.proto", package="flowtrain",
                                               syntax="proto2")
    message = proto.message_type.add(name="Prediction")
    kinds = {"string": F.TYPE_STRING, "int64": F.TYPE_INT64, "float": F.TYPE_FLOAT}
    for i, (name, t, rep) in enumerate(_PROTO_FIELDS, 1):
        message.field.add(name=name, number=i, type=kinds[t], label=F.LABEL_REPEATED if rep else F.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("flowtrain.Prediction"))


class PredictionsCodec:
    """Predictions as the scorer writes them (``fmt``: one of ``PREDICTIONS_FORMATS``) and back.

    ``encode(preds, max_bytes)`` -> (messages, the rows they hold, [(row, reason)] of rows that cannot be written);
    ``decode(value)`` -> the predictions of one message as dicts (``PREDICTION_SCHEMA``'s fields; times as
    milliseconds since the epoch in JSON and Protobuf, datetimes otherwise). With a ``registry`` (a
    ``pipelines.stream.formats.SchemaRegistry``) Avro and Protobuf records are in the Confluent wire format: the
    schema is registered under ``subject`` on the first ``encode``, and read by id on ``decode``."""

    def __init__(self, fmt: str, registry=None, subject: str | None = None):
        if fmt not in PREDICTIONS_FORMATS:
            raise ValueError(f"--predictions-format {fmt!r}: expected one of {', '.join(PREDICTIONS_FORMATS)}")
        self.fmt, self.registry, self.subject = fmt, registry, subject
        self.schema_id: int | None = None
        self._parsed = self._cls = None

    def __getstate__(self):
        return {"fmt": self.fmt, "registry": self.registry, "subject": self.subject, "schema_id": self.schema_id}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._parsed = self._cls = None

    @property
    def schema_text(self) -> str | None:
        """The schema of the predictions (Avro JSON, a .proto); None for Arrow and JSON."""
        if self.fmt == "avro":
            return json.dumps(PREDICTION_AVRO)
        return PREDICTION_PROTO if self.fmt == "protobuf" else None

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
        """One prediction (a dict of ``PREDICTION_SCHEMA``'s fields) as one message value."""
        if self.fmt == "json":
            return json.dumps({k: (_epoch_ms(v) if k in _TIMES else v) for k, v in row.items()},
                              allow_nan=False).encode()
        if self.fmt == "avro":
            if self._parsed is None:
                self._parsed = fastavro.parse_schema(PREDICTION_AVRO)
            buf = io.BytesIO()
            fastavro.schemaless_writer(buf, self._parsed, row)
            payload, indexes = buf.getvalue(), None
        elif self.fmt == "protobuf":
            if self._cls is None:
                self._cls = _prediction_message_class()
            msg = self._cls()
            for name, _, rep in _PROTO_FIELDS:
                value = row.get(name)
                if value is None:
                    continue
                if rep:
                    getattr(msg, name).extend(value)
                else:
                    setattr(msg, name, _epoch_ms(value) if name in _TIMES else value)
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
        body, text = value, self.schema_text
        if self.registry is not None:
            schema_id, _, body = unframe(value, protobuf=self.fmt == "protobuf")
            found = self.registry.schema(schema_id)
            if found is None:
                raise ValueError(f"unknown schema id {schema_id}: the schema registry {self.registry.url} does "
                                 f"not know it")
            text = found[1]
        if self.fmt == "avro":
            return [fastavro.schemaless_reader(io.BytesIO(body), fastavro.parse_schema(json.loads(text)))]
        if text.split() != PREDICTION_PROTO.split():
            raise ValueError("the record's Protobuf schema is not flowtrain's prediction message")
        if self._cls is None:
            self._cls = _prediction_message_class()
        msg = self._cls()
        msg.ParseFromString(body)
        return [{name: (list(getattr(msg, name)) or None) if rep else
                 (getattr(msg, name) if msg.HasField(name) else None) for name, _, rep in _PROTO_FIELDS}]


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

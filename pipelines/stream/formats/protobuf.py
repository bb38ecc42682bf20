"""Protobuf events (``--event-format protobuf``): a proto2 message of the dataset's fields, or the writer's
(``--schema-file``, the registry's by id), decoded and resolved to the dataset's fields by name."""
from __future__ import annotations

from pipelines.stream.formats.base import EventFormat, converter, writer_value
from pipelines.stream.formats.registry import PROTOBUF
from pipelines.stream.formats.schemas import (
    BOOLEAN_TYPES,
    INTEGER_TYPES,
    SchemaField,
    field_type,
    fields_of_proto,
    proto_text,
)


class ProtobufFormat(EventFormat):
    """Protobuf (proto2, one message of scalar fields), its descriptor built from the schema text at run time
    (no protoc); decoded with the writer's message, resolved to the dataset's fields by name."""

    name = "protobuf"
    registry_type = PROTOBUF

    def dataset_schema_text(self) -> str:
        return proto_text(self.events, self.record)

    def encode_payload(self, event: dict) -> bytes:
        if getattr(self, "_writer_cls", None) is None:
            fields = fields_of_proto(self.writer_text)
            self._writer_cls, self._writer_fields = _message_class(fields), fields
        msg = self._writer_cls()
        for f in self._writer_fields:
            value = writer_value(f.name, f.type, event.get(f.name))
            if value is not None:
                setattr(msg, f.name, value)
        return msg.SerializeToString()

    def _decoder(self, text: str, indexes, where: str):
        fields = fields_of_proto(text, (indexes or (0,))[0])
        by_name = self._resolve(fields, where)
        cls = _message_class(fields)
        # only the fields whose writer type gives another Python type than the dataset's are converted; a field
        # the message does not set (or the writer does not have) is absent: null
        convert = [(f.name, converter(field_type(f))) for f in self.events.fields
                   if f.name in by_name and _value_kind(by_name[f.name].type) != field_type(f)]

        def decode(body: bytes) -> dict:
            msg = cls()
            msg.ParseFromString(body)
            row = {fd.name: value for fd, value in msg.ListFields()}
            for name, conv in convert:
                if name in row:
                    row[name] = conv(row[name])
            return row

        return decode


def _value_kind(t: str) -> str:
    """The dataset type whose Python values a writer's scalar type gives as they are."""
    if t in ("double", "float"):
        return "double"
    if t in INTEGER_TYPES:
        return "long"
    return "boolean" if t in BOOLEAN_TYPES else t


_PROTO_TYPES = {"double": "TYPE_DOUBLE", "float": "TYPE_FLOAT", "int32": "TYPE_INT32", "int64": "TYPE_INT64",
                "uint32": "TYPE_UINT32", "uint64": "TYPE_UINT64", "sint32": "TYPE_SINT32", "sint64": "TYPE_SINT64",
                "fixed32": "TYPE_FIXED32", "fixed64": "TYPE_FIXED64", "sfixed32": "TYPE_SFIXED32",
                "sfixed64": "TYPE_SFIXED64", "bool": "TYPE_BOOL", "string": "TYPE_STRING", "bytes": "TYPE_BYTES"}


def _message_class(fields: list[SchemaField]):
    """A message class of these scalar fields, from a descriptor built here (``descriptor_pb2``)."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    proto = descriptor_pb2.FileDescriptorProto(name="flowtrain_event.proto", package="flowtrain_event",
                                               syntax="proto2")
    message = proto.message_type.add(name="Event")
    for f in fields:
        kind = _PROTO_TYPES.get(f.type)
        if kind is None:
            raise ValueError(f"field {f.name!r} has type {f.type}, not a scalar type events can hold")
        message.field.add(name=f.name, number=f.number, label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL,
                          type=getattr(descriptor_pb2.FieldDescriptorProto, kind))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("flowtrain_event.Event"))

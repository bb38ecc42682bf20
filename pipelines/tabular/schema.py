"""The schema check of tabular input: the declared columns and the types a file must have, and the
Arrow types the files are read with (``SchemaError`` when a file does not fit, before any training)."""
from __future__ import annotations

import pyarrow as pa

from connectors.dataset_spec import FeatureSpec


class SchemaError(ValueError):
    """Input files do not have the declared columns or types; raised before any training."""


def column_kind(t: pa.DataType) -> str:
    """The kind of values an Arrow type holds: ``number``, ``string``, ``boolean``, ``time``, ``null``, or the
    type itself."""
    if pa.types.is_dictionary(t):
        return column_kind(t.value_type)
    if pa.types.is_boolean(t):
        return "boolean"
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t):
        return "number"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "string"
    if pa.types.is_timestamp(t) or pa.types.is_date(t):
        return "time"
    if pa.types.is_null(t):
        return "null"
    return str(t)


def check_schema(schema: pa.Schema, spec: FeatureSpec, where: str) -> None:
    """Missing or wrongly typed declared columns -> ``SchemaError`` naming file, column, types."""
    names = set(schema.names)
    missing = [c for c in spec.input_columns if c not in names]
    if missing:
        raise SchemaError(f"{where}: missing declared column(s) {', '.join(missing)}; "
                          f"the file has {', '.join(schema.names)}")
    wanted = {c: ("number",) for c in spec.all_numeric}
    wanted.update({c: ("string", "number", "boolean") for c in spec.categorical})
    wanted.update({c: ("string", "number") for c in spec.id_columns})
    wanted[spec.label] = ("number", "boolean") if spec.task == "regression" or spec.positive_above is not None \
        else ("number", "boolean", "string")
    if spec.time_column:
        wanted[spec.time_column] = ("time", "number", "string")
    if spec.weight_column:
        wanted[spec.weight_column] = ("number",)
    for col, kinds in wanted.items():
        found = column_kind(schema.field(col).type)
        if found == "binary":
            raise SchemaError(f"{where}: column {col!r} is not UTF-8 text; save the file as UTF-8")
        if found not in kinds and found != "null":
            raise SchemaError(f"{where}: column {col!r} has type {schema.field(col).type} ({found}); "
                              f"expected {' or '.join(kinds)}")


def read_types(spec: FeatureSpec) -> dict[str, pa.DataType | None]:
    """The Arrow type each declared input column is read as (files are read with these types,
    so a late odd value rejects its row instead of failing the file)."""
    types: dict[str, pa.DataType | None] = {c: pa.float64() for c in spec.all_numeric}
    types.update({c: pa.string() for c in spec.categorical})
    types.update({c: pa.string() for c in spec.id_columns})  # 42 and "42" are the same ID
    numeric_label = spec.task == "regression" or spec.positive_above is not None
    types[spec.label] = pa.float64() if numeric_label else None  # class labels keep their type
    if spec.time_column and spec.time_column not in types:
        types[spec.time_column] = None
    if spec.weight_column:
        types[spec.weight_column] = pa.float64()
    return types

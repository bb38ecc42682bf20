"""``flowtrain schema``: a dataset's events as an Avro record schema or a Protobuf ``.proto`` (what
``--event-format`` writes and reads, ``pipelines.stream.formats``), or a writer's schema file checked against
the dataset's fields. ``run_schema(SchemaJob(...))`` prints what the command prints and returns its exit status:
0, 1 when ``--check``'s file does not give every field, 2 for a bad dataset or schema file (one line)."""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from connectors.dataset import read_manifest
from connectors.dataset_spec import FeatureSpec
from connectors.fields import option, tailor
from flowtrain.commands.shared_options import Dataset
from flowtrain.errors import FlowtrainError
from pipelines.stream.events import event_schema
from pipelines.stream.formats import event_format

FORMATS = ("avro", "protobuf")


@dataclass
@tailor(dataset={"help": "the `flowtrain batch` dataset directory (required, no default)", "metavar": "DIR"})
class SchemaJob(Dataset):
    """The options of ``flowtrain schema``."""
    schema_format: str | None = option(None, "avro: the record schema (JSON, an .avsc); protobuf: the message "
                                             "(.proto, proto2) (required, no default)", choices=FORMATS, flag="--format")
    check: str | None = option(None, "a writer's schema file to resolve against the dataset's fields",
                               metavar="FILE")


def run_schema(job: SchemaJob) -> int:
    if not job.dataset or not job.schema_format:
        missing = [f for f, v in (("--dataset DIR", job.dataset), ("--format avro|protobuf", job.schema_format))
                   if not v]
        raise FlowtrainError(f"{' and '.join(missing)} {'are' if len(missing) > 1 else 'is'} required: the "
                             f"`flowtrain batch` dataset whose events to describe, and the schema language")
    try:
        manifest = read_manifest(job.dataset)
        spec = FeatureSpec.from_dict(manifest["spec"])
    except Exception as err:  # noqa: BLE001 - not a dataset, or one without a spec
        print(f"flowtrain schema: --dataset {job.dataset}: not a `flowtrain batch` dataset with a spec "
              f"({type(err).__name__}: {str(err)[:200]})", file=sys.stderr)
        return 2
    name = manifest.get("name") or Path(job.dataset).resolve().name
    try:
        fmt = event_format(job.schema_format, event_schema(spec), schema_file=job.check, record=name)
    except ValueError as err:
        print(f"flowtrain schema: {err}", file=sys.stderr)
        return 2
    if job.check:
        reason = fmt.check_writer()
        if reason:
            print(f"flowtrain schema: --check {job.check}: {reason}", file=sys.stderr)
            return 1
        print(f"schema: {job.check} resolves to the dataset's fields")
        return 0
    text = fmt.schema_text
    print(json.dumps(json.loads(text), indent=2) if job.schema_format == "avro" else text, end="\n"
          if job.schema_format == "avro" else "")
    return 0

"""``flowtrain registry start|stop|status`` (a local Apicurio Registry; the jobs of ``flowtrain.commands.local``)
and ``flowtrain schema`` (``flowtrain.commands.stream.schema``): each parser's flags are the fields of its job."""
from __future__ import annotations

import argparse

from connectors.fields import build
from flowtrain.cli.options import add_fields, print_config
from flowtrain.commands.local import ACTIONS, run_registry
from flowtrain.commands.stream.schema import SchemaJob, run_schema

_CACHE = ("Apicurio Registry is fetched from Maven Central with mvn on first use into ~/.cache/flowtrain/apicurio "
          "(or $FLOWTRAIN_CACHE).")
_ACTIONS = {"start": "start the registry and wait until it answers; nothing to do when it runs",
            "stop": "stop the registry started with the same --port and --data-dir",
            "status": "whether the registry runs and answers"}


def register(sub) -> None:
    reg = sub.add_parser(
        "registry", help="start, stop or inspect a local Schema Registry (Apicurio Registry, 127.0.0.1, in memory)",
        description="A real Confluent-compatible Schema Registry on 127.0.0.1: Apicurio Registry with in-memory "
                    "storage (a restart forgets its schemas); its API for --schema-registry is "
                    "http://127.0.0.1:PORT/apis/ccompat/v7. " + _CACHE)
    actions = reg.add_subparsers(dest="action", metavar="ACTION", required=True)
    for name, text in _ACTIONS.items():
        a = actions.add_parser(name, help=text, description=text[0].upper() + text[1:] + ". " + _CACHE)
        add_fields(a, ACTIONS["registry"][name])
        a.set_defaults(func=_run, options_parser=a, job_class=ACTIONS["registry"][name])

    s = sub.add_parser(
        "schema", help="a dataset's events as an Avro schema or a Protobuf .proto (what --event-format writes)",
        description="Prints the Avro record schema (JSON) or the Protobuf message (.proto, proto2) of the events of "
                    "a `flowtrain batch` dataset: one field per input column, the label optional; what `flowtrain "
                    "replay --event-format` writes and `flowtrain stream --event-format` reads without --schema-file. "
                    "With --check FILE: reads FILE (an .avsc or .proto) back and says whether events written with it "
                    "give every field the dataset needs.")
    add_fields(s, SchemaJob)
    s.set_defaults(func=_run, options_parser=s, job_class=SchemaJob)


def _run(args: argparse.Namespace) -> int:
    job = build(args.job_class, args.options)
    if args.print_config:
        print_config(job)
        return 0
    return run_schema(job) if isinstance(job, SchemaJob) else run_registry(args.action, job)

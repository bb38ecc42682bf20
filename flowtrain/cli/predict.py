"""``flowtrain predict`` and ``flowtrain export``: the flags of ``PredictJob`` / ``ExportJob``
(``flowtrain.commands.predict.job``), which run the jobs."""
from __future__ import annotations

import argparse

from flowtrain.cli.options import add_fields, print_config
from flowtrain.commands.batch.options import ExportJob
from flowtrain.commands.predict.options import PredictJob


def register(sub) -> None:
    p = sub.add_parser(
        "predict", help="predict files with a trained model (Beam batch pipeline, RunInference)",
        description="Reads CSV, Parquet or JSON-lines files, featurizes them with the model's training statistics "
                    "(the batch ETL's feature code), runs Beam RunInference (one forward per Arrow batch) and writes "
                    "one predictions file (Parquet, or CSV by extension). Rows that cannot be predicted go to the "
                    "dead letters with file:line and reason; where the label column is present the task's metrics "
                    "are printed and written to <out>.metrics.json. Options flowtrain does not know go to Beam.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_fields(p, PredictJob)
    p.set_defaults(func=_predict, accepts_beam_args=True, options_parser=p)

    e = sub.add_parser(
        "export", help="write a run's model bundle (weights, architecture, feature spec and statistics, checksums)",
        description="Writes the bundle of a `flowtrain batch` run: everything needed to predict without the dataset "
                    "or the run directory (every batch run also writes one as <run>/bundle/). Load it with "
                    "flowtrain.load(DIR) or predict with `flowtrain predict --model DIR`.")
    e.add_argument("run_positional", nargs="?", default=None, metavar="RUN", help="the run directory (or --run)")
    add_fields(e, ExportJob)
    e.set_defaults(func=_export, options_parser=e)


def _predict(args: argparse.Namespace, beam_args: list[str] | None = None) -> int:
    from connectors.fields import build
    from flowtrain.commands.predict.job import run_predict

    options = dict(args.options)
    options["beam_args"] = [*(options.get("beam_args") or []), *(beam_args or [])]
    job = build(PredictJob, options)
    if args.print_config:
        print_config(job)
        return 0
    run_predict(job)
    return 0


def _export(args: argparse.Namespace) -> int:
    from connectors.fields import build
    from flowtrain.commands.batch.export import run_export

    options = dict(args.options)
    if args.run_positional:
        options["run"] = args.run_positional
    job = build(ExportJob, options)
    if args.print_config:
        print_config(job)
        return 0
    print(f"bundle: {run_export(job)}")
    return 0

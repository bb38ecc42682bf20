"""``flowtrain tune``: the flags of ``TuneJob`` (``flowtrain.commands.tune.options``), which runs the study."""
from __future__ import annotations

import argparse

from connectors.fields import build
from flowtrain.cli.options import add_fields, print_config
from flowtrain.commands.tune import options as tune_job
from flowtrain.commands.tune.options import TuneJob


def register(sub) -> None:
    p = sub.add_parser(
        "tune", help="hyperparameter search: an Optuna study over flowtrain batch runs on one ETL'd dataset",
        description="Runs the batch ETL once, then an Optuna study whose trials are flowtrain batch runs on that "
                    "dataset (each in its own process and run directory), pruned on their validation curves; "
                    "resumes from its storage; writes the best trial's run and bundle and a report. Needs Optuna "
                    "(pip install 'flowtrain[tune]').",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=tune_job.__doc__)
    add_fields(p, TuneJob)
    p.set_defaults(func=run_command, accepts_beam_args=True, options_parser=p)


def run_command(args: argparse.Namespace, beam_args: list[str] | None = None) -> int:
    options = dict(args.options)
    options["beam_args"] = [*(options.get("beam_args") or []), *(beam_args or [])]
    job = build(TuneJob, options)
    if args.print_config:
        print_config(job)
        return 0
    from flowtrain.commands.tune.run import run_tune  # Optuna and the engine: only when a study runs

    run_tune(job)
    return 0

"""``flowtrain drift``: the flags of ``DriftJob`` (``flowtrain.commands.drift.job``), which runs the comparison."""
from __future__ import annotations

import argparse

from flowtrain.cli.options import add_fields, print_config
from flowtrain.commands.drift.options import DRIFT_EXIT, DriftJob


def register(sub) -> None:
    p = sub.add_parser(
        "drift", help="compare files with a model's training data: feature, label and score drift, data quality",
        description="Reads CSV, Parquet or JSON-lines files, featurizes them with the model's training statistics "
                    "(as flowtrain predict does) and compares every feature, the label (when present) and the "
                    "model's scores with the reference profile the batch run stored: PSI and Jensen-Shannon for "
                    "numeric features, L-infinity and the unseen-value rate for categorical ones, missing rates, "
                    "values outside the training range, constant features. Writes drift.json and drift.html under "
                    "--out. Exit code 3 when a measure crosses its threshold (for CI and cron), 0 otherwise.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_fields(p, DriftJob)
    p.set_defaults(func=_drift, options_parser=p)


def _drift(args: argparse.Namespace) -> int:
    from connectors.fields import build
    from flowtrain.commands.drift.job import run_drift

    job = build(DriftJob, dict(args.options))
    if args.print_config:
        print_config(job)
        return 0
    report = run_drift(job)
    return DRIFT_EXIT if report["alarms"] else 0

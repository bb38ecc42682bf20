"""``flowtrain skew``: the flags of ``SkewJob`` (``flowtrain.commands.skew``), which compares the values."""
from __future__ import annotations

import argparse

from connectors.fields import build
from flowtrain.cli.options import add_fields, print_config
from flowtrain.commands import skew as skew_job
from flowtrain.commands.skew import SkewJob, run_skew


def register(sub) -> None:
    p = sub.add_parser(
        "skew", help="the skew gate: logged stream/served feature values vs the backfill of the same events",
        description="Compares the feature values a stream part logged (--log-features) with `flowtrain features`' "
                    "backfill of the same events, per feature; exit status 3 on a mismatch beyond --tolerance.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=skew_job.__doc__)
    add_fields(p, SkewJob)
    p.set_defaults(func=run_command, options_parser=p)


def run_command(args: argparse.Namespace) -> int:
    job = build(SkewJob, args.options)
    if args.print_config:
        print_config(job)
        return 0
    code, lines = run_skew(job)
    print("\n".join(lines))
    return code

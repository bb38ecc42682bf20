"""``flowtrain features`` and ``flowtrain skew``: the flags of ``FeaturesJob`` and ``SkewJob`` (their jobs run them)."""
from __future__ import annotations

import argparse

from connectors.fields import build
from flowtrain.cli.options import add_fields, print_config
from flowtrain.commands.features import job as features_job
from flowtrain.commands.features import skew as skew_job
from flowtrain.commands.features.options import FeaturesJob
from flowtrain.commands.features.skew import SkewJob, run_skew


def register(sub) -> None:
    p = sub.add_parser("features", help="features over time: windowed aggregations per key and as-of joins, one row "
                       "per input row", formatter_class=argparse.RawDescriptionHelpFormatter,
                       description=features_job.__doc__ + "\nOptions flowtrain does not know go to Beam.")
    add_fields(p, FeaturesJob)
    p.set_defaults(func=_features, accepts_beam_args=True, options_parser=p)
    s = sub.add_parser("skew", help="the skew gate: logged stream/served feature values vs their backfill",
                       formatter_class=argparse.RawDescriptionHelpFormatter, description=skew_job.__doc__)
    add_fields(s, SkewJob)
    s.set_defaults(func=_skew, options_parser=s)


def _features(args: argparse.Namespace, beam_args: list[str] | None = None) -> int:
    options = dict(args.options)
    options["beam_args"] = [*(options.get("beam_args") or []), *(beam_args or [])]
    job = build(FeaturesJob, options)
    if args.print_config:
        print_config(job)
        return 0
    features_job.run_features(job)
    return 0


def _skew(args: argparse.Namespace) -> int:
    job = build(SkewJob, args.options)
    if args.print_config:
        return print_config(job) or 0
    code, lines = run_skew(job)
    print("\n".join(lines))
    return code

"""The options of ``flowtrain drift`` (``DriftJob``) and ``--drift-threshold`` (``DriftThreshold``, shared with
``flowtrain predict`` and the scorer), with the reference profile's file name and the command's exit code; the
command line imports them at once, the comparison (``flowtrain.commands.drift.job``) when it runs."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import ClassVar

from connectors.fields import COMPOSED, at_least, narrow, option, store_path, tailor
from flowtrain.commands.shared_options import BundleKey, Input, Out, RunOrBundle, TrustCode
from flowtrain.train.rundir.files import file_name
from pipelines.drift.measures import parse_thresholds

#: The reference profile's file name, in a run directory and in its bundle.
REFERENCE = file_name("drift_reference")
#: ``flowtrain drift``'s exit code when a threshold is crossed.
DRIFT_EXIT = 3
_IO = "input and output"


def drift_thresholds(value) -> str:
    try:
        parse_thresholds(str(value))
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err).replace("--drift-threshold ", "")) from None
    return str(value)


drift_thresholds.__name__ = "thresholds"
THRESHOLD_HELP = ("measure thresholds, MEASURE=VALUE comma-separated (psi, js, linf, unseen, missing, "
                  "out_of_range, prediction, adwin); a measure above its threshold is an alarm. Defaults: psi=0.2, "
                  "js=0.1, linf=0.15, unseen=0.1, missing=0.1, out_of_range=0.01, prediction=0.2, adwin=0.002 "
                  "(docs/observability.md)")


@dataclass
class DriftThreshold:
    """``--drift-threshold``: ``flowtrain drift``'s, ``flowtrain predict``'s drift section's and the scorer's (section
    score) alarms, one parser and one set of defaults (``pipelines.drift.measures``)."""

    SECTION: ClassVar[str] = COMPOSED
    drift_threshold: str = option("", THRESHOLD_HELP, parse=drift_thresholds, metavar="MEASURE=VALUE,...")


@dataclass
@tailor(trust_code={"help": "the bundle's model is your own code (--model MODULE:FACTORY at training): import and "
                            "run it for the score distribution (only for a bundle you trust)"},
        bundle_key_file={"help": "verify the bundle's signature with this key (else $FLOWTRAIN_BUNDLE_KEY; "
                                 "default: not verified)"},
        model={"help": "a `flowtrain batch` run directory (its bundle/) or a bundle directory: its reference profile "
                       "is what the files are compared with", "group": _IO},
        input={"help": "CSV, Parquet or JSON-lines files or globs to compare (repeat or comma-separate); the label "
                       "column is optional", "group": _IO},
        # the report has a place of its own unless asked (the interface since drift was added)
        out={"default": "drift-report", "help": "directory of the report: drift.json and drift.html (replaced)",
             "group": _IO})
# it reads the model and writes the report in this process: local paths (or mounted ones) only
@narrow(model={"parse": store_path("--model", remote=False)}, out={"parse": store_path("--out", remote=False)})
class DriftJob(Out, Input, RunOrBundle, DriftThreshold, TrustCode, BundleKey):
    """The options of ``flowtrain drift``."""

    min_rows: int = option(100, "fewer rows than this are measured but never an alarm", parse=at_least(1))
    no_model: bool = option(False, "leave out the model's score distribution (no forward pass)")

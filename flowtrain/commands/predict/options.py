"""The options of ``flowtrain predict`` (``PredictJob``); the command line imports them at once, the job
(``flowtrain.commands.predict.job``) when it runs."""
from __future__ import annotations

from dataclasses import dataclass

from connectors.fields import GENERAL, narrow, option, store_path, tailor
from flowtrain.commands.dead_letter_bound import DeadLetterBound
from flowtrain.commands.drift.options import DriftThreshold
from flowtrain.commands.shared_options import (
    BeamArgs,
    BundleKey,
    Input,
    Out,
    Overwrite,
    RunnerOptions,
    RunOrBundle,
    TrustCode,
)
from flowtrain.train.options import DeviceOption, ThreadOptions
from pipelines.serving.options import IdColumn

_IO = "input and output"
_RUN = "where the Beam pipeline runs"


@dataclass
@tailor(id_column={"help": "copy this column (a row id) to every prediction", "group": _IO, "metavar": None},
        max_dead_letter_fraction={"group": _IO},
        drift_threshold={"help": "thresholds of the summary's drift section (the rows against the training data), "
                                 "MEASURE=VALUE comma-separated as `flowtrain drift --drift-threshold` (default: "
                                 "its defaults)", "group": _IO},
        overwrite={"help": "replace an existing --out (and its dead letters and metrics files), once the new ones "
                           "are complete", "group": _IO},
        bundle_key_file={"help": "verify the bundle's signature with this key (HMAC-SHA256, as `flowtrain export "
                                 "--bundle-key-file` signed it; else $FLOWTRAIN_BUNDLE_KEY; default: none, not "
                                 "verified)"},
        threads={"help": "torch threads of each worker (default: torch's choice)"},
        model={"group": _IO},
        input={"help": "CSV, Parquet, Avro or JSON-lines files or globs to predict (repeat or comma-separate); the "
                       "label column is optional", "group": _IO},
        out={"help": "predictions file: Parquet, or CSV when it ends in .csv", "group": _IO},
        # the forward of a batch of rows: the CPU unless asked (the interface since predict was added)
        device={"default": "cpu", "help": "where the forward runs", "group": GENERAL})
@narrow(input={"parse": store_path("--input", many=True)},
        device={"choices": ("cpu", "cuda")})  # no auto: the Beam workers' forward runs where it is told
class PredictJob(DeviceOption, Out, Input, RunOrBundle, IdColumn, DeadLetterBound, DriftThreshold, TrustCode, Overwrite, BundleKey,
                 BeamArgs, RunnerOptions, ThreadOptions):
    """The options of ``flowtrain predict``."""

    keep_columns: tuple[str, ...] = option((), "copy these columns too, comma-separated", group=_IO)
    dead_letters: str | None = option(None, "rows that cannot be predicted, with file:line and reason (JSON lines; "
                                      "default <out>.dead_letters.jsonl)", group=_IO,
                                      parse=store_path("--dead-letters"))
    flag_unseen: bool = option(False, "add a column pred_unseen listing, per row, the categorical features whose "
                               "value training never saw (or that are missing)", group=_IO)

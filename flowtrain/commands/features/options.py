"""The options of ``flowtrain features`` (``FeaturesJob``: the events, where their features go, the declaration and
where the Beam pipeline runs); ``import flowtrain`` and the command line import them at once, the backfill
(``flowtrain.commands.features.job``) when it runs."""
from __future__ import annotations

from dataclasses import dataclass

from connectors.fields import narrow, store_path, tailor
from flowtrain.commands.shared_options import (
    BeamArgs,
    Input,
    Out,
    Overwrite,
    RunnerOptions,
    TimeColumn,
    TimeFormat,
)
from pipelines.features.options import FeatureOptions

_RUN = "where the Beam pipeline runs"


@dataclass
@tailor(time_format={"help": "how the time column is written when it is text: a strptime format, or epoch / "
                             "epoch_ms / epoch_us / epoch_ns for numbers"},
        time_column={"help": "each event's time (ISO date/time, YYYY/MM/DD, epoch seconds, a timestamp or "
                             "--time-format); needed by --aggregate"},
        input={"help": "CSV, Parquet, Avro or JSON-lines files or globs of events (repeat or comma-separate)"},
        out={"help": "the Parquet file to write (one row per input row, in input order)"})
@narrow(input={"parse": store_path("--input", many=True)})
class FeatureInputs(Out, Input, TimeFormat, TimeColumn, Overwrite):
    """The events and where their features go."""


@dataclass
class FeaturesJob(BeamArgs, RunnerOptions, FeatureOptions, FeatureInputs):
    """The options of ``flowtrain features``."""

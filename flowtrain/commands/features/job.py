"""``flowtrain features``: the backfill of features over time, one row per input row.

``run_features(FeaturesJob(input=..., time_column=..., aggregations=[...], joins=[...], out="table.parquet"))``
reads the files, computes every ``--aggregate`` of every row over ``[t - w, t)`` in event time and every ``--join``
as of the row's time (``pipelines.features.backfill``: a Beam pipeline keyed by KEY, time-ordered within a key),
and writes ``--out``: one Parquet file, the input's rows in the input's order (files in the order given, rows in
each file's order), their columns then the aggregates and the joined columns. ``flowtrain batch`` runs the same
backfill before its ETL when given aggregations or joins (docs/features.md).
"""
from __future__ import annotations

import time

from flowtrain.commands.features.options import FeaturesJob
from flowtrain.errors import FlowtrainError
from flowtrain.local.runners import RunnerError, pipeline_options
from pipelines.features.backfill import run_backfill
from pipelines.features.declare import last_k


def declaration_of(job) -> object:
    """The job's checked declaration (``FeatureOptions``); a ``--aggregate`` without ``--time-column`` is an error."""
    try:
        decl = job.declaration()
    except ValueError as err:
        raise FlowtrainError(str(err)) from None
    if decl.aggregations and not job.time_column:
        raise FlowtrainError("--aggregate needs --time-column: the window of an event is [t - w, t) in event time")
    if decl.joins and any(j.valid_from for j in decl.joins) and not job.time_column:
        raise FlowtrainError("--join with VALID_FROM needs --time-column: the table is joined as of each event's time")
    return decl


def backfill(job, inputs: list[str], out: str, *, quiet: bool = False, overwrite: bool | None = None) -> dict:
    """The backfill of ``inputs`` into ``out`` with ``job``'s declaration, time column and runner; the counts."""
    decl = declaration_of(job)
    t0 = time.perf_counter()
    try:
        options = pipeline_options("batch", list(job.beam_args), runner=job.runner, flink_master=job.flink_master)
        counts = run_backfill(inputs, decl, time_column=job.time_column or "", time_format=job.time_format, out=out,
                              options=options,
                              overwrite=getattr(job, "overwrite", False) if overwrite is None else overwrite)
    except RunnerError as err:
        raise FlowtrainError(str(err)) from None
    counts["seconds"] = round(time.perf_counter() - t0, 3)
    if not quiet:
        extra = [f"{n:,} {what}" for what, n in counts.items() if str(what).startswith("rows without") and n]
        print(f"features: {counts.get('rows_in', 0):,} rows -> {out} ({len(decl.aggregate_names())} aggregates, "
              f"{len(decl.joins)} joins, {counts['seconds']:.1f} s)" + (f"; {', '.join(extra)} (their aggregates "
                                                                         f"are empty)" if extra else ""), flush=True)
    return counts


def run_features(job: FeaturesJob) -> dict:
    """Run ``flowtrain features``; returns the counts (rows in and out, rows without a time or a key, seconds)."""
    if not job.input:
        raise FlowtrainError("flowtrain features needs --input (the events)")
    if not job.out:
        raise FlowtrainError("flowtrain features needs --out (the Parquet file to write)")
    if not (job.aggregations or job.joins):
        raise FlowtrainError("nothing to compute: give --aggregate KEY:COLUMN:AGGS:WINDOWS and/or --join "
                             "TABLE:KEY[:VALID_FROM]")
    return backfill(job, list(job.input), job.out)


def feature_columns(decl, schema, joined) -> dict[str, list[str]]:
    """The roles of the backfill's columns in a dataset (``flowtrain batch``): ``KEY_seen``, counts, distinct counts
    and sums ``numeric`` (never missing); means, min, max, std and last/lastK of numbers ``optional_numeric`` (missing
    in an empty window); last/lastK of text ``categorical``; joined columns by their type."""
    out: dict[str, list[str]] = {"numeric": [], "optional_numeric": [], "categorical": []}

    def place(name: str, always: bool) -> None:
        text = str(schema.field(name).type) in ("string", "large_string")
        out["categorical" if text else "numeric" if always else "optional_numeric"].append(name)

    for key in decl.keys():
        place(decl.seen_name(key), True)
    for a in decl.aggregations:
        for w in a.windows:
            for agg in a.aggs:
                base = a.feature(agg, w)
                k = last_k(agg)
                for name in ([f"{base}_{i}" for i in range(1, k + 1)] if k else [base]):
                    place(name, agg in ("count", "distinct", "sum"))
    for name in joined:
        place(name, False)
    return out

"""``flowtrain skew``: the skew gate. The feature values a stream part logged (``--log-features`` of ``flowtrain
stream pipeline`` / ``stream score``) against the backfill of the same events (``flowtrain features``), per
feature: mismatches, missing, extra, the largest difference. Exit status 3 when any value differs by more than
``--tolerance`` (default 1e-9) relative (``pipelines.features.skew``)."""
from __future__ import annotations

from dataclasses import dataclass

from connectors.fields import above, option
from flowtrain.errors import FlowtrainError
from pipelines.features.skew import TOLERANCE, compare, read_logged

#: The exit status of a skew beyond the tolerance.
SKEW_EXIT = 3


@dataclass
class SkewJob:
    """The options of ``flowtrain skew``."""

    logged: tuple[str, ...] = option((), "the logged feature values: --log-features directories or their .jsonl "
                                         "files (repeat or comma-separate)", repeat=True)
    backfill: str | None = option(None, "the backfill of the same events: `flowtrain features --out`'s Parquet file")
    id: str | None = option(None, "the event column both hold, one value per event (e.g. a transaction id)")
    features: tuple[str, ...] = option((), "the feature columns to compare (default: every backfill column the "
                                           "logged rows hold)")
    tolerance: float = option(TOLERANCE, "the largest relative difference that is not a mismatch", parse=above(0))


def run_skew(job: SkewJob) -> tuple[int, list[str]]:
    """(exit status: 0, or 3 on a mismatch; the report's lines)."""
    import pyarrow.parquet as pq

    if not job.logged or not job.backfill or not job.id:
        raise FlowtrainError("flowtrain skew needs --logged, --backfill and --id")
    try:
        logged = read_logged(job.logged)
        backfill = pq.read_table(job.backfill)
        report = compare(logged, backfill, job.id, features=list(job.features) or None, tolerance=job.tolerance)
    except (OSError, ValueError) as err:
        raise FlowtrainError(str(err)) from None
    lines = report.lines()
    verdict = (f"skew: {report.mismatches:,} mismatches beyond {job.tolerance:g} relative" if report.mismatches else
               f"skew: none: every compared value within {job.tolerance:g} relative")
    return (SKEW_EXIT if report.mismatches else 0), [*lines, verdict]

"""The options that declare features over time, declared once (``connectors.fields``) for every command that
takes them (``flowtrain features``, ``flowtrain batch``, the stream's): ``--aggregate`` (YAML ``aggregations:``)
and ``--join`` (YAML ``joins:``), each repeatable, checked as they are parsed (``pipelines.features.declare``).
Stdlib only: ``flowtrain --help`` imports this."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from connectors.fields import at_least, option
from pipelines.features.declare import Declaration, DeclarationError, declare, parse_aggregate, parse_join

FEATURES = "features over time (docs/features.md)"


def _declarations(parse, flag: str):
    def check(value: Any) -> tuple:
        items = value if isinstance(value, (list, tuple)) else [value]
        out = []
        for item in items:
            try:
                parse(item)
            except DeclarationError as err:
                raise argparse.ArgumentTypeError(str(err).removeprefix(f"{flag} ")) from None
            out.append(item if isinstance(item, str) else dict(item))
        return tuple(out)

    return check


aggregations_of = _declarations(parse_aggregate, "--aggregate")
aggregations_of.__name__ = "KEY:COLUMN:AGGS:WINDOWS"
joins_of = _declarations(parse_join, "--join")
joins_of.__name__ = "TABLE:KEY[:VALID_FROM]"


@dataclass
class FeatureOptions:
    """``--aggregate`` and ``--join`` (YAML ``aggregations:`` and ``joins:``, at the top level)."""

    aggregations: tuple = option(
        (), "an aggregation per key over time windows, KEY:COLUMN:AGGS:WINDOWS (repeat), e.g. "
            "card:amount:count,sum,mean:10m,1h,1d; COLUMN * counts the key's events; AGGS of count, sum, mean, min, "
            "max, std, distinct, last, lastK; WINDOWS Ns/Nm/Nh/Nd or life. The window of an event at t is [t - w, t) "
            "in event time (needs --time-column)", parse=aggregations_of, repeat=True, group=FEATURES,
        flag="--aggregate", metavar="KEY:COLUMN:AGGS:WINDOWS")
    joins: tuple = option(
        (), "a table joined as of each event's time, TABLE:KEY[:VALID_FROM] (repeat): its other columns, prefixed "
            "KEY_, from the row of the event's key with the greatest VALID_FROM at or before the event's time "
            "(without VALID_FROM: a static lookup)", parse=joins_of, repeat=True, group=FEATURES, flag="--join",
        metavar="TABLE:KEY[:VALID_FROM]")

    def declaration(self) -> Declaration:
        """The checked declaration (a ``DeclarationError`` for a feature named twice)."""
        return declare(self.aggregations or (), self.joins or ())


@dataclass
class StreamFeatureOptions(FeatureOptions):
    """What the stream's parts (the feature pipeline, the scorer) add to the declaration: the allowed lateness,
    where the states live, where each event's feature values are logged."""

    allowed_lateness: float = option(
        0.0, "seconds an event may come behind the greatest event time its raw partition has delivered and still "
             "count (later: a dead letter, reason late); an event's aggregates go out once its partition's watermark "
             "is this far past it (0: at once)", parse=at_least(0, float), group=FEATURES, metavar="SECONDS")
    feature_state: str | None = option(
        None, "directory of the aggregations' states, one SQLite file per consumer group and raw partition, written "
              "with the offsets each flush commits (default: <out>/feature-state)", group=FEATURES, metavar="DIR")
    log_features: str | None = option(
        None, "write each event's aggregates and joined columns (with its own fields) as JSON lines under this "
              "directory, one file per consumer group and raw partition (`flowtrain skew` compares them with the "
              "backfill)", group=FEATURES, metavar="DIR")
    log_features_id: str | None = option(
        None, "with --log-features: an event field that names the event (e.g. a transaction id), logged with its "
              "values (`flowtrain skew --id`)", group=FEATURES, metavar="COLUMN")

"""Features over time: aggregations per key over event-time windows and as-of joins, declared once
(``declare``, ``options``), computed by one core (``core``: a per-key state machine with exact sums, ``exact``;
its states as bytes, ``state``) in two Beam shapes: the backfill over files (``backfill``) and the stream.
docs/features.md is the user's page."""

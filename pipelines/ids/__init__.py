"""ID tables on the serving side: a scorer's copy of each ID table, kept current by the versions the
trainer publishes (a snapshot, then deltas applied strictly in order: ``serving``)."""

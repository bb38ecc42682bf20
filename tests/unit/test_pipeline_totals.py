"""``flowtrain stream pipeline``'s totals over its DoFn instances' status files (``pipeline_totals``) and the line it
prints when it stops: late events and the joined topics' counters appear only with features over time; a joined
topic's rejected records are the same for every instance (each reads the whole topic: the largest count, not the
sum), late versions add up (each instance's own events)."""
from __future__ import annotations

from flowtrain.commands.stream.pipeline import pipeline_summary, pipeline_totals
from pipelines.stream.status import write_status


def test_totals_add_the_instances_and_name_late_events_and_joined_topics_only_when_there(tmp_path):
    prefix = str(tmp_path / "pipeline-status.json")
    base = {"events": 10, "rows": 7, "unlabelled": 1, "dead_letters": 2}
    one, two = object(), object()  # two DoFn instances (a status file each, named by the instance)
    write_status(prefix, one, base)
    write_status(prefix, two, base)
    plain = pipeline_totals(tmp_path)
    assert (plain["events"], plain["rows"], plain["dead_letters"]) == (20, 14, 4) and "late" not in plain
    assert pipeline_summary(plain).endswith("acknowledged by Kafka and committed")

    (tmp_path / "f").mkdir()
    prefix = str(tmp_path / "f" / "pipeline-status.json")
    write_status(prefix, one, {**base, "late": 1, "waiting": 0, "join_rejected": 3, "join_late_updates": 1})
    write_status(prefix, two, {**base, "late": 2, "waiting": 0, "join_rejected": 3, "join_late_updates": 2})
    totals = pipeline_totals(tmp_path / "f")
    assert (totals["late"], totals["join_rejected"], totals["join_late_updates"]) == (3, 3, 3)
    assert pipeline_summary(totals).endswith("; 3 of the dead letters late (features over time); joined topics: 3 "
                                             "record(s) rejected, 3 version(s) late")

"""The stream scorer on the real broker and Prism (issue 29 items 1 and 7): an event field named like a column of
flowtrain's outputs in `flowtrain predict` (`model_version`) carried with --id-column keeps its name in the message,
flowtrain's own is `pred_model_version` (#45 item 4);
events with a site training never saw are scored and counted per column in the status."""
from __future__ import annotations

import pytest

from pipelines.stream.status import read_status
from tests.procs import stop_group
from tests.scoring_helpers import (
    batch_model,
    make_sensor,
    produce,
    publish,
    publisher,
    scorer,
    topic_names,
    wait_covered,
)
from tests.sensor_data import sensor_rows


@pytest.mark.kafka
@pytest.mark.streaming
@pytest.mark.timeout(400)
def test_scorer_id_column_named_model_version_and_unseen_sites_counted(bootstrap, shared_data, tmp_path):
    from connectors.kafka import ensure_topic

    sensor = make_sensor(shared_data, tmp_path)
    names = topic_names()
    ensure_topic(bootstrap, names["raw"])
    ensure_topic(bootstrap, names["updates"])
    arch, trained = batch_model(sensor)
    publish(bootstrap, names, publisher(sensor, tmp_path / "trainer"), 1, arch, trained)
    events = []
    for i, row in enumerate(sensor_rows(120, seed=5)):
        if row["pressure"] is None:
            continue
        row = {"model_version": f"m-{i}", **row, "site": "springfield" if i % 4 == 0 else row["site"]}
        events.append(row)
    n = produce(bootstrap, names["raw"], events)
    proc = scorer(bootstrap, names, sensor["dataset"], tmp_path / "run", "--update-key-file", sensor["key_file"],
                  "--id-column", "model_version")
    log = tmp_path / "run" / "scorer.log"
    try:
        preds, dead = wait_covered(bootstrap, names, n, proc, log, timeout=240)
    finally:
        stop_group(proc)
    assert not dead, dead[:3]
    by_offset = {int(p["pred_source"].rsplit("/", 1)[1]): p for p in preds}
    assert sorted(by_offset) == list(range(n))
    assert all(p["model_version"] == events[o]["model_version"] and p["pred_model_version"] == 1 for o, p in by_offset.items())
    unseen = {}
    for data in read_status(str(tmp_path / "run" / "score-status.json"), "predictions"):
        for col, k in (data.get("unseen") or {}).items():
            unseen[col] = unseen.get(col, 0) + k
    springfield = sum(1 for e in events if e["site"] == "springfield")
    assert unseen["site"] >= springfield and unseen["machine"] == 0, unseen

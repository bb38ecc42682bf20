"""Issue #42 on the real broker and Prism: after a version is published, >= 99% of the events sent 5 s later carry
it (or a newer one), for every version of a run with several, whatever the events' timestamps: bursts after the
trainer was quiet (the outside check's 300 of 300 events scored with v2, v3 published), events stamped with their
own old times (a replay with --time-column: all of them were served by the first version), and a live trickle.
The same run's /metrics counts predictions by the version that made them and shows no serving lag at the end.
(The Flink cluster's scorer: tests/integration/test_scoring_flink.py; the whole `stream --score` job:
tests/integration/test_observe_stream.py.)"""
from __future__ import annotations

import time
import urllib.request

import pytest
from kafka.admin import KafkaAdminClient, NewTopic
from prometheus_client.parser import text_string_to_metric_families

from flowtrain.local.tools import free_port
from tests.procs import stop_group
from tests.scoring_helpers import (
    batch_model,
    events,
    make_sensor,
    publish,
    publisher,
    random_weights,
    scorer,
    topic_names,
    wait_covered,
)
from tests.serving_checks import AFTER_S, publications, send_events, stale

pytestmark = [pytest.mark.kafka, pytest.mark.streaming, pytest.mark.timeout(480)]

#: Events per burst: one stale prediction in a burst is 1%.
BURST = 150


@pytest.fixture(scope="module")
def sensor(shared_data, tmp_path_factory) -> dict:
    return make_sensor(shared_data, tmp_path_factory.mktemp("freshsensor"))


def _scrape(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_every_event_sent_5_s_after_a_publication_is_scored_with_it_or_a_newer_version(bootstrap, sensor, tmp_path,
                                                                                     say):
    names = topic_names()
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(names["raw"], 2, 1), NewTopic(names["updates"], 1, 1)])
    admin.close()
    pub = publisher(sensor, tmp_path / "trainer")
    arch, trained = batch_model(sensor)
    publish(bootstrap, names, pub, 1, arch, trained)
    port = free_port()
    proc = scorer(bootstrap, names, sensor["dataset"], tmp_path / "score", "--update-key-file", sensor["key_file"],
                  "--metrics-port", str(port))
    log = tmp_path / "score" / "scorer.log"
    sent, bursts = {}, {}
    try:
        sent.update(send_events(bootstrap, names["raw"], events(100, seed=20)))  # the scorer runs
        wait_covered(bootstrap, names, len(sent), proc, log, timeout=180)
        day_ago = int((time.time() - 86_400) * 1000)
        for version, how in ((2, "burst after a quiet trainer"), (3, "old event times (a replay)"),
                             (4, "burst after a quiet trainer"), (5, "live, spread over 3 s")):
            publish(bootstrap, names, pub, version, arch, random_weights(sensor["data"], arch, version))
            time.sleep(AFTER_S + 0.5)  # the trainer is quiet; the events come 5 s after the publication
            rows = events(BURST, seed=20 + version)
            got = send_events(bootstrap, names["raw"], rows, timestamp_ms=day_ago if version == 3 else None,
                        spread_s=3.0 if version == 5 else 0.0)
            bursts[version] = (how, set(got))
            sent.update(got)
            assert proc.poll() is None, log.read_text()[-3000:]
        preds, dead = wait_covered(bootstrap, names, len(sent), proc, log, timeout=180)
        deadline, metrics = time.monotonic() + 30, {}
        while time.monotonic() < deadline:  # the status sampler has counted every prediction
            metrics = _scrape(port)
            counted = sum(v for (n, labels), v in metrics.items() if n == "flowtrain_predictions_total" and labels)
            if counted >= len(preds):
                break
            time.sleep(0.5)
    finally:
        stop_group(proc)
    published = publications(bootstrap, names["updates"])
    assert [v for _, _, v in published] == [1, 2, 3, 4, 5]
    by_source = {p["pred_source"]: p for p in preds}
    for version, (how, sources) in bursts.items():
        carried = [by_source[s]["pred_model_version"] for s in sources if s in by_source]
        assert len(carried) >= 0.95 * BURST, (version, len(carried))  # the rest are dead letters, counted below
        fresh = sum(v >= version for v in carried) / len(carried)
        say(f"\nfreshness: version {version} ({how}): {fresh:.1%} of {len(carried)} events sent {AFTER_S:g} s "
            f"after its publication carry it or a newer one")
        assert fresh >= 0.99, (version, how, sorted(set(carried)), log.read_text()[-3000:])
    overall = stale(preds, sent, published)
    assert overall["checked"] >= 4 * 0.95 * BURST and overall["share"] <= 0.01, overall
    assert len({p["pred_source"] for p in preds} | {d["source"] for d in dead}) == len(sent)
    # /metrics: predictions by the version that made them, equal to what the topic holds; no serving lag at the end
    on_topic: dict[str, int] = {}
    for p in preds:
        on_topic[str(p["pred_model_version"])] = on_topic.get(str(p["pred_model_version"]), 0) + 1
    by_version = {dict(labels)["version"]: v for (n, labels), v in metrics.items()
                  if n == "flowtrain_predictions_total" and labels}
    assert by_version == on_topic, (by_version, on_topic)
    assert metrics[("flowtrain_serving_version", ())] == 5
    assert metrics[("flowtrain_announced_version", ())] == 5
    assert metrics[("flowtrain_serving_lag_versions", ())] == 0
    assert metrics[("flowtrain_serving_lag_seconds", ())] == 0

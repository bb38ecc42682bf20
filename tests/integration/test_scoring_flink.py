"""The scoring pipeline (`flowtrain stream score --runner flink`) on the local Flink session cluster
and the real broker: the same pipeline as on Prism (test_scoring.py); each version published mid-stream serves
every event sent 5 s after it (issue #42), whatever the events' own timestamps."""
from __future__ import annotations

import json
import time
import urllib.request

import numpy as np
import pytest

from tests.procs import stop_group
from tests.scoring_helpers import (
    apply_marks,
    batch_model,
    events,
    expected,
    make_sensor,
    probabilities,
    produce,
    publish,
    publisher,
    random_weights,
    scorer,
    topic_names,
    wait_covered,
)
from tests.serving_checks import AFTER_S, send_events


def _flink_jobs(cluster) -> dict[str, str]:
    """Job id -> state of every job the cluster knows."""
    with urllib.request.urlopen(f"{cluster.status()['rest']}/jobs/overview", timeout=10) as resp:
        return {j["jid"]: j["state"] for j in json.loads(resp.read())["jobs"]}


live = [pytest.mark.kafka, pytest.mark.streaming, pytest.mark.flink, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def sensor(shared_data, tmp_path_factory) -> dict:
    return make_sensor(shared_data, tmp_path_factory.mktemp("scoreflink"))


@apply_marks(live)
def test_the_scorer_on_the_local_flink_cluster(bootstrap, flink_cluster, sensor, tmp_path, say):
    """Events produced before the scorer starts and while it runs: every event a prediction (equal
    to the forward of the version it names, its class name right) or a dead letter; then versions
    published mid-stream serve >= 99% of the events sent 5 s later; then the Flink job is cancelled by Ctrl-C."""
    from connectors.kafka import ensure_topic

    names = topic_names()
    ensure_topic(bootstrap, names["raw"], partitions=2)
    ensure_topic(bootstrap, names["updates"])
    arch, trained = batch_model(sensor)
    pub = publisher(sensor, tmp_path / "trainer")
    publish(bootstrap, names, pub, 1, arch, trained)
    evs = events(3000, seed=5)
    n = produce(bootstrap, names["raw"], evs[:400], malformed_every=40)
    before = _flink_jobs(flink_cluster)
    t0 = time.monotonic()
    proc = scorer(bootstrap, names, sensor["dataset"], tmp_path / "run", "--update-key-file", sensor["key_file"],
                  "--runner", "flink")
    log = tmp_path / "run" / "scorer.log"
    try:
        preds, dead = wait_covered(bootstrap, names, n, proc, log, timeout=400)
        say(f"\nscoring on flink: {len(preds)} predictions + {len(dead)} dead letters of {n} events "
            f"{time.monotonic() - t0:.0f} s after the scorer started")
        assert {p["pred_model_version"] for p in preds} == {1}
        # versions mid-stream (issue #42): every event sent 5 s after a publication carries it (or a newer one),
        # a burst after a quiet trainer and a burst stamped with its own old event times (a replay) alike
        arch2, trained2 = arch, random_weights(sensor["data"], arch, 2)
        trained3 = random_weights(sensor["data"], arch, 3)
        bursts = {}
        for version, state, stamp in ((2, trained2, None), (3, trained3, int((time.time() - 86_400) * 1000))):
            publish(bootstrap, names, pub, version, arch, state)
            time.sleep(AFTER_S + 0.5)
            sent = send_events(bootstrap, names["raw"], evs[n:n + 150], timestamp_ms=stamp)
            n += len(sent)
            bursts[version] = sent
            assert proc.poll() is None, log.read_text()[-3000:]
        preds, dead = wait_covered(bootstrap, names, n, proc, log, timeout=300)
    finally:
        stop_group(proc)
    assert proc.returncode == 0, log.read_text()[-3000:]
    ours = {jid: state for jid, state in _flink_jobs(flink_cluster).items() if jid not in before}
    assert list(ours.values()) == ["CANCELED"], ours  # the scorer's one Flink job, cancelled by Ctrl-C
    want = expected(bootstrap, names, sensor, {("run-a", 1): (arch, trained), ("run-a", 2): (arch2, trained2),
                                               ("run-a", 3): (arch, trained3)})
    classes = sensor["data"].classes
    assert {p["pred_source"] for p in preds} == set(want)
    assert len({p["pred_source"] for p in preds}) + len({d["source"] for d in dead}) == n
    assert {p["pred_model_version"] for p in preds} == {1, 2, 3}
    by_source = {p["pred_source"]: p["pred_model_version"] for p in preds}
    for version, sent in bursts.items():
        carried = [by_source[s] for s in sent if s in by_source]
        fresh = sum(v >= version for v in carried) / len(carried)
        say(f"scoring on flink: {fresh:.1%} of {len(carried)} events sent {AFTER_S:g} s after version {version}'s "
            f"publication carry it or a newer one")
        assert len(carried) >= 140 and fresh >= 0.99, (version, sorted(set(carried)))
    for p in preds:
        probs = want[p["pred_source"]][(p["pred_model_run"], p["pred_model_version"])]
        assert np.abs(np.asarray(probabilities(p, classes)) - probs).max() <= 1e-6
        assert p["pred_class"] == classes[int(probs.argmax())]

"""bench serve's freshness as users feel it (issue #42 item 4): the time until >= 99% of the predictions made
after a publication carry the version, not the time to the first one that does; and the share of predictions
made with a superseded version more than 5 s after its successor's publication."""
from __future__ import annotations

from bench.serve import freshness


def test_a_version_that_reaches_one_micro_batch_is_not_fresh():
    published = {1: 0.0, 2: 10.0, 3: 20.0}
    made = [(10.5 + i * 0.01, 1) for i in range(500)]  # after v2's publication: still v1 ...
    made[3] = (made[3][0], 2)  # ... but for one micro-batch: the old measure said 0.5 s
    made += [(16.0 + i * 0.01, 2) for i in range(300)]  # v2 from 16 s on
    made += [(21.0 + i * 0.01, 3) for i in range(300)]  # v3 from 21 s on
    out = freshness(made, published)
    # the first prediction with v2 came 0.53 s after its publication; 99% of those made from then on carry it only
    # from the last few v1 micro-batches on (300 of 303 at 15.47 s)
    assert 5.4 < out["times"][2] <= 6.0
    assert out["times"][3] == 21.0 - 20.0
    # made 5 s or more after v2's publication (from 15 s on) with v1: the 50 of 15.00-15.49 s, of 650 made then
    assert out["superseded"] == 50 and out["checked"] == 650


def test_never_fresh_and_superseded_predictions_are_counted():
    published = {1: 0.0, 2: 10.0}
    made = [(11.0 + i * 0.01, 1) for i in range(1000)]  # v2 never serves
    out = freshness(made, published)
    assert out["times"] == {2: None}
    late = [t for t, _ in made if t >= 15.0]
    assert out["checked"] == len(late) and out["superseded"] == len(late) and out["superseded_share"] == 1.0


def test_one_stale_prediction_in_a_hundred_is_still_fresh():
    published = {1: 0.0, 2: 10.0}
    made = [(10.0 + i * 0.01, 2) for i in range(99)] + [(11.5, 1)]
    assert freshness(made, published)["times"][2] == 0.0

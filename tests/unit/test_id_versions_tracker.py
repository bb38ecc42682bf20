"""Issue 32 item 3, wired: the stream trainer's publisher writes ID versions (dense parameters + the changed rows,
a snapshot every --snapshot-every) and the scorer's version tracker applies them strictly in order into the
version it serves, which the scorer's loader builds into the model. No broker here: the records go to the
tracker as the updates topic would hand them (tests/integration/test_id_deltas_scoring.py runs it on Kafka)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from connectors.id_keys import key_of
from flowtrain.train.ids import IdTable
from flowtrain.train.ids.publish import IdPublisher
from flowtrain.train.models import Architecture
from flowtrain.train.published import LoadPublishedVersion, Publisher
from pipelines.serving.versions import ModelCache, UpdateMessage, VersionTracker

KEY = b"k" * 32


class _Key:
    def load(self) -> bytes:
        return KEY


def _data():
    """What the model family reads of a dataset with one ID column (as tests/unit/test_model_families_registry)."""
    spec = SimpleNamespace(all_numeric=["a"], categorical=[], id_columns=["user"], task="classification")
    return SimpleNamespace(n_numeric=1, cardinalities=[], outputs=1, spec=spec, classes=["0", "1"])


class _Loader(LoadPublishedVersion):
    """The scorer's loader, on the dataset above instead of a dataset directory."""

    @property
    def data(self):
        return _data()


ARCH = Architecture("mlp", (8,), 0.0, 0, "test", id_dim=4)


def _trainer(tmp_path, n: int, *, snapshot_every: int = 4, keep: int = 10, seed: int = 0):
    """A model with an ID table (expiring: IDs are evicted) trained between versions; each version published as
    the stream trainer publishes it. Returns the model and the records as the updates topic holds them."""
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    model = ARCH.build(_data())
    model.ids["0"].table = IdTable(4, ttl=60, max_ids=40, init_std=0.05, seed=seed)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ids = IdPublisher(model, snapshot_every)
    pub = Publisher(tmp_path / "trainer", keep=keep, key_source=_Key())
    model.train()
    messages = []
    for v in range(1, n + 1):
        for _ in range(3):
            users = rng.zipf(1.3, size=16) + 10 * v  # new users each version, old ones expire
            keys = torch.as_tensor([key_of(f"u{u}") for u in users])[:, None]
            x = torch.as_tensor(rng.normal(size=(16, 1)), dtype=torch.float32)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x, keys).reshape(-1), torch.ones(16))
            opt.zero_grad()
            loss.backward()
            opt.step()
            model.id_step(16, 0.01)
        payload, meta = ids.publish(v, info={"architecture": json.dumps(ARCH.to_dict())})
        record = pub.publish_ids(payload, meta, step=3 * v, run_id="run-a")
        messages.append(UpdateMessage(f"updates/0/{v - 1}", json.dumps(record).encode(), (v, 0, v - 1)))
    return model, messages


def _tracker(tmp_path, name="scorer"):
    return VersionTracker(_Loader(str(tmp_path)), key=KEY, cache=ModelCache(tmp_path / name / "models"))


def _served_equals_trainer(tracker: VersionTracker, model) -> None:
    """The model the scorer loads for the version it serves holds the trainer's table and dense weights."""
    served, version = _Loader("unused")(tracker.current.path, tracker.current.sha256)
    assert version == tracker.current.version
    mine, theirs = served.ids["0"].table, model.ids["0"].table
    assert set(mine.key_to_row) == set(theirs.key_to_row)
    keys = np.asarray(sorted(theirs.key_to_row), dtype=np.int64)
    rows = lambda t: t.weight[torch.as_tensor([t.key_to_row[int(k)] for k in keys])]  # noqa: E731
    assert torch.equal(rows(mine), rows(theirs))
    dense = {k: v for k, v in model.state_dict().items() if ".table." not in k}
    got = served.state_dict()
    assert all(torch.equal(got[k], v) for k, v in dense.items())
    model.eval()
    x, k = torch.zeros(len(keys), 1), torch.as_tensor(keys)[:, None]
    with torch.no_grad():
        assert torch.equal(served(x, k), model(x, k))
    model.train()


def test_id_versions_applied_in_order_serve_the_trainers_table(tmp_path):
    model, messages = _trainer(tmp_path, 9)
    kinds = [json.loads(m.value)["kind"] for m in messages]
    assert kinds == ["snapshot", "delta", "delta", "delta", "snapshot", "delta", "delta", "delta", "snapshot"]
    assert model.ids["0"].table.stats.expired + model.ids["0"].table.stats.evicted_lru > 0
    tracker = _tracker(tmp_path)
    served = []
    for m in messages:  # one record per read, as a scorer that keeps up sees them
        assert tracker.offer([m])
        served.append(tracker.current.version)
    assert served == list(range(1, 10)) and tracker.rejected_count == 0
    status = tracker.ids_status()
    assert status["applied"] == 9 and status["held"] == 0 and status["version"] == 9
    _served_equals_trainer(tracker, model)


@pytest.mark.parametrize("seed", [0, 1])
def test_id_delta_gap_never_applied_out_of_order_recovers_at_the_next_snapshot(tmp_path, seed):
    model, messages = _trainer(tmp_path, 9, seed=seed)
    tracker = _tracker(tmp_path)
    served = []
    for i, m in enumerate(messages):
        if i == 2:  # version 3 (a delta) is lost on the topic
            continue
        tracker.offer([m])
        served.append(tracker.current.version)
    # 4 does not follow the served 2: held, never applied; the snapshot 5 is served, then the deltas after it
    assert served == [1, 2, 2, 5, 6, 7, 8, 9]
    status = tracker.ids_status()
    assert status["held"] == 1 and status["held_now"] == 0
    _served_equals_trainer(tracker, model)


def test_id_delta_reordered_on_the_topic_applied_in_version_order(tmp_path):
    model, messages = _trainer(tmp_path, 4)
    tracker = _tracker(tmp_path)
    served = []
    for m in (messages[0], messages[2], messages[1], messages[3]):  # 3 read before 2
        tracker.offer([m])
        served.append(tracker.current.version)
    assert served == [1, 1, 3, 4]  # 3 held until 2 came; then 2 and 3 in order
    assert tracker.ids_status()["held"] == 1
    # a replay of an old delta is stale, never a roll-back
    tracker.offer([messages[1]._replace(where="updates/0/99", order=(99, 0, 99))])
    assert tracker.current.version == 4 and tracker.rejected_kinds.get("stale") == 1
    _served_equals_trainer(tracker, model)


def test_id_late_scorer_starts_from_the_newest_snapshot_and_the_deltas_after_it(tmp_path):
    # the trainer keeps 2 payloads, and every one from the newest snapshot on
    model, messages = _trainer(tmp_path, 11, keep=2)
    files = sorted(p.name for p in (tmp_path / "trainer" / "published").glob("ids-*"))
    assert files == ["ids-000000009-snapshot.safetensors", "ids-000000010-delta.safetensors",
                     "ids-000000011-delta.safetensors"]
    tracker = _tracker(tmp_path, "late")
    assert tracker.offer(messages)  # the whole topic in one read, as a scorer starting late reads it
    assert tracker.current.version == 11
    assert tracker.rejected_count == 0  # the pruned versions before the snapshot were never read
    status = tracker.ids_status()
    assert status["superseded"] == 8 and status["applied"] == 3
    _served_equals_trainer(tracker, model)
    # the scorer restarted with the topic unreadable: its stored copy of what it served loads
    again = _tracker(tmp_path, "late")
    assert again.fall_back_to_stored().version == 11
    _served_equals_trainer(again, model)


def test_id_delta_alone_or_tampered_does_not_load_and_says_why(tmp_path):
    _, messages = _trainer(tmp_path, 2)
    delta = json.loads(messages[1].value)
    with pytest.raises(ValueError, match="ID delta without the model's architecture: only a whole version"):
        _Loader("unused")(delta["checkpoint"], delta["sha256"])
    tracker = _tracker(tmp_path)
    tracker.offer([messages[0]])
    with open(delta["checkpoint"], "r+b") as fh:  # the payload changed after it was published
        fh.seek(-4, 2)
        fh.write(b"AAAA")
    tracker.offer([messages[1]])
    assert tracker.current.version == 1 and tracker.rejected_kinds == {"file": 1}

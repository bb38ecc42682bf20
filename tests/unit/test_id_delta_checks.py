"""Issue 44 item 5: an ID version that cannot be applied is a rejected update with its reason, and the served
version stays whole. A signed delta with the right ``base_sha256`` but 8-wide rows on a 4-wide table raised
``ValueError`` out of ``VersionTracker.offer`` (whose contract: nothing a record holds raises) after it had
evicted and added keys, leaving keys without rows under an unchanged version. The trainer's real publisher
signs each forged version here (a key holder's mistake or a forged payload: the signature alone proves little
about its content); the tracker gets them as the updates topic would hand them."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from connectors.id_deltas import decode, encode
from connectors.id_keys import key_of
from flowtrain.train.ids import IdTable
from flowtrain.train.ids.publish import IdPublisher
from flowtrain.train.models import Architecture
from flowtrain.train.published import LoadPublishedVersion, Publisher
from pipelines.serving.versions import ModelCache, UpdateMessage, VersionTracker

KEY = b"k" * 32
ARCH = Architecture("mlp", (8,), 0.0, 0, "test", id_dim=4)


class _Key:
    def load(self) -> bytes:
        return KEY


def _data():
    spec = SimpleNamespace(all_numeric=["a"], categorical=[], id_columns=["user"], task="classification")
    return SimpleNamespace(n_numeric=1, cardinalities=[], outputs=1, spec=spec, classes=["0", "1"])


class _Loader(LoadPublishedVersion):
    @property
    def data(self):
        return _data()


def _published(tmp_path):
    """A model with a 4-wide ID table, its snapshot (version 1) and a real delta (version 2) as the trainer
    publishes them; returns the publisher, the ID publisher's model and the two (message, payload, meta)."""
    torch.manual_seed(0)
    model = ARCH.build(_data())
    model.ids["0"].table = IdTable(4, ttl=60, max_ids=40, init_std=0.05, seed=0)
    ids = IdPublisher(model, 100)
    pub = Publisher(tmp_path / "trainer", keep=10, key_source=_Key())
    model.train()
    out = []
    for v in (1, 2):
        keys = torch.as_tensor([key_of(f"u{u + 10 * v}") for u in range(8)])[:, None]
        model(torch.zeros(8, 1), keys).sum().backward()
        model.id_step(8, 0.01)
        payload, meta = ids.publish(v, info={"architecture": json.dumps(ARCH.to_dict())})
        out.append((payload, meta))
    return pub, out


def _message(pub, payload, meta, n):
    record = pub.publish_ids(payload, meta, step=n, run_id="run-a")
    return UpdateMessage(f"updates/0/{n}", json.dumps(record).encode(), (n, 0, n))


def _forged(meta, **tables) -> tuple[bytes, object]:
    """``meta`` (an IdVersion) with its tables' rows replaced (``name=rows``), in the payload's own format (its
    safetensors written here: ``encode`` would make every row float32)."""
    from safetensors.numpy import load, save

    data = encode(meta)
    version = decode(data)
    tensors = load(data)
    for name, rows in tables.items():
        tensors[f"ids/{name}/rows"] = rows
        version.tables[name].rows = rows
    (n,) = np.frombuffer(data[:8], dtype="<u8")
    return save(tensors, metadata=json.loads(data[8: 8 + int(n)])["__metadata__"]), version


@pytest.mark.parametrize("bad", ["wider", "nan", "integers", "dense"])
def test_item5_an_id_delta_that_cannot_apply_is_rejected_and_the_served_version_stays_whole(tmp_path, bad):
    pub, [(snap, snap_meta), (delta, delta_meta)] = _published(tmp_path)
    tracker = VersionTracker(_Loader(str(tmp_path)), key=KEY, cache=ModelCache(tmp_path / "scorer" / "models"))
    assert tracker.offer([_message(pub, snap, snap_meta, 0)]) and tracker.current.version == 1
    served = tracker.ids["run-a"]
    before = served.snapshot()
    name = next(iter(delta_meta.tables))
    change = delta_meta.tables[name]
    assert len(change.keys) and len(before.tables[name].keys)  # the delta adds keys (and the table holds some)
    if bad == "dense":
        version = decode(encode(delta_meta))
        version.dense[next(iter(version.dense))] = np.zeros(3, np.float32)  # another shape than it replaces
        payload = encode(version)
    else:
        rows = {"wider": np.ones((len(change.keys), 8), np.float32),
                "nan": np.full((len(change.keys), 4), np.nan, np.float32),
                "integers": np.ones((len(change.keys), 4), np.int64)}[bad]
        payload, _ = _forged(delta_meta, **{name: rows})
    # the forged delta, signed by the trainer's publisher with its base's digest: believed, then checked
    assert tracker.offer([_message(pub, payload, delta_meta, 1)]) is False  # nothing raised, nothing changed
    assert tracker.current.version == 1 and served.version == 1
    assert tracker.rejected_count == 1 and tracker.rejected[-1]["version"] == 2
    reason = tracker.rejected[-1]["reason"]
    status = tracker.ids_status()
    assert status["rejected"] == 1 and status["applied"] == 1 and status["version"] == 1
    after = served.snapshot()
    for t, was in before.tables.items():  # the same keys, each with its row
        assert np.array_equal(after.tables[t].keys, was.keys) and np.array_equal(after.tables[t].rows, was.rows)
    assert all(np.array_equal(after.dense[k], v) for k, v in before.dense.items())
    lookup = served.lookup(name, before.tables[name].keys)
    assert np.array_equal(lookup, before.tables[name].rows)
    want = {"wider": "rows 8 wide, the served table's are 4", "nan": "not all finite",
            "integers": "rows of int64", "dense": "the served one"}[bad]
    assert want in reason and reason.startswith("version 2 (delta): "), reason


def test_item5_served_ids_checks_a_version_before_it_applies_any_of_it(tmp_path):
    """``ServedIds`` itself: the 8-wide delta is "rejected: ..." naming the table and both widths; a snapshot
    whose rows do not fit its own fallback vector likewise; the valid delta then applies."""
    from pipelines.ids.serving import ServedIds

    pub, [(snap, snap_meta), (delta, delta_meta)] = _published(tmp_path)
    records = [json.loads(_message(pub, p, m, i).value) for i, (p, m) in enumerate([(snap, snap_meta)])]
    served = ServedIds(KEY)
    assert served.offer(records[0], snap) == "applied"
    name = next(iter(delta_meta.tables))
    wide, _ = _forged(delta_meta, **{name: np.ones((len(delta_meta.tables[name].keys), 8), np.float32)})
    record = json.loads(_message(pub, wide, delta_meta, 1).value)
    result = served.offer(record, wide)
    assert result == f"rejected: version 2 (delta): ID table {name!r}: rows 8 wide, the served table's are 4"
    assert served.version == 1 and len(served.tables[name]) == len(snap_meta.tables[name].keys)
    odd, _ = _forged(snap_meta, **{name: np.ones((len(snap_meta.tables[name].keys), 8), np.float32)})
    fresh = ServedIds(KEY)
    pub2 = Publisher(tmp_path / "other", keep=10, key_source=_Key())
    result = fresh.offer(json.loads(_message(pub2, odd, snap_meta, 0).value), odd)
    assert result.startswith(f"rejected: version 1 (snapshot): ID table {name!r}: rows 8 wide, its fallback vector")
    assert fresh.version is None and fresh.tables == {}

"""Issue 42, without a broker or a runner: the scorer's model handler serves the newest version its process has
read on the updates topic (``NewestVersion``), batch by batch, whatever model RunInference handed it; never an
earlier publication; a version that cannot be loaded is tried once, the newest loaded one keeps serving, and a
version announced but not serving after the bound is one warning with its reason. The serving lag on /metrics
and the predictions counted by version."""
from __future__ import annotations

import logging

import numpy as np
import pyarrow as pa
import torch

from connectors.dataset_spec import NUM_PREFIX, FeatureSpec
from pipelines.serving.config import ScoringBatch
from pipelines.serving.handler import FlowtrainModelHandler, parse_model_tag
from pipelines.serving.versions import ModelVersion

SPEC = FeatureSpec(label="y", task="regression", numeric=["x"])


class _Constant(torch.nn.Module):
    """A model whose every prediction is its version (so a prediction names the model that made it)."""

    def __init__(self, value: int):
        super().__init__()
        self.value = float(value)

    def forward(self, x_num, x_cat):
        return torch.full((x_num.shape[0],), self.value)


class _Loader:
    """``load_version``: a path ``v<N>`` loads version N; paths in ``broken`` raise; every load is counted."""

    def __init__(self, broken=()):
        self.broken, self.loads = set(broken), []

    def __call__(self, path, sha256=None):
        self.loads.append(path)
        if path in self.broken:
            raise ValueError(f"{path}: not a checkpoint")
        version = int(path.lstrip("v"))
        return _Constant(version).eval(), version


def _version(n: int, order: int | None = None) -> ModelVersion:
    return ModelVersion(n, "run-a", f"v{n}", None, f"upd/0/{n}", (order if order is not None else n, 0, n))


class _Newest:
    """What ``NewestVersion`` answers: set by the test as the reader thread would."""

    def __init__(self):
        self.current, self.at = None, 0.0

    def __call__(self):
        return self.current

    def announced_at(self):
        return self.at


def _batch(rows: int = 3) -> ScoringBatch:
    features = pa.record_batch({NUM_PREFIX + "x": pa.array(np.ones(rows, dtype=np.float32))})
    return ScoringBatch("raw", 0, 0, rows - 1, features, np.zeros(rows, dtype=np.int64), 0)


def _score(handler, model):
    results = list(handler.run_inference([_batch()], model))
    (result,) = results
    outputs, _ = result.inference
    return parse_model_tag(result.model_id)[1], set(np.asarray(outputs).tolist())


def test_each_batch_is_scored_with_the_newest_version_read_whatever_model_beam_holds():
    loader, newest = _Loader(), _Newest()
    handler = FlowtrainModelHandler(loader, _version(1), SPEC, newest=newest)
    held = handler.load_model()  # what RunInference loads once and hands to every batch after
    assert held.version.version == 1
    assert _score(handler, held) == (1, {1.0})
    newest.current = _version(2)
    assert _score(handler, held) == (2, {2.0})  # the tag and the numbers both come from version 2
    assert _score(handler, held) == (2, {2.0})
    newest.current = _version(5)
    assert _score(handler, held) == (5, {5.0})
    assert loader.loads == ["v1", "v2", "v5"]  # each version loaded once per process


def test_never_back_to_an_earlier_publication():
    loader, newest = _Loader(), _Newest()
    handler = FlowtrainModelHandler(loader, _version(1), SPEC, newest=newest)
    held = handler.load_model()
    newest.current = _version(3)
    assert _score(handler, held)[0] == 3
    newest.current = _version(2)  # published before version 3 (a re-send, another instance's older read)
    assert _score(handler, held)[0] == 3
    handler.update_model_path(_version(2).model_id())  # an older version named through Beam's own path
    assert _score(handler, held)[0] == 3
    assert loader.loads == ["v1", "v3"]


def test_a_copy_of_the_handler_sees_what_its_process_loaded():
    """RunInference makes a handler per DoFn instance (pickled copies): they share the process's newest."""
    import pickle

    loader, newest = _Loader(), _Newest()
    handler = FlowtrainModelHandler(loader, _version(1), SPEC, newest=newest)
    other = pickle.loads(pickle.dumps(handler))
    other._newest = newest  # (the fake is not a NewestVersion: give the copy the same one)
    held = handler.load_model()
    newest.current = _version(4)
    assert _score(handler, held)[0] == 4
    assert _score(other, other.load_model())[0] == 4


def test_a_version_that_cannot_be_loaded_is_tried_once_and_warned_about_once_after_the_bound(caplog):
    loader, newest = _Loader(broken={"v2"}), _Newest()
    handler = FlowtrainModelHandler(loader, _version(1), SPEC, newest=newest, warn_after_s=10.0)
    held = handler.load_model()
    import time

    newest.current, newest.at = _version(2), time.time()
    with caplog.at_level(logging.WARNING, logger="pipelines.serving.handler"):
        for _ in range(5):
            assert _score(handler, held)[0] == 1  # the newest loaded one keeps serving
        assert not [r for r in caplog.records if "announced" in r.getMessage()]  # within the bound: no warning
        newest.at = time.time() - 30
        for _ in range(3):
            assert _score(handler, held)[0] == 1
    assert loader.loads == ["v1", "v2"]  # tried once, not once per batch
    warned = [r.getMessage() for r in caplog.records if "announced" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "version 2" in warned[0] and "version 1" in warned[0] and "not a checkpoint" in warned[0]
    newest.current = _version(3)  # the next good version serves
    assert _score(handler, held)[0] == 3


def test_serving_lag_in_versions_and_seconds():
    from flowtrain.commands.stream.status import serving_lag

    announced = {"version": 5, "run_id": "run-a", "announced_at": 1000.0}
    assert serving_lag(announced, 5, "run-a", now=1030.0) == {"announced_version": 5, "serving_lag_versions": 0,
                                                              "serving_lag_s": 0.0}
    assert serving_lag(announced, 3, "run-a", now=1030.0) == {"announced_version": 5, "serving_lag_versions": 2,
                                                              "serving_lag_s": 30.0}
    assert serving_lag(announced, 9, "run-b", now=1001.5) == {"announced_version": 5, "serving_lag_versions": 1,
                                                              "serving_lag_s": 1.5}
    assert serving_lag(announced, None, None) == {"announced_version": 5}


def test_metrics_count_predictions_by_the_version_that_made_them():
    import time
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from flowtrain.observe.server import StatusServer

    snap = {"counters": {"predictions": 30, "events": 40}, "predictions_by_version": {"1": 10, "2": 20},
            "serving_version": 2, "announced_version": 3, "serving_lag_versions": 1, "serving_lag_s": 4.5}
    server = StatusServer(0, lambda: snap, interval_s=0.1).start()
    try:
        deadline, samples = time.monotonic() + 30, {}
        while ("flowtrain_events_total", ()) not in samples and time.monotonic() < deadline:
            with urllib.request.urlopen(server.url + "metrics", timeout=10) as response:
                text = response.read().decode()
            samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                       for f in text_string_to_metric_families(text) for s in f.samples}
            time.sleep(0.05)
    finally:
        server.stop()
    assert samples[("flowtrain_predictions_total", (("version", "1"),))] == 10
    assert samples[("flowtrain_predictions_total", (("version", "2"),))] == 20
    assert ("flowtrain_predictions_total", ()) not in samples  # one family: counted by version
    assert samples[("flowtrain_events_total", ())] == 40
    assert samples[("flowtrain_serving_version", ())] == 2
    assert samples[("flowtrain_announced_version", ())] == 3
    assert samples[("flowtrain_serving_lag_versions", ())] == 1
    assert samples[("flowtrain_serving_lag_seconds", ())] == 4.5

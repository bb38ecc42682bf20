"""Issue 32, bad input, at the scorer: events whose ID value has no key are scored with the fallback vector and
counted by column and reason in the scorer's status (its featurize status files, summed by ``serving_status``)."""
from __future__ import annotations

import pyarrow as pa

from connectors.dataset_spec import FeatureSpec
from flowtrain.commands.stream.status import serving_status
from pipelines.serving.featurize import id_fallback_counts
from pipelines.stream.status import write_status
from pipelines.tabular.features import feature_arrays


def test_id_fallbacks_counted_in_the_scorers_status(tmp_path):
    spec = FeatureSpec(label="y", numeric=["x"], id_columns=["user"], task="classification", max_id_bytes=8)
    stats = {"numeric": {"x": {"mean": 0.0, "std": 1.0}}, "vocab": {}}
    events = pa.RecordBatch.from_pydict({"x": [0.1, 0.2, 0.3, 0.4, 0.5], "user": ["a", "", None, "x" * 9, "b"],
                                         "y": [0, 1, 0, 1, 0]})
    arrays, names = feature_arrays(events, spec, stats)
    features = pa.RecordBatch.from_arrays(arrays, names=names)
    counts = id_fallback_counts(features, spec.id_columns)
    assert counts == {"user: empty": 1, "user: missing": 1, "user: too_long": 1}
    assert id_fallback_counts(None, spec.id_columns) == {}
    # two featurize workers' status files: the scorer's status sums them
    prefix = str(tmp_path / "score-status.json")
    owners = [object(), object()]
    write_status(prefix, owners[0], {"events": 5, "dead_letters": 0, "id_fallbacks": counts}, kind="featurize")
    write_status(prefix, owners[1], {"events": 2, "dead_letters": 0, "id_fallbacks": {"user: empty": 2}},
                 kind="featurize")
    status = serving_status(tmp_path)
    assert status["events"] == 7
    assert status["id_fallbacks"] == {"user: empty": 3, "user: missing": 1, "user: too_long": 1}

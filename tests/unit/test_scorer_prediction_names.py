"""The scorer's prediction messages (issue 29 items 1 and 7): an event field carried as the id, whatever its name
(one of the names flowtrain's outputs use, or the featurizer's own `label`), and a label named `class`, never
collide; unseen categorical values are counted per column. The real featurizer and the message builder; the
model's outputs are given (the forward is tested elsewhere)."""
from __future__ import annotations

import json

import numpy as np
import pytest
from apache_beam.ml.inference.base import PredictionResult

from connectors.dataset_spec import FeatureSpec
from connectors.kafka import KafkaRecord
from pipelines.serving.featurize import featurize_records
from pipelines.serving.predictions import prediction_layout, predictions_batch, unseen_counts
from pipelines.stream.featurize import StreamFeaturizer

RESERVED = ("class", "probability", "prediction", "model_version", "predicted_class", "label", "id")
STATS = {"numeric": {"x1": {"mean": 0.0, "std": 1.0}}, "vocab": {"city": ["a", "b"]}, "classes": ["no", "yes"]}


def _records(label: str, id_column: str) -> list[KafkaRecord]:
    events = [{"x1": 0.5, "city": "a", label: "yes", id_column: "e-0"},
              {"x1": -1.0, "city": "springfield", label: "no", id_column: "e-1"},
              {"x1": 2.0, "city": None, id_column: "e-2"}]
    return [KafkaRecord("raw", 0, 10 + i, 1_700_000_000_000 + i, None, json.dumps(e).encode())
            for i, e in enumerate(events)]


@pytest.mark.parametrize("label,id_column", [*(("class", c) for c in RESERVED if c != "class"), ("y", "class"),
                                             ("probability", "model_version")])
def test_scorer_reserved_names_as_label_and_id_column_never_collide(label, id_column):
    spec = FeatureSpec(label=label, task="classification", numeric=["x1"], categorical=["city"])
    featurizer = StreamFeaturizer(spec, STATS, keep=[id_column])
    batch, letters = featurize_records(_records(label, id_column), featurizer)
    assert not letters and batch.features.num_rows == 3
    result = PredictionResult(batch, (np.asarray([0.9, 0.2, 0.6], dtype=np.float32), 1_700_000_000_500), "run-a:3")
    layout = prediction_layout(spec, ["no", "yes"], id_column)
    preds = predictions_batch(result, layout)
    assert preds.schema == layout.schema and len(set(preds.schema.names)) == preds.num_columns
    rows = preds.to_pylist()
    # the event's id and label under their own names (#45 item 4), flowtrain's columns pred_*, none colliding
    assert [r[id_column] for r in rows] == ["e-0", "e-1", "e-2"]
    assert [r[layout.names.source] for r in rows] == ["raw/0/10", "raw/0/11", "raw/0/12"]
    assert [r[layout.names.klass] for r in rows] == ["yes", "no", "yes"]
    assert [r[label] for r in rows] == ["yes", "no", None]
    assert [r[layout.names.version] for r in rows] == [3, 3, 3]
    np.testing.assert_allclose([r[layout.names.probabilities[0]] for r in rows], [0.9, 0.2, 0.6], atol=1e-6)
    assert unseen_counts(batch.features, spec.categorical) == {"city": 2}  # springfield, and a missing city


def test_scorer_unseen_values_per_column_reach_the_status_and_metrics(tmp_path):
    """The scorer's status files (one per writer) -> the status snapshot's ``unseen`` -> ``/metrics``."""
    import types
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from flowtrain.commands.stream.status import StreamSampler
    from flowtrain.observe.server import StatusServer
    from pipelines.stream.status import write_status

    prefix = str(tmp_path / "score-status.json")
    writers = [object(), object()]  # two scorer DoFns, one status file each
    write_status(prefix, writers[0], {"predictions": 5, "version": 1, "unseen": {"city": 2, "shop": 0}}, "predictions")
    write_status(prefix, writers[1], {"predictions": 3, "version": 1, "unseen": {"city": 1, "shop": 4}}, "predictions")
    snap = {"counters": {}}
    StreamSampler._scorer(types.SimpleNamespace(out=tmp_path), snap)
    assert snap["counters"]["predictions"] == 8 and snap["unseen"] == {"city": 3, "shop": 4}
    server = StatusServer(0, lambda: snap, interval_s=0.1).start()
    try:
        with urllib.request.urlopen(server.url + "metrics", timeout=10) as response:
            text = response.read().decode()
    finally:
        server.stop()
    samples = {(s.name, tuple(s.labels.items())): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("flowtrain_unseen_values_total", (("column", "city"),))] == 3
    assert samples[("flowtrain_unseen_values_total", (("column", "shop"),))] == 4


@pytest.mark.parametrize("id_column", ["source", "src_partition", "src_offset"])
def test_scorer_id_column_named_like_the_event_position_is_a_one_line_error(id_column, tmp_path):
    from connectors.fields import build
    from flowtrain.commands.stream.options import StreamScoreJob
    from flowtrain.commands.stream.score import scoring_config
    from flowtrain.errors import FlowtrainError

    job = build(StreamScoreJob, {"id_column": id_column, "out": str(tmp_path / "run"),
                                 "dataset": str(tmp_path / "no-dataset")})
    with pytest.raises(FlowtrainError, match=f"--id-column {id_column}: the stream keeps each event's position"):
        scoring_config(job)

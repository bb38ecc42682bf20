"""The online trainer's engine config names no demo topic (issue 30 item 3/5): the command passes the
topics it derives from the dataset's name; the engine has no ``flights-*`` default."""
from __future__ import annotations

from dataclasses import MISSING, fields

from flowtrain.train.stream.config import StreamTrainConfig


def test_stream_train_config_has_no_flights_topic_defaults():
    defaults = {f.name: f.default for f in fields(StreamTrainConfig) if f.default is not MISSING}
    topics = {k: v for k, v in defaults.items() if k.endswith("_topic")}
    assert set(topics) >= {"features_topic", "updates_topic", "dead_letter_topic"}
    assert all(v is None for v in topics.values()), topics
    assert not [k for k, v in defaults.items() if "flights" in str(v)]

"""The online trainer's engine config names no demo topic (issue 30 item 3/5): the command passes the
topics it derives from the dataset's name (a ``connectors.kafka.Topics``, issue 48); the engine has no ``flights-*``
default and no default topics at all."""
from __future__ import annotations

from dataclasses import MISSING, fields

from connectors.kafka import Topics
from flowtrain.train.stream.config import StreamTrainConfig


def test_stream_train_config_has_no_flights_topic_defaults():
    given = {f.name: f for f in fields(StreamTrainConfig)}
    assert given["topics"].default is MISSING and given["topics"].default_factory is MISSING  # the command's to give
    assert all(f.default is None for f in fields(Topics))  # a role without a topic is None, never a demo's name
    defaults = {f.name: f.default for f in fields(StreamTrainConfig) if f.default is not MISSING}
    assert not [k for k, v in defaults.items() if "flights" in str(v)]

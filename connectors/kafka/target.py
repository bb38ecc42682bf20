"""What a streaming job's command resolves about Kafka before its engine starts: not configuration.

The options (``--bootstrap``, ``--kafka-config``/``--kafka-config-file``, ``--connect-timeout``, ``--group-id``,
``--replication-factor``, the ``--*-topic`` names) are declared once, by the commands
(``flowtrain.commands.stream.options``); a command resolves them (the client settings merged from pairs and file, the
topics named after the dataset when unset) into these two small values, and hands them to the engines beside their
own options: the feature pipeline (``pipelines.stream.pipeline.StreamConfig``), the scorer
(``pipelines.serving.config.ScoreConfig``) and the online trainer (``flowtrain.train.stream.config.StreamTrainConfig``)
hold a ``KafkaTarget`` and a ``Topics``, never a copy of an option.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from connectors.kafka.clients import DEFAULT_CONNECT_TIMEOUT_S

__all__ = ["KafkaTarget", "Topics"]


@dataclass(frozen=True)
class KafkaTarget:
    """The brokers a job talks to and how: ``config`` is the client settings, typed (SASL/SSL..., for every client);
    ``group_id`` the consumer group of a job that commits offsets; ``connect_timeout`` the bound on finding no broker
    (seconds); ``replication_factor`` that of the topics the job creates (None: min(3, brokers))."""
    bootstrap: str
    config: dict[str, Any] = field(default_factory=dict)
    group_id: str | None = None
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S
    replication_factor: int | None = None

    @classmethod
    def of(cls, value: KafkaTarget | dict) -> KafkaTarget:
        """A ``KafkaTarget``, or the dict ``dataclasses.asdict`` made of one (a worker's job file)."""
        return value if isinstance(value, cls) else cls(**value)


@dataclass(frozen=True)
class Topics:
    """A job's topics by role (None: the job has no such topic): the raw events, the feature messages, the dead
    letters of this part of the job, the published model versions, the scorer's predictions and drift reports."""
    raw: str | None = None
    features: str | None = None
    dead_letters: str | None = None
    updates: str | None = None
    predictions: str | None = None
    drift: str | None = None

    @classmethod
    def of(cls, value: Topics | dict) -> Topics:
        """``Topics``, or the dict ``dataclasses.asdict`` made of one (a worker's job file)."""
        return value if isinstance(value, cls) else cls(**value)

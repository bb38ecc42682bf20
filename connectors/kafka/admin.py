"""Cluster-level Kafka calls: is a broker there, does a topic exist (create it), what does it accept."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from kafka import KafkaAdminClient
from kafka.admin import ConfigResource, ConfigResourceType, NewTopic
from kafka.errors import InvalidReplicationFactorError, KafkaError, TopicAlreadyExistsError

from connectors.kafka.clients import (
    DEFAULT_CONNECT_TIMEOUT_S,
    KafkaUnavailable,
    close_client,
    quiet_kafka_logs,
    retry_kafka,
    servers_string,
    track_client,
    unavailable_message,
)

__all__ = ["check_brokers", "ensure_topic", "topic_config", "topic_max_message_bytes", "admin_settings"]

_log = logging.getLogger(__name__)
_LOCK = threading.Lock()


def admin_settings(client_config: Mapping[str, Any] | None) -> dict:
    """The options of ``client_config`` a KafkaAdminClient takes (security among them)."""
    return {k: v for k, v in dict(client_config or {}).items() if k in KafkaAdminClient.DEFAULT_CONFIG}



# Brokers that answered a check in this process, and when: a pipeline that builds several reads
# of the same cluster checks it once a minute, not once per read.
_ANSWERED: dict[str, tuple[float, int]] = {}
_ANSWER_TTL_S = 60.0


def check_brokers(bootstrap_servers: str | Sequence[str], *, timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
                  client_config: Mapping[str, Any] | None = None, cached: bool = True) -> int:
    """Fail within ``timeout_s`` with ``KafkaUnavailable`` (one line) unless a broker answers.

    Returns the number of brokers in the cluster. Meant to run before any work starts, so that
    a wrong address or a stopped broker is a clear error instead of a client retrying for minutes.
    ``cached=False`` asks the brokers even when they answered a moment ago (a job deciding, at a stop,
    whether it can still commit).
    """
    key = repr((servers_string(bootstrap_servers), sorted(dict(client_config or {}).items(), key=str)))
    with _LOCK:
        answered = _ANSWERED.get(key)
    if cached and answered and time.monotonic() - answered[0] < _ANSWER_TTL_S:
        return answered[1]
    cfg = admin_settings(client_config)
    cfg.update(bootstrap_servers=bootstrap_servers, bootstrap_timeout_ms=int(timeout_s * 1000),
               request_timeout_ms=max(1000, int(timeout_s * 1000)))
    with quiet_kafka_logs():
        try:
            admin = KafkaAdminClient(**cfg)
        except KafkaError as err:
            raise KafkaUnavailable(unavailable_message(bootstrap_servers, timeout_s, type(err).__name__)) from None
        except (OSError, ValueError) as err:
            raise KafkaUnavailable(unavailable_message(bootstrap_servers, timeout_s, str(err))) from None
        try:
            # a dead broker still in the metadata may be asked first: the others are asked next
            brokers = max(1, len(retry_kafka(admin.describe_cluster, "describe the cluster",
                                             deadline_s=timeout_s, pause_s=0.5).get("brokers") or ()))
            with _LOCK:
                _ANSWERED[key] = (time.monotonic(), brokers)
            return brokers
        except KafkaError as err:
            raise KafkaUnavailable(unavailable_message(bootstrap_servers, timeout_s, type(err).__name__)) from None
        finally:
            admin.close()


def brokers_unreachable(bootstrap_servers: str | Sequence[str], *, timeout_s: float = 5.0,
                        client_config: Mapping[str, Any] | None = None) -> str | None:
    """None when a broker answers now (asked afresh, within ``timeout_s``); else why not, in a few words:
    what a stopping job says before naming what it could not commit."""
    try:
        check_brokers(bootstrap_servers, timeout_s=timeout_s, client_config=client_config, cached=False)
        return None
    except KafkaUnavailable:
        return f"no broker at {servers_string(bootstrap_servers)} answered within {timeout_s:g} s"


def topic_config(bootstrap_servers: str | Sequence[str], topic: str, name: str, *,
                 client_config: Mapping[str, Any] | None = None) -> str | None:
    """The topic's config ``name`` (e.g. ``retention.ms``) as the broker applies it (the topic's own or
    the broker default); None when the topic does not exist or the broker does not say."""
    admin = track_client(KafkaAdminClient(bootstrap_servers=bootstrap_servers, **admin_settings(client_config)))
    try:
        found = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic, {name: None})],
                                       config_filter="all")
    except Exception as err:  # noqa: BLE001 - an absent topic or an old broker: nothing known
        _log.debug("%s of %s unavailable: %s", name, topic, err)
        return None
    finally:
        close_client(admin)
    value = ((found.get("topic", {}).get(topic) or {}).get(name) or {}).get("value")
    return None if value is None else str(value)


def topic_max_message_bytes(bootstrap_servers: str | Sequence[str], topic: str, *,
                            client_config: Mapping[str, Any] | None = None) -> int | None:
    """The topic's ``max.message.bytes`` as the broker applies it (its own or the broker default);
    None when the topic does not exist or the broker does not say."""
    value = topic_config(bootstrap_servers, topic, "max.message.bytes", client_config=client_config)
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def ensure_topic(bootstrap_servers: str | Sequence[str], topic: str, *, partitions: int = 1,
                 replication_factor: int | None = None, config: Mapping[str, str] | None = None,
                 client_config: Mapping[str, Any] | None = None) -> None:
    """Create ``topic`` unless it exists (producers do not create topics and would block).

    ``replication_factor`` defaults to min(3, number of brokers): 1 on a local broker, 3 on a
    real cluster. ``config`` sets topic configs (e.g. ``{"max.message.bytes": "4194304"}``) of a
    topic this call creates; an existing topic is left as it is.
    """
    if replication_factor is not None and (isinstance(replication_factor, bool) or replication_factor < 1):
        raise ValueError(f"ensure_topic(replication_factor={replication_factor!r}): must be >= 1 "
                         f"(or None for min(3, number of brokers))")
    cfg = admin_settings(client_config)
    admin = KafkaAdminClient(bootstrap_servers=bootstrap_servers, **cfg)
    try:
        # a dead broker of a cluster still in the metadata may be asked first: retried on the others
        if topic in retry_kafka(admin.list_topics, f"list topics (for {topic!r})", pause_s=0.5):
            return
        brokers = len(retry_kafka(admin.describe_cluster, "describe the cluster", pause_s=0.5).get("brokers")
                      or ()) or 1
        factor = min(3, brokers) if replication_factor is None else replication_factor
        try:
            retry_kafka(lambda: admin.create_topics([NewTopic(topic, num_partitions=partitions,
                                                              replication_factor=factor,
                                                              topic_configs=dict(config or {}))]),
                        f"create topic {topic!r}", pause_s=0.5)
        except InvalidReplicationFactorError:
            raise ValueError(f"topic {topic!r}: replication factor {factor} cannot be reached, the cluster at "
                             f"{servers_string(bootstrap_servers)} has {brokers} broker(s); pass a replication "
                             f"factor <= {brokers} (--replication-factor)") from None
    except TopicAlreadyExistsError:
        pass
    finally:
        admin.close()


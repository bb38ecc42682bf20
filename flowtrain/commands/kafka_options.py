"""Kafka client options of every Kafka-using command: ``--kafka-config KEY=VALUE`` (kafka-python option
names, checked against the clients' own defaults, ``${ENV}`` expanded) and ``--kafka-config-file``
(Java client properties) -> the keyword arguments every client gets."""
from __future__ import annotations

import argparse
import difflib
import math
import os
import re
from collections.abc import Iterable
from typing import Any

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer

from connectors.fields import OptionError, format_value
from connectors.kafka.config import KafkaConfigError, expand_env, load_client_properties
from connectors.kafka.target import KafkaTarget

# --- Kafka client options -------------------------------------------------------------------------------
_TEXT_KEYS = re.compile(r"(_password|_username|_file|_name|_url|_proxy|_id|_mechanism|_protocol|_cafile|"
                        r"_certfile|_keyfile|_crlfile|_ciphers)$")


def _client_defaults() -> tuple[dict[str, Any], dict[str, set[str]]]:
    """kafka-python's option defaults common to every client flowtrain makes, and who takes the rest."""
    clients = {"consumer": KafkaConsumer.DEFAULT_CONFIG, "producer": KafkaProducer.DEFAULT_CONFIG,
               "admin": KafkaAdminClient.DEFAULT_CONFIG}
    common = set.intersection(*(set(c) for c in clients.values()))
    owners: dict[str, set[str]] = {}
    for name, cfg in clients.items():
        for key in cfg:
            owners.setdefault(key, set()).add(name)
    return {k: KafkaConsumer.DEFAULT_CONFIG[k] for k in common}, owners


def typed_value(text: str, default: Any = None, *, text_only: bool = False) -> Any:
    """``true``/``false`` -> bool, ``12`` -> int, ``1.5`` -> float, else text; an option whose
    default is a bool/int/float must get that type."""
    raw = text.strip()
    lowered = raw.lower()
    if text_only:
        return raw
    if isinstance(default, bool):
        if lowered in ("true", "false"):
            return lowered == "true"
        raise ValueError("expects true or false")
    if isinstance(default, int):
        if re.fullmatch(r"[+-]?\d+", raw):
            return int(raw)
        raise ValueError("expects a whole number")
    if isinstance(default, float):
        try:
            return float(raw)
        except ValueError:
            raise ValueError("expects a number") from None
    if isinstance(default, str):
        return raw
    if lowered in ("true", "false"):
        return lowered == "true"
    if re.fullmatch(r"[+-]?\d+", raw):
        return int(raw)
    try:
        value = float(raw)
    except ValueError:
        return raw
    return value if math.isfinite(value) else raw


def kafka_pair(text: str) -> str:
    """An argparse type: one ``KEY=VALUE`` checked as ``kafka_config`` checks it (kept as text)."""
    try:
        _kafka_pairs([text])
    except OptionError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("--kafka-config ")) from None
    return text


#: The default of ``--kafka-config-file``: a client properties file for every Kafka-using command.
KAFKA_CONFIG_FILE_ENV = "FLOWTRAIN_KAFKA_CONFIG_FILE"


def kafka_config(pairs: Iterable[str] | dict | None, config_file: str | os.PathLike | None = None) -> dict[str, Any]:
    """``--kafka-config-file`` (its Java properties as kafka-python options; ``$FLOWTRAIN_KAFKA_CONFIG_FILE``
    when not given) updated by ``--kafka-config KEY=VALUE`` (repeated) -> keyword arguments for every client."""
    config_file = config_file or os.environ.get(KAFKA_CONFIG_FILE_ENV) or None
    out: dict[str, Any] = {}
    if config_file:
        try:
            out.update(load_client_properties(config_file))
        except KafkaConfigError as err:
            raise OptionError(str(err)) from None
    out.update(_kafka_pairs(pairs))
    return out


def kafka_target(job, *, group_id: str | None = None) -> KafkaTarget:
    """A stream command's Kafka options (``--bootstrap``, ``--kafka-config``/``--kafka-config-file``,
    ``--connect-timeout``, ``--replication-factor``) resolved once for its engine: the client settings merged, the
    consumer group the part commits (``group_id``)."""
    return KafkaTarget(job.bootstrap, kafka_config(job.kafka_config, job.kafka_config_file), group_id=group_id,
                       connect_timeout=job.connect_timeout, replication_factor=job.replication_factor)


def _kafka_pairs(pairs: Iterable[str] | dict | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if not pairs:
        return out
    if isinstance(pairs, dict):
        pairs = [f"{k}={format_value(v)}" for k, v in pairs.items()]
    common, owners = _client_defaults()
    for pair in pairs:
        key, sep, value = str(pair).partition("=")
        try:
            value = expand_env(value, f"--kafka-config {key.strip()}")
        except KafkaConfigError as err:
            raise OptionError(str(err)) from None
        key = key.strip().replace(".", "_")
        if not sep or not key:
            raise OptionError(f"--kafka-config {pair!r}: expected KEY=VALUE with a kafka-python option name, "
                              f"e.g. security_protocol=SASL_SSL")
        if key == "bootstrap_servers":
            raise OptionError("--kafka-config bootstrap_servers: give the brokers with --bootstrap")
        if key not in common:
            if key in owners:
                raise OptionError(f"--kafka-config {key}: only the kafka-python {', '.join(sorted(owners[key]))} "
                                  f"takes it, and --kafka-config goes to every client (consumer, producer, admin): "
                                  f"give connection and security options here")
            close = difflib.get_close_matches(key, sorted(common), n=1)
            raise OptionError(f"--kafka-config {key}: not a kafka-python client option"
                              + (f" (did you mean {close[0]}?)" if close else ""))
        try:
            out[key] = typed_value(value, common[key], text_only=bool(_TEXT_KEYS.search(key)))
        except ValueError as err:
            raise OptionError(f"--kafka-config {key}={value}: {key} {err} (kafka-python's default is "
                              f"{common[key]!r})") from None
    return out



"""A Kafka client properties file (Java names, as Kafka users write them) as kafka-python options.

``load_client_properties("client.properties")`` reads the file Java clients and the Kafka CLI tools
take (``--command-config``): ``key=value`` (or ``key: value``) lines, ``#``/``!`` comments, ``\\``
line continuations. Values may name environment variables as Kafka's ``EnvVarConfigProvider``
does: ``${env:KAFKA_PASSWORD}`` (the ``config.providers`` lines that declare the provider are
accepted and need not be there). It returns kafka-python options, which the connectors pass to
every client (and ``connectors.kafka.confluent_config`` translates for confluent-kafka).

Translated names:

- ``security.protocol``, ``sasl.mechanism``, ``sasl.kerberos.service.name``, ``client.id`` and the
  other options every kafka-python client takes (``request.timeout.ms`` -> ``request_timeout_ms``);
- ``sasl.jaas.config`` of ``PlainLoginModule`` (PLAIN) or ``ScramLoginModule`` (SCRAM-SHA-256/512):
  its ``username`` and ``password`` become ``sasl_plain_username`` / ``sasl_plain_password``;
  ``sasl.username`` / ``sasl.password`` (librdkafka's names) too;
- TLS with PEM files: ``ssl.truststore.location`` (with ``ssl.truststore.type=PEM``) or
  ``ssl.ca.location`` -> ``ssl_cafile``; ``ssl.keystore.location`` (``ssl.keystore.type=PEM``: key
  and certificate in one file) or ``ssl.certificate.location`` / ``ssl.key.location`` ->
  ``ssl_certfile`` / ``ssl_keyfile``; ``ssl.key.password`` -> ``ssl_password``;
  ``ssl.crl.location`` -> ``ssl_crlfile``; ``ssl.endpoint.identification.algorithm`` (empty: no
  host name check) -> ``ssl_check_hostname``.

Anything else is an error naming the file and the key (never silently dropped): JKS/PKCS12 stores
(Python's TLS reads PEM), other JAAS login modules, ``bootstrap.servers`` (give ``--bootstrap``).
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer

from connectors.secrets import check_private

__all__ = ["KafkaConfigError", "load_client_properties", "read_properties", "expand_env", "client_options"]


class KafkaConfigError(ValueError):
    """A client properties file (or a value) flowtrain cannot turn into client options; the message names it."""


def client_options() -> dict[str, Any]:
    """kafka-python options every client (consumer, producer, admin) takes, with their defaults."""
    common = set(KafkaConsumer.DEFAULT_CONFIG) & set(KafkaProducer.DEFAULT_CONFIG) & set(
        KafkaAdminClient.DEFAULT_CONFIG)
    return {k: KafkaConsumer.DEFAULT_CONFIG[k] for k in common}


_ENV = re.compile(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)\}")


def expand_env(value: str, where: str) -> str:
    """``${env:NAME}`` in ``value`` replaced by the environment variable's value; unset is an error."""
    def one(m: re.Match) -> str:
        name = m.group(1)
        if name not in os.environ:
            raise KafkaConfigError(f"{where}: environment variable {name} is not set (the value says ${{env:{name}}})")
        return os.environ[name]

    return _ENV.sub(one, value)


_ESCAPES = {"t": "\t", "n": "\n", "r": "\r", "f": "\f"}


def _unescape(text: str) -> str:
    out, i = [], 0
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt == "u" and re.fullmatch(r"[0-9a-fA-F]{4}", text[i + 2:i + 6] or ""):
                out.append(chr(int(text[i + 2:i + 6], 16)))
                i += 6
                continue
            out.append(_ESCAPES.get(nxt, nxt))
            i += 2
            continue
        out.append(c)
        i += 1
    return "".join(out)


def _split(line: str) -> tuple[str, str]:
    """A logical line's key and value: the key ends at the first unescaped '=', ':' or blank."""
    i = 0
    while i < len(line):
        c = line[i]
        if c == "\\":
            i += 2
            continue
        if c in "=: \t\f":
            break
        i += 1
    key, rest = line[:i], line[i:].lstrip(" \t\f")
    if rest[:1] in ("=", ":"):
        rest = rest[1:].lstrip(" \t\f")
    return _unescape(key), _unescape(rest)


def read_properties(path: str | os.PathLike) -> dict[str, str]:
    """The ``key -> value`` pairs of a Java properties file (the last of a repeated key wins)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise KafkaConfigError(f"--kafka-config-file {path}: cannot read it ({err.strerror or err})") from None
    except UnicodeDecodeError:
        raise KafkaConfigError(f"--kafka-config-file {path}: not a text file (UTF-8)") from None
    pairs: dict[str, str] = {}
    logical = ""
    for raw in text.splitlines():
        line = raw.lstrip(" \t\f") if not logical else raw.lstrip(" \t\f")
        if not logical and (not line or line[0] in "#!"):
            continue
        trailing = len(line) - len(line.rstrip("\\"))
        if trailing % 2 == 1:  # an odd number of backslashes: the line goes on
            logical += line[:-1]
            continue
        logical += line
        key, value = _split(logical)
        logical = ""
        if key:
            pairs[key] = value
    if logical:
        key, value = _split(logical)
        if key:
            pairs[key] = value
    return pairs


_JAAS = re.compile(r"""^\s*(?P<module>[\w.$]+)\s+(?P<flag>required|requisite|sufficient|optional)(?P<opts>.*?);?\s*$""",
                   re.DOTALL)
_JAAS_OPT = re.compile(r"""(?P<k>[\w.\-]+)\s*=\s*(?:"(?P<q>(?:[^"\\]|\\.)*)"|(?P<w>[^\s;"]+))""")
_JAAS_MODULES = {"org.apache.kafka.common.security.plain.PlainLoginModule": "PLAIN",
                 "org.apache.kafka.common.security.scram.ScramLoginModule": "SCRAM"}


def _jaas(value: str, where: str) -> dict[str, str]:
    m = _JAAS.match(value)
    if not m:
        raise KafkaConfigError(f"{where}: not a JAAS login line; write it as "
                               f"org.apache.kafka.common.security.plain.PlainLoginModule required "
                               f"username=\"...\" password=\"...\";")
    module = m.group("module")
    if module not in _JAAS_MODULES:
        raise KafkaConfigError(f"{where}: login module {module} is not supported by flowtrain's Python clients; use "
                               f"PlainLoginModule (sasl.mechanism=PLAIN) or ScramLoginModule (SCRAM-SHA-256/512)")
    options = {o.group("k"): (o.group("q").replace('\\"', '"') if o.group("q") is not None else o.group("w"))
               for o in _JAAS_OPT.finditer(m.group("opts"))}
    missing = [k for k in ("username", "password") if k not in options]
    if missing:
        raise KafkaConfigError(f"{where}: the {module.rsplit('.', 1)[1]} line has no {' and no '.join(missing)}")
    return {"sasl_plain_username": options["username"], "sasl_plain_password": options["password"]}


# Java / librdkafka property -> kafka-python option, where the name is not simply dots to underscores.
_RENAMED = {"sasl.username": "sasl_plain_username", "sasl.password": "sasl_plain_password",
            "ssl.ca.location": "ssl_cafile", "ssl.certificate.location": "ssl_certfile",
            "ssl.key.location": "ssl_keyfile", "ssl.key.password": "ssl_password", "ssl.crl.location": "ssl_crlfile"}
# Accepted and not used: the declaration of the ${env:...} provider, and passwords PEM stores do not have.
_IGNORED = re.compile(r"^config\.providers(\..*)?$|^ssl\.truststore\.password$")
_PEM_STORES = {"ssl.truststore.location": ("ssl.truststore.type", "ssl_cafile"),
               "ssl.keystore.location": ("ssl.keystore.type", "ssl_certfile")}


def _typed(value: str, default: Any, where: str) -> Any:
    text = value.strip()
    if isinstance(default, bool):
        if text.lower() in ("true", "false"):
            return text.lower() == "true"
        raise KafkaConfigError(f"{where}={value}: expects true or false")
    if isinstance(default, int):
        if re.fullmatch(r"[+-]?\d+", text):
            return int(text)
        raise KafkaConfigError(f"{where}={value}: expects a whole number")
    if isinstance(default, float):
        try:
            return float(text)
        except ValueError:
            raise KafkaConfigError(f"{where}={value}: expects a number") from None
    return text


def load_client_properties(path: str | os.PathLike) -> dict[str, Any]:
    """kafka-python options from a Java client properties file (see the module doc)."""
    props = read_properties(path)
    _refuse_readable_literal_secret(path, props)
    common = client_options()
    out: dict[str, Any] = {}
    for key, raw in props.items():
        where = f"--kafka-config-file {path}: {key}"
        if _IGNORED.match(key) or key in ("ssl.truststore.type", "ssl.keystore.type"):
            continue
        value = expand_env(raw, where)
        if key == "bootstrap.servers":
            raise KafkaConfigError(f"{where}: give the brokers with --bootstrap (the file holds client settings)")
        if key == "sasl.jaas.config":
            out.update(_jaas(value, where))
        elif key == "ssl.endpoint.identification.algorithm":
            out["ssl_check_hostname"] = value.strip().lower() == "https"
        elif key in _PEM_STORES:
            type_key, option = _PEM_STORES[key]
            store_type = props.get(type_key, "JKS").strip().upper()
            if store_type != "PEM":
                raise KafkaConfigError(f"{where}: a {store_type} store cannot be read by Python's TLS; convert it "
                                       f"to PEM (keytool -exportcert / openssl) and set {type_key}=PEM, or give "
                                       f"ssl.ca.location / ssl.certificate.location / ssl.key.location")
            out[option] = value
            if option == "ssl_certfile":
                out.setdefault("ssl_keyfile", value)  # a PEM keystore holds the key and its certificate
        elif key == "ssl.keystore.password":
            raise KafkaConfigError(f"{where}: a PEM keystore has no store password; give the private key's "
                                   f"password as ssl.key.password")
        elif key in _RENAMED:
            out[_RENAMED[key]] = value
        else:
            option = key.replace(".", "_")
            if "." not in key or option not in common:
                raise KafkaConfigError(f"{where}: not a Kafka client property flowtrain's Python clients take "
                                       f"(security.protocol, sasl.mechanism, sasl.jaas.config, ssl.* PEM locations, "
                                       f"client.id, *.timeout.ms, ...)")
            out[option] = value.upper() if option in ("security_protocol", "sasl_mechanism") else \
                _typed(value, common[option], where)
    return out


#: Properties whose value is (or holds) a password.
_SECRET_KEYS = ("sasl.jaas.config", "sasl.password", "ssl.key.password")
_LITERAL_PASSWORD = re.compile(r"password\s*=\s*\"?(?!\$\{env:)[^\s\";]", re.IGNORECASE)


def _refuse_readable_literal_secret(path: str | os.PathLike, props: dict[str, str]) -> None:
    """A file that writes a password out (not as ``${env:NAME}``) must be readable by its owner only, as ssh
    asks of a private key: a ``KafkaConfigError`` naming the mode and the fix otherwise."""
    literal = [k for k in _SECRET_KEYS if k in props and (
        _LITERAL_PASSWORD.search(props[k]) if k == "sasl.jaas.config" else not props[k].strip().startswith("${env:"))]
    if not literal:
        return
    try:
        check_private(path, "--kafka-config-file")
    except ValueError as err:
        raise KafkaConfigError(f"{err} (it writes out {', '.join(literal)}; or give the password as "
                               f"${{env:NAME}})") from None

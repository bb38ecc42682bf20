"""Secrets kept out of what a run writes: one rule for which option is secret, one redaction.

An option is secret when its name (any spelling: ``sasl.jaas.config``, ``sasl_plain_password``,
``--s3_secret_access_key``, ``ssl.key.password``) holds one of ``SECRET_WORDS``. ``redact``
returns a copy of a JSON-like value with every secret replaced by ``REDACTED``: dict entries by
key, command-line lists (``--key=value``, ``--key value``, ``key=value``) by option name, and
``password="..."``-style text inside strings (a JAAS line). Every writer of a run's files
(``config.json``, ``job.json``, ...) passes its data through ``redact``.

``split_secrets`` separates a client config into what may be written and what may not, so a
parent can hand the secret part to its children through their environment (``SECRETS_ENV``)
instead of a file or a command line.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any

__all__ = ["SECRET_WORDS", "REDACTED", "SECRETS_ENV", "is_secret", "redact", "split_secrets", "secrets_from_env"]

#: Words that make an option name secret.
SECRET_WORDS = ("password", "passwd", "secret", "token", "credential", "jaas", "private_key", "api_key", "apikey",
                "passphrase", "connection_string", "sas_key")
#: What a secret value is replaced by.
REDACTED = "<redacted>"
#: Environment variable through which a parent passes secret client settings to its children (JSON).
SECRETS_ENV = "FLOWTRAIN_KAFKA_SECRETS"

_SECRET_NAME = re.compile("|".join(SECRET_WORDS))
# name=value or name: value inside free text, the name holding a secret word; the value quoted or a word
_IN_TEXT = re.compile(r"(?P<name>[\w.\-]*(?:" + "|".join(SECRET_WORDS) + r")[\w.\-]*)(?P<sep>\s*[=:]\s*)"
                      r"""(?P<value>"[^"]*"|'[^']*'|[^\s;,'"]+)""", re.IGNORECASE)


def is_secret(name: str) -> bool:
    """Whether an option called ``name`` holds a secret (case, dots, dashes and leading ``--`` ignored)."""
    return bool(_SECRET_NAME.search(str(name).lstrip("-").lower().replace(".", "_").replace("-", "_")))


def _redact_text(text: str) -> str:
    if not any(word in text.lower() for word in SECRET_WORDS):
        return text

    def hide(m: re.Match) -> str:
        value = m.group("value")
        quote = value[0] if value[:1] in "\"'" else ""
        return f"{m.group('name')}{m.group('sep')}{quote}{REDACTED}{quote}"

    return _IN_TEXT.sub(hide, text)


def _redact_list(items: list) -> list:
    out = []
    hide_next = False
    for item in items:
        if hide_next and isinstance(item, str) and not item.startswith("--"):
            out.append(REDACTED)
            hide_next = False
            continue
        hide_next = False
        if isinstance(item, str):
            name, sep, _ = item.partition("=")
            if sep and is_secret(name):
                out.append(f"{name}={REDACTED}")
                continue
            if item.startswith("-") and not sep and is_secret(item):
                hide_next = True  # --key value: the next item is the secret
            out.append(_redact_text(item))
        else:
            out.append(redact(item))
    return out


def redact(value: Any) -> Any:
    """A copy of ``value`` (dicts, lists, tuples, strings, numbers) with every secret replaced."""
    if isinstance(value, dict):
        return {k: (REDACTED if is_secret(k) and value[k] not in (None, "", {}, [])
                    else redact(v)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return _redact_list(list(value))
    if isinstance(value, str):
        return _redact_text(value)
    return value


def split_secrets(config: dict) -> tuple[dict, dict]:
    """``(what may be written, the secret entries)`` of a flat client config."""
    public = {k: v for k, v in config.items() if not is_secret(k)}
    return public, {k: v for k, v in config.items() if is_secret(k)}


def secrets_from_env() -> dict:
    """The secret client settings a parent passed in ``SECRETS_ENV`` (``{}`` without)."""
    text = os.environ.get(SECRETS_ENV)
    return json.loads(text) if text else {}

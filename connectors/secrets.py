"""Secrets kept out of what a run writes: one rule for which option is secret, one redaction.

An option is secret when its name (any spelling: ``sasl.jaas.config``, ``sasl_plain_password``,
``--s3_secret_access_key``, ``ssl.key.password``) holds one of ``SECRET_WORDS``. ``redact``
returns a copy of a JSON-like value with every secret replaced by ``REDACTED``: dict entries by
key, command-line lists (``--key=value``, ``--key value``, ``key=value``) by option name, and
``password="..."``-style text inside strings (a JAAS line), and the credentials of a URL anywhere in a
string (``redact_url``: its userinfo, ``az://alice:S3cret@acct/...`` -> ``az://<redacted>@acct/...``, and query
parameters that carry a secret, ``SECRET_QUERY``: a SAS ``sig=``, a presigned URL's signature and token).
Every writer of a run's files (``config.json``, ``job.json``, ``run.json``, ...) passes its data through
``redact``; the command line prints its errors through it and ``redact_logs`` makes every log record go
through it too. Credentials belong in the environment (docs/object-stores.md), never in a URL.

``read_secret_file`` reads a secret file (an update key, a bundle key): a regular file only its
owner can read; one that group or others may read is refused naming its mode (as ssh refuses such a
private key), before its content is read.

``split_secrets`` separates a client config into what may be written and what may not, so a
parent can hand the secret part to its children through their environment (``SECRETS_ENV``)
instead of a file or a command line.
"""
from __future__ import annotations

import json
import logging
import os
import re
import stat
from typing import Any

__all__ = ["SECRET_WORDS", "SECRET_QUERY", "REDACTED", "SECRETS_ENV", "is_secret", "redact", "redact_url",
           "redact_logs", "split_secrets", "secrets_from_env", "check_private", "read_secret_file"]

#: Words that make an option name secret.
SECRET_WORDS = ("password", "passwd", "secret", "token", "credential", "jaas", "private_key", "api_key", "apikey",
                "passphrase", "connection_string", "sas_key")
#: What a secret value is replaced by.
REDACTED = "<redacted>"
#: Environment variable through which a parent passes secret client settings to its children (JSON).
SECRETS_ENV = "FLOWTRAIN_KAFKA_SECRETS"

#: Query parameters of a URL whose value is a secret (Azure SAS, S3 and GCS presigned URLs, OAuth tokens).
SECRET_QUERY = ("sig", "signature", "x-amz-signature", "x-amz-credential", "x-amz-security-token",
                "x-goog-signature", "x-goog-credential", "token", "access_token", "id_token", "refresh_token",
                "client_secret", "password", "passwd", "secret", "api_key", "apikey", "key", "code", "sas")

_SECRET_NAME = re.compile("|".join(SECRET_WORDS))
# scheme://user[:password]@ (a user name holds no '/', a password may: an S3 secret key does)
_USERINFO = re.compile(r"""(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)[^/\s@:?#'"<>]*(?::[^\s@'"<>]*)?@""")
_QUERY = re.compile(r"""(?P<name>[?&;](?:""" + "|".join(re.escape(q) for q in SECRET_QUERY) + r""")=)[^&#\s'"<>:;,]*""",
                    re.IGNORECASE)
# name=value or name: value inside free text, the name holding a secret word; the value quoted or a word
_IN_TEXT = re.compile(r"(?P<name>[\w.\-]*(?:" + "|".join(SECRET_WORDS) + r")[\w.\-]*)(?P<sep>\s*[=:]\s*)"
                      r"""(?P<value>"[^"]*"|'[^']*'|[^\s;,&'"]+)""", re.IGNORECASE)


def is_secret(name: str) -> bool:
    """Whether an option called ``name`` holds a secret (case, dots, dashes and leading ``--`` ignored)."""
    return bool(_SECRET_NAME.search(str(name).lstrip("-").lower().replace(".", "_").replace("-", "_")))


def redact_url(text: str) -> str:
    """``text`` with the credentials of every URL in it replaced: the userinfo (``user:password@``) and the
    values of the query parameters in ``SECRET_QUERY``."""
    if "@" in text and "://" in text:
        text = _USERINFO.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", text)
    if "=" in text and ("?" in text or "&" in text):
        text = _QUERY.sub(lambda m: f"{m.group('name')}{REDACTED}", text)
    return text


def _redact_text(text: str) -> str:
    text = redact_url(text)
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
            if "://" in name:  # a URL (its query may hold "name=value"): its credentials only
                out.append(_redact_text(item))
                continue
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


def redact_logs() -> None:
    """From now on every log record of this process is redacted (its message, formatted, through ``redact``) when
    it holds a URL or a secret word: a logger anywhere (Beam's, fsspec's, ours) may name a URL a user gave."""
    factory = logging.getLogRecordFactory()
    if getattr(factory, "flowtrain_redacts", False):
        return

    def make(*args, **kwargs) -> logging.LogRecord:
        record = factory(*args, **kwargs)
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a record that does not format is logging's to report
            return record
        shown = _redact_text(text)
        if shown != text:
            record.msg, record.args = shown, ()
        return record

    make.flowtrain_redacts = True
    logging.setLogRecordFactory(make)


def split_secrets(config: dict) -> tuple[dict, dict]:
    """``(what may be written, the secret entries)`` of a flat client config."""
    public = {k: v for k, v in config.items() if not is_secret(k)}
    return public, {k: v for k, v in config.items() if is_secret(k)}


def secrets_from_env() -> dict:
    """The secret client settings a parent passed in ``SECRETS_ENV`` (``{}`` without)."""
    text = os.environ.get(SECRETS_ENV)
    return json.loads(text) if text else {}


def _mode_problem(st: os.stat_result, path: str, option: str) -> str | None:
    if os.name != "posix":
        return None
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        who = " and ".join(w for w, bits in (("its group", 0o070), ("others", 0o007)) if mode & bits)
        return (f"{option} {path}: mode {mode:04o} lets {who} read or change this secret, so it is refused; "
                f"`chmod 600 {path}` (only you may read it)")
    return None


def check_private(path: str | os.PathLike, option: str) -> None:
    """A ``ValueError`` naming ``option``, ``path`` and its mode when group or others may read or write
    the secret file ``path`` (its target, for a link)."""
    try:
        st = os.stat(path)
    except OSError as err:
        raise ValueError(f"{option} {path}: cannot be read ({err.strerror})") from None
    problem = _mode_problem(st, str(path), option)
    if problem:
        raise ValueError(problem)


def read_secret_file(path: str | os.PathLike, option: str, *, max_bytes: int = 64 * 1024) -> bytes:
    """The bytes of the secret file ``path`` (``option`` names it in errors): a regular file of at most
    ``max_bytes`` that only its owner may read (``check_private``), checked on the opened file before
    anything is read; a ``ValueError`` with one line otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise ValueError(f"{option} {path}: cannot be opened ({err.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{option} {path}: not a regular file")
        problem = _mode_problem(st, str(path), option)
        if problem:
            raise ValueError(problem)
        if st.st_size > max_bytes:
            raise ValueError(f"{option} {path}: {st.st_size:,} bytes, not a key (at most {max_bytes:,})")
        os.set_blocking(fd, True)
        data = os.read(fd, max_bytes + 1)
        if len(data) > max_bytes:
            raise ValueError(f"{option} {path}: more than {max_bytes:,} bytes, not a key")
        return data
    finally:
        os.close(fd)

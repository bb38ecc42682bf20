"""A small client of a Confluent-compatible Schema Registry's REST API (Confluent's, Apicurio's
``/apis/ccompat/v7``, Redpanda's, Karapace): schemas by id (cached for the client's life) and registering
the schemas flowtrain writes. Stdlib HTTP only. A URL's ``user:password@`` is sent as HTTP basic
authentication and never shown: every message and dead letter names the URL without it.

A registry that does not answer (refused, timed out, a 5xx) is waited for, as the Kafka clients wait for
brokers: retried with a growing pause, logged once per outage, for ``wait_s`` seconds (None: for as long as
it takes) before ``RegistryUnavailable``. An id the registry does not know is ``None``: the caller makes its
events dead letters.
"""
from __future__ import annotations

import base64
import json
import logging
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import OrderedDict
from collections.abc import Callable

from connectors.secrets import redact_url

_log = logging.getLogger(__name__)

#: ``schemaType`` of the API (Avro is the API's default and may be left out).
AVRO, PROTOBUF = "AVRO", "PROTOBUF"
_CONTENT = "application/vnd.schemaregistry.v1+json"
#: Schemas a client keeps (by id, the last used), and the most bytes of one answer it reads.
MAX_SCHEMAS = 1024
MAX_ANSWER_BYTES = 4 << 20


class RegistryUnavailable(RuntimeError):
    """The registry did not answer within the client's ``wait_s``."""


class RegistryError(RuntimeError):
    """The registry answered with an error (the message holds its text)."""


class SchemaRegistry:
    """``SchemaRegistry(url)``: ``schema(id)`` -> ``(schemaType, text)`` or None; ``register(subject, text, type)`` -> id."""

    def __init__(self, url: str, *, wait_s: float | None = None, timeout_s: float = 10.0,
                 on_wait: Callable[[str | None], None] | None = None):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--schema-registry {redact_url(url)!r}: expected an http:// or https:// URL of the registry's "
                             f"Confluent-compatible API (Apicurio: http://HOST:PORT/apis/ccompat/v7)")
        self._given = url  # with its credentials, if it holds any: a copy (a DoFn's) needs them too
        # user:password@ in the URL: sent as HTTP basic authentication, never shown (self.url is without them)
        self.url, self.headers = _without_userinfo(url.rstrip("/"))
        self.wait_s, self.timeout_s, self.on_wait = wait_s, timeout_s, on_wait
        self._schemas: OrderedDict[int, tuple[str, str]] = OrderedDict()
        self._lock = threading.Lock()

    def __reduce__(self):  # a DoFn's copy starts with an empty cache
        return (_rebuild, (self._given, self.wait_s, self.timeout_s))

    def _call(self, method: str, path: str, body: dict | None = None) -> dict | None:
        """The JSON answer; None for a 404; waits while the registry does not answer."""
        data = json.dumps(body).encode() if body is not None else None
        started, pause, waiting = time.monotonic(), 0.2, False
        while True:
            req = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": _CONTENT, "Accept": _CONTENT, **self.headers})
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    raw = resp.read(MAX_ANSWER_BYTES + 1)
                if len(raw) > MAX_ANSWER_BYTES:
                    raise RegistryError(f"schema registry {self.url}{path}: an answer of more than "
                                        f"{MAX_ANSWER_BYTES:,} bytes")
                try:
                    answer = json.loads(raw or b"null")
                except (ValueError, RecursionError) as err:
                    raise RegistryError(f"schema registry {self.url}{path}: the answer is not JSON "
                                        f"({type(err).__name__})") from None
                if waiting and self.on_wait:
                    self.on_wait(None)
                if waiting:
                    _log.warning("schema registry %s answers again", self.url)
                return answer
            except urllib.error.HTTPError as err:
                if err.code == 404:
                    return None
                if err.code < 500:
                    text = err.read(500).decode("utf-8", "replace")
                    raise RegistryError(f"schema registry {self.url}{path}: HTTP {err.code}: {text}") from None
                reason = f"HTTP {err.code}"
            except (urllib.error.URLError, OSError, ValueError) as err:
                reason = f"{type(err).__name__}: {getattr(err, 'reason', err)}"
            waited = time.monotonic() - started
            if self.wait_s is not None and waited >= self.wait_s:
                raise RegistryUnavailable(f"schema registry {self.url} did not answer for {waited:.0f} s ({reason}); "
                                          f"check --schema-registry")
            if not waiting:
                waiting = True
                _log.warning("schema registry %s does not answer (%s): waiting for it", self.url, reason)
                if self.on_wait:
                    self.on_wait(f"waiting for schema registry {self.url} ({reason})")
            time.sleep(pause)
            pause = min(pause * 2, 5.0)

    def schema(self, schema_id: int) -> tuple[str, str] | None:
        """``(schemaType, schema text)`` of an id (the last ``MAX_SCHEMAS`` found are kept: an id names one
        schema for ever), or None when the registry does not know it (not kept: it may learn it). An answer
        that is not a schema (not a JSON object with the text in ``schema``) is a ``RegistryError``."""
        with self._lock:
            if schema_id in self._schemas:
                self._schemas.move_to_end(schema_id)
                return self._schemas[schema_id]
        answer = self._call("GET", f"/schemas/ids/{int(schema_id)}")
        if answer is None:
            return None
        kind = answer.get("schemaType", AVRO) if isinstance(answer, dict) else None
        if not isinstance(answer, dict) or not isinstance(answer.get("schema"), str) \
                or not isinstance(kind, (str, type(None))):
            shape = type(answer).__name__ if not isinstance(answer, dict) else \
                f"an object with keys {sorted(map(str, answer))[:5]}"
            raise RegistryError(f"schema registry {self.url}: the answer for schema id {schema_id} is not a schema "
                                f"(a JSON object with its text in 'schema'): {shape}")
        found = (kind or AVRO, answer["schema"])
        with self._lock:
            self._schemas[schema_id] = found
            while len(self._schemas) > MAX_SCHEMAS:
                self._schemas.popitem(last=False)
        return found

    def register(self, subject: str, text: str, schema_type: str) -> int:
        """Registers a schema under ``subject`` (a new version unless it is there already); returns its id."""
        body = {"schema": text} | ({"schemaType": schema_type} if schema_type != AVRO else {})
        answer = self._call("POST", f"/subjects/{urllib.request.quote(subject, safe='')}/versions", body)
        if not answer or "id" not in answer:
            raise RegistryError(f"schema registry {self.url}: registering under {subject!r} gave {answer!r}")
        with self._lock:
            self._schemas[int(answer["id"])] = (schema_type, text)
        return int(answer["id"])


def wait_for_registry(url: str, *, what: str, should_stop: Callable[[], bool] = lambda: False,
                      say: Callable[[str], None] = lambda line: print(line, flush=True),
                      timeout_s: float = 5.0) -> bool:
    """Before a job starts: waits until the registry at ``url`` answers, as the jobs wait for brokers: one line
    when it does not (``<what>: waiting for schema registry URL (reason); the job starts when it answers,
    Ctrl-C stops``), one when it answers again; checks ``should_stop()`` (the command's SIGTERM / Ctrl-C flag)
    every 0.2 s. True once it answered; False when a stop was requested first."""
    client = SchemaRegistry(url, timeout_s=timeout_s)
    started, pause, waiting = time.monotonic(), 0.2, False
    while True:
        req = urllib.request.Request(client.url + "/subjects", headers={"Accept": _CONTENT, **client.headers})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                resp.read()
            reason = None
        except urllib.error.HTTPError as err:
            reason = f"HTTP {err.code}" if err.code >= 500 else None  # a 4xx: it answers (the calls say what)
        except (urllib.error.URLError, OSError, ValueError) as err:
            reason = f"{type(err).__name__}: {getattr(err, 'reason', err)}"
        if reason is None:
            if waiting:
                say(f"{what}: schema registry {client.url} answers after {time.monotonic() - started:.0f} s")
            return True
        if not waiting:
            waiting = True
            say(f"{what}: waiting for schema registry {client.url} ({reason}); the job starts when it answers, "
                f"Ctrl-C stops")
        until = time.monotonic() + pause
        while time.monotonic() < until:
            if should_stop():
                return False
            time.sleep(0.2)
        pause = min(pause * 2, 5.0)


def _without_userinfo(url: str) -> tuple[str, dict[str, str]]:
    """(the URL without ``user:password@``, the basic-authentication header they make, or none)."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url, {}
    netloc = parts.netloc.rpartition("@")[2]
    user = urllib.parse.unquote(parts.username or "")
    token = base64.b64encode(f"{user}:{urllib.parse.unquote(parts.password or '')}".encode()).decode()
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc)), {"Authorization": f"Basic {token}"}


def _rebuild(url, wait_s, timeout_s):
    return SchemaRegistry(url, wait_s=wait_s, timeout_s=timeout_s)

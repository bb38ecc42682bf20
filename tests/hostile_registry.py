"""A hostile Schema Registry for tests (issue 44): a real HTTP server on 127.0.0.1 that answers
``GET /schemas/ids/N`` with whatever the test set for N (a schema, odd JSON, an HTTP error, raw bytes) and
counts the requests per id; an id it was not given is a 404, as a registry answers an unknown id. It stands for
a registry that answers oddly (the client's input), not for a real registry (Apicurio is the
``schema_registry`` fixture).

Also the payloads that crash fastavro: ``recursive_schema`` (the dataset's record holding itself in ``child``)
and ``nested_event`` (one value nested ``depth`` levels through it)."""
from __future__ import annotations

import json
import re
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from pipelines.stream.formats import avro_schema, frame


class HostileRegistry:
    """``with HostileRegistry({id: answer}) as reg``: ``reg.url``, ``reg.asked[id]``, ``reg.auth`` (each request's
    Authorization header). An answer is a ``dict`` or
    ``list`` (sent as JSON), ``bytes`` (sent as they are), or an ``int`` (that HTTP status, a short JSON body)."""

    def __init__(self, answers: dict):
        self.answers, self.asked, self.auth = dict(answers), Counter(), []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                m = re.search(r"/schemas/ids/(\d+)$", self.path)
                key = int(m.group(1)) if m else None
                owner.asked[key] += 1
                owner.auth.append(self.headers.get("Authorization"))
                answer = owner.answers.get(key, 404)
                status, body = (answer, json.dumps({"error_code": answer * 100, "message": "no"}).encode()) \
                    if isinstance(answer, int) else (200, answer if isinstance(answer, bytes) else
                                                     json.dumps(answer).encode())
                self.send_response(status)
                self.send_header("Content-Type", "application/vnd.schemaregistry.v1+json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/apis/ccompat/v7"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> HostileRegistry:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=10)


def recursive_schema(events) -> dict:
    """The events' Avro record with one more field, ``child``: null or the record itself (valid Avro)."""
    schema = avro_schema(events)
    schema["fields"].append({"name": "child", "type": ["null", schema["name"]], "default": None})
    return schema


def nested_event(schema_id: int, n_fields: int, depth: int) -> bytes:
    """A wire-format value of ``recursive_schema`` whose ``child`` nests ``depth`` levels (each level: every
    field null, then the child branch)."""
    level = b"\x00" * n_fields
    return frame(schema_id, (level + b"\x02") * depth + level + b"\x00")

"""Prometheus ``/metrics`` and a live status page of a running job, on 127.0.0.1.

``StatusServer(port, sample)`` calls ``sample()`` every ``interval_s`` seconds in a background
thread (never on a request: a scrape costs nothing to the job) and serves the newest snapshot:

- ``/metrics``: ``prometheus_client``'s WSGI app over the snapshot (families below): the text format,
  OpenMetrics when the scraper asks for it, gzip when it accepts it, ``?name[]=`` to pick families;
- ``/status.json``: the snapshot as JSON (state, dead letters, model versions: what is not a number);
- ``/``: one self-contained HTML page (no CDN, no build step) polling both; see ``page.py``.

Every request must name the server in its ``Host`` header (``127.0.0.1:PORT``, ``localhost:PORT``,
``[::1]:PORT`` or the bound address): a web page whose domain was rebound to 127.0.0.1 (DNS
rebinding) would otherwise read ``/status.json``, dead-letter payloads included; it gets 421.
The routes are one WSGI app (``StatusServer.app``) on ``wsgiref``'s server, a thread per request.

A snapshot is a dict; every key is optional:

``state`` (str), ``halves`` ({half: state}), ``counters`` ({name: total}; ``events``, ``rows``,
``unlabelled``, ``dead_letters``, ``micro_batches``, ``rows_trained``, ``predictions`` ...),
``dead_letters_by_reason`` ({reason: n}), ``unseen`` ({column: scored events with a categorical value
training never saw}), ``lag`` ({partition: records}), ``trainer_step``,
``train_loss``, ``prequential`` ({metric: value}), ``published_version``, ``serving_version``,
``announced_version``, ``serving_lag_versions``, ``serving_lag_s``, ``predictions_by_version`` ({version: n}),
``freshness_s`` (seconds since the newest published version was written), ``latency``
({"count": n, "sum_s": seconds, "buckets": [[upper bound s, cumulative count], ...]}: prediction
latency, event time to scoring; without buckets, a summary), ``dead_letters``
(newest first: [{time, reason, source, payload}]), ``versions`` (newest first: [{version, state:
published | published (unsigned) | serving | rejected, reason, time}]).

Metric families (``flowtrain_`` prefix): ``<counter>_total`` for every counter,
``dead_letters_by_reason_total{reason}``, ``unseen_values_total{column}``, ``consumer_lag{partition}``, ``trainer_step``,
``train_loss``, ``prequential{metric}``, ``published_version``, ``serving_version`` (what the newest predictions
carry), ``announced_version``, ``serving_lag_versions``, ``serving_lag_seconds``, ``predictions_total{version}``
(with the scorer's counts by version, in place of the unlabelled counter), ``model_freshness_seconds``, ``prediction_latency_seconds`` (a histogram; a summary without buckets),
``half_up{half}`` (1 while that half runs), ``sample_number`` (which snapshot this is) and
``sample_timestamp_seconds``; with the scorer's drift window (``drift``: ``pipelines.serving.drift.window_report``)
``feature_drift{feature,measure}``, ``drift_alarm{feature}``, ``prediction_drift`` and ``drift_window_rows``.
"""
from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, generate_latest, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, SummaryMetricFamily

from flowtrain.errors import FlowtrainError
from flowtrain.observe.page import PAGE

PREFIX = "flowtrain_"
#: At most this many distinct dead-letter reasons become label values (the rest: "other").
MAX_REASONS = 50


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


class SnapshotCollector:
    """A ``prometheus_client`` collector over the server's newest snapshot."""

    def __init__(self, server: StatusServer):
        self.server = server

    def collect(self):
        snap, number, at = self.server.snapshot_with_number()
        yield GaugeMetricFamily(PREFIX + "sample_number", "which snapshot of the job this is (increases by one "
                                "per sample)", value=number)
        yield GaugeMetricFamily(PREFIX + "sample_timestamp_seconds", "when this snapshot was taken (epoch seconds)",
                                value=at)
        halves = GaugeMetricFamily(PREFIX + "half_up", "1 while this half of the job runs", labels=["half"])
        for half, state in (snap.get("halves") or {}).items():
            halves.add_metric([half], 1.0 if state == "running" else 0.0)
        yield halves
        by_version = snap.get("predictions_by_version") or {}
        for name, total in (snap.get("counters") or {}).items():
            if name == "predictions" and by_version:
                continue  # labelled by version below
            if _number(total) is not None:
                yield CounterMetricFamily(PREFIX + name, f"{name.replace('_', ' ')} since the job started",
                                          value=float(total))
        if by_version:
            made = CounterMetricFamily(PREFIX + "predictions", "predictions since the job started, by the model "
                                       "version that made them", labels=["version"])
            for version, n in sorted(by_version.items(), key=lambda kv: int(kv[0])):
                if _number(n) is not None:
                    made.add_metric([str(version)], float(n))
            yield made
        unseen = CounterMetricFamily(PREFIX + "unseen_values", "scored events whose categorical value training never "
                                     "saw (or that is missing), per column", labels=["column"])
        for column, n in (snap.get("unseen") or {}).items():
            unseen.add_metric([column], float(n))
        yield unseen
        reasons = CounterMetricFamily(PREFIX + "dead_letters_by_reason", "dead letters on the dead-letter topic "
                                      "by reason", labels=["reason"])
        for reason, n in (snap.get("dead_letters_by_reason") or {}).items():
            reasons.add_metric([reason], float(n))
        yield reasons
        lag = GaugeMetricFamily(PREFIX + "consumer_lag", "records of the raw topic not yet committed by the "
                                "pipeline, per partition", labels=["partition"])
        for partition, n in sorted((snap.get("lag") or {}).items(), key=lambda kv: int(kv[0])):
            lag.add_metric([str(partition)], float(n))
        yield lag
        preq = GaugeMetricFamily(PREFIX + "prequential", "the trainer's prequential metrics (each batch evaluated "
                                 "before it is trained on) at its newest model version", labels=["metric"])
        for metric, value in (snap.get("prequential") or {}).items():
            if _number(value) is not None:
                preq.add_metric([metric], float(value))
        yield preq
        for key, name, text in (("trainer_step", "trainer_step", "the online trainer's optimizer step"),
                                ("train_loss", "train_loss", "the trainer's loss on its newest batch"),
                                ("published_version", "published_version", "the newest model version published"),
                                ("serving_version", "serving_version", "the model version the newest "
                                 "predictions carry"),
                                ("announced_version", "announced_version", "the newest valid model version a "
                                 "scorer instance has read on the updates topic"),
                                ("serving_lag_versions", "serving_lag_versions", "announced version minus the "
                                 "version the newest predictions carry (1 across trainer runs; 0: serving it)"),
                                ("serving_lag_s", "serving_lag_seconds", "seconds since the announced version was "
                                 "found while the newest predictions carry another (0: serving it)"),
                                ("freshness_s", "model_freshness_seconds",
                                 "seconds since the newest published model version was written")):
            value = _number(snap.get(key))
            if value is not None:
                yield GaugeMetricFamily(PREFIX + name, text, value=value)
        yield from _drift_families(snap.get("drift"))
        latency = snap.get("latency") or {}
        if latency.get("count") and latency.get("buckets"):
            buckets = [(repr(float(bound)), float(n)) for bound, n in latency["buckets"]]
            yield HistogramMetricFamily(PREFIX + "prediction_latency_seconds", "event time to scoring time of "
                                        "the predictions", buckets=buckets + [("+Inf", float(latency["count"]))],
                                        sum_value=float(latency["sum_s"]))
        elif latency.get("count"):
            yield SummaryMetricFamily(PREFIX + "prediction_latency_seconds", "event time to scoring time of "
                                      "the predictions", count_value=float(latency["count"]),
                                      sum_value=float(latency["sum_s"]))


def _drift_families(drift: dict | None):
    """The scorer's drift window (``snap["drift"]``, ``pipelines.serving.drift.window_report``) as gauges."""
    if not drift:
        return
    measures = GaugeMetricFamily(PREFIX + "feature_drift", "a drift measure of a feature (or the label) over the "
                                 "scorer's window against the training data", labels=["feature", "measure"])
    alarms = GaugeMetricFamily(PREFIX + "drift_alarm", "1 while a measure of this feature (or the label, the "
                               "prediction, the prequential error) is over its threshold", labels=["feature"])
    for entry in drift.get("features") or []:
        for measure, value in (entry.get("measures") or {}).items():
            if _number(value) is not None and entry.get("kind") in ("numeric", "categorical", "label"):
                measures.add_metric([str(entry["feature"]), str(measure)], float(value))
        alarms.add_metric([str(entry["feature"])], 1.0 if entry.get("alarm") else 0.0)
    yield measures
    yield alarms
    value = _number(drift.get("prediction_drift"))
    if value is not None:
        yield GaugeMetricFamily(PREFIX + "prediction_drift", "the shift of the model's score distribution over the "
                                "scorer's window (PSI; L-infinity for K classes)", value=value)
    rows = _number(drift.get("rows"))
    if rows is not None:
        yield GaugeMetricFamily(PREFIX + "drift_window_rows", "scored events in the drift window (all scorer "
                                "instances)", value=rows)


class StatusServer:
    """``/metrics``, ``/status.json`` and ``/`` of a job on ``host:port`` (port 0 = any free port;
    ``.port`` tells which), fed by ``sample()`` every ``interval_s`` seconds."""

    def __init__(self, port: int, sample: Callable[[], dict], *, host: str = "127.0.0.1", interval_s: float = 1.0,
                 title: str = "flowtrain"):
        self.sample, self.interval_s, self.title = sample, float(interval_s), title
        self._lock = threading.Lock()
        self._snapshot: dict = {"state": "starting"}
        self._number, self._at = 0, time.time()
        self._stop = threading.Event()
        # the families change with the snapshot: no names up front, ``?name[]=`` filters the samples
        self.registry = CollectorRegistry(auto_describe=False, support_collectors_without_names=True)
        self.registry.register(SnapshotCollector(self))
        self.errors = 0
        self._metrics_app = make_wsgi_app(self.registry)
        self.httpd = make_server(host, int(port), self.app, server_class=_ThreadingWSGIServer,
                                 handler_class=_QuietHandler)
        self.host, self.port = self.httpd.server_address[:2]
        self._threads = [threading.Thread(target=self.httpd.serve_forever, name="flowtrain-status-http",
                                          daemon=True),
                         threading.Thread(target=self._sample_loop, name="flowtrain-status-sample", daemon=True)]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/"

    def start(self) -> StatusServer:
        self._take()
        for thread in self._threads:
            thread.start()
        return self

    def stop(self, final: dict | None = None) -> None:
        """Stop sampling and serving (``final``: a last snapshot, e.g. the state "stopped")."""
        self._stop.set()
        if final is not None:
            self._set(final)
        self.httpd.shutdown()
        self.httpd.server_close()
        for thread in self._threads:
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(timeout=5)

    def snapshot_with_number(self) -> tuple[dict, int, float]:
        with self._lock:
            return self._snapshot, self._number, self._at

    def _set(self, snap: dict) -> None:
        with self._lock:
            self._snapshot, self._number, self._at = snap, self._number + 1, time.time()

    def _take(self) -> None:
        try:
            snap = self.sample()
        except Exception as err:  # noqa: BLE001 - a failing sample must not stop the job; it shows on the page
            self.errors += 1
            snap = {**self.snapshot_with_number()[0], "sample_error": f"{type(err).__name__}: {err}"[:300]}
        self._set(snap)

    def _sample_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._take()

    def metrics_text(self) -> bytes:
        return generate_latest(self.registry)

    def status_json(self) -> bytes:
        snap, number, at = self.snapshot_with_number()
        return json.dumps({**snap, "sample_number": number, "sample_time": at, "title": self.title},
                          default=str).encode()

    def app(self, environ: dict, start_response: Callable) -> list[bytes]:
        """The WSGI app: the ``Host`` check, then ``/metrics`` (``prometheus_client``'s app),
        ``/status.json``, ``/`` (``/index.html``) and ``/favicon.ico``; GET only."""
        host = environ.get("HTTP_HOST")
        if not ((host is None and environ.get("SERVER_PROTOCOL") == "HTTP/1.0")  # no browser speaks HTTP/1.0
                or (host is not None and host.strip().lower() in allowed_hosts(self.host, self.port))):
            return _plain(start_response, "421 Misdirected Request",
                          f"the Host header {host!r} does not name this server; use http://127.0.0.1:{self.port}/ "
                          f"or http://localhost:{self.port}/")
        path = environ.get("PATH_INFO") or "/"
        if path == "/metrics":
            def no_store(status: str, headers: list, exc_info=None):
                return start_response(status, [*headers, ("Cache-Control", "no-store")], exc_info)

            return self._metrics_app(environ, no_store)
        if environ.get("REQUEST_METHOD") != "GET":
            return _plain(start_response, "405 Method Not Allowed", "only GET is served", [("Allow", "GET")])
        if path == "/status.json":
            body, kind = self.status_json(), "application/json"
        elif path == "/favicon.ico":
            start_response("204 No Content", [])
            return []
        elif path in ("/", "/index.html"):
            body, kind = PAGE.replace("{{title}}", self.title).encode(), "text/html; charset=utf-8"
        else:
            return _plain(start_response, "404 Not Found", "not found: /, /metrics and /status.json are served")
        start_response("200 OK", [("Content-Type", kind), ("Content-Length", str(len(body))),
                                  ("Cache-Control", "no-store")])
        return [body]


def _plain(start_response: Callable, status: str, text: str, headers: list | None = None) -> list[bytes]:
    body = f"{status}: {text}\n".encode()
    start_response(status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body))),
                            *(headers or [])])
    return [body]


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    """``wsgiref``'s server with a thread per request (a slow client never blocks a scrape)."""

    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, *args):  # no line per request on the job's console
        pass


#: Host names a browser uses for a loopback server; any other name in ``Host`` may be DNS rebinding.
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")


def allowed_hosts(host: str, port: int) -> frozenset[str]:
    """The ``Host`` header values the server at ``host:port`` answers: the bound address, ``localhost``,
    ``127.0.0.1`` and ``[::1]``, each with the port (without it too when the port is 80). A page of
    another site whose name was rebound to 127.0.0.1 (DNS rebinding) sends its own name: refused."""
    bound = f"[{host}]" if ":" in host and not host.startswith("[") else host
    names = {bound.lower(), *LOOPBACK_NAMES}
    return frozenset({f"{n}:{port}" for n in names} | (names if port == 80 else set()))


def start_status_server(port: int | None, sample: Callable[[], dict], *, title: str = "flowtrain",
                        interval_s: float = 1.0) -> StatusServer | None:
    """The server on 127.0.0.1:``port``, started; None when ``port`` is 0 or None (off). A port in
    use is a ``ValueError`` naming ``--metrics-port``."""
    if not port:
        return None
    try:
        server = StatusServer(port, sample, title=title, interval_s=interval_s)
    except OSError as err:
        raise FlowtrainError(f"--metrics-port {port}: cannot listen on 127.0.0.1:{port} ({err.strerror or err}); "
                         f"choose another port, or 0 for none") from None
    return server.start()

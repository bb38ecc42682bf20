"""Flink's REST API: a GET of one resource, and cancelling the jobs of a name (Beam's job server cannot)."""
from __future__ import annotations

import json
import time
import urllib.request

from flowtrain.local.flink.jars import FlinkError

LOOPBACK = "127.0.0.1"


def rest_json(port: int, path: str, timeout: float = 3.0, host: str = LOOPBACK):
    with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=timeout) as resp:
        return json.loads(resp.read())


_ACTIVE = ("INITIALIZING", "CREATED", "RUNNING", "RESTARTING", "CANCELLING", "FAILING", "RECONCILING")


def cancel_flink_jobs(rest_url: str, job_name: str, *, timeout_s: float = 60.0) -> list[str]:
    """Cancel the Flink jobs named ``job_name`` through the REST API; returns their ids once
    they are CANCELED (or otherwise ended). Beam's job server cannot do it: its cancel only stops
    waiting for the job, which would run on (and keep reading and committing)."""
    base = rest_url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        base = f"http://{base}"

    def jobs() -> list[dict]:
        with urllib.request.urlopen(f"{base}/jobs/overview", timeout=10) as resp:
            return [j for j in json.loads(resp.read())["jobs"] if j["name"] == job_name]

    ids = [j["jid"] for j in jobs() if j["state"] in _ACTIVE]
    for jid in ids:
        req = urllib.request.Request(f"{base}/jobs/{jid}?mode=cancel", method="PATCH")
        urllib.request.urlopen(req, timeout=10).close()
    deadline = time.monotonic() + timeout_s
    while ids and time.monotonic() < deadline:
        if all(j["state"] not in _ACTIVE for j in jobs() if j["jid"] in ids):
            return ids
        time.sleep(0.5)
    if ids:
        raise FlinkError(f"Flink jobs {ids} ({job_name}) were not cancelled within {timeout_s:.0f} s; see {base}")
    return ids

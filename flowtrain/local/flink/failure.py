"""Where a failed Flink job failed, from the JobManager's exception history (its REST API).

Beam's job server reports a failed job as ``Pipeline NAME failed in state FAILED: <the innermost cause>``, and
that cause may name no TaskManager (seen: ``recvAddress(..) failed: Connection reset by peer`` when a TaskManager was
killed). Flink's history says which task failed on which TaskManager, and its stack trace the TaskManager a task lost
its connection to: ``flowtrain`` prints those lines under the error.
"""
from __future__ import annotations

import json
import re
import urllib.request

from flowtrain.local.flink.cluster import LocalFlink

_FAILED = re.compile(r"Pipeline (\S+) failed in state FAILED")
#: The causes of a stack trace worth a line: they name a TaskManager (a lost one, a lost connection to one).
_NAMES_A_TASKMANAGER = re.compile(r"task ?manager", re.I)
#: Lines at most, under the error.
MAX_LINES = 6


def failed_job_name(err: BaseException) -> str | None:
    """The Flink job name of a Beam pipeline that failed on a portable runner (``Pipeline <job name>_<id> failed in
    state FAILED``), else None."""
    found = _FAILED.search(str(err))
    return found.group(1).rsplit("_", 1)[0] if found else None


def failure_lines(err: BaseException, flink_master: str | None = None, *, timeout_s: float = 10.0) -> list[str]:
    """``err``'s first line, then lines saying where its Flink job failed (its task, TaskManager and endpoint, and
    the causes that name a TaskManager), from the cluster at ``flink_master`` (HOST:PORT) or the local one
    (``flowtrain flink start``); [] when ``err`` is no failed Flink job or the JobManager does not answer."""
    name = failed_job_name(err)
    if name is None:
        return []
    rest = flink_master or (LocalFlink().read_state() or {}).get("rest")
    if not rest:
        return []
    base = rest if rest.startswith(("http://", "https://")) else f"http://{rest}"
    try:
        with urllib.request.urlopen(f"{base.rstrip('/')}/jobs/overview", timeout=timeout_s) as resp:
            jobs = [j for j in json.loads(resp.read())["jobs"] if j["name"] == name and j["state"] == "FAILED"]
        if not jobs:
            return []
        jid = max(jobs, key=lambda j: j.get("end-time", 0))["jid"]
        with urllib.request.urlopen(f"{base.rstrip('/')}/jobs/{jid}/exceptions?maxExceptions=5",
                                    timeout=timeout_s) as resp:
            history = json.loads(resp.read())
    except (OSError, ValueError, KeyError):
        return []
    try:
        where = history_lines(history, f"{base.rstrip('/')}/jobs/{jid}/exceptions")
    except (AttributeError, TypeError):  # a response of another shape (another Flink version): Beam's error alone
        return []
    return [str(err).strip().splitlines()[0], *where] if where else []


def history_lines(history: dict, where: str) -> list[str]:
    """The newest failure of an exceptions response and those at the same time, one line each (task, TaskManager,
    endpoint, exception), then each cause of their stack traces that names a TaskManager; at most ``MAX_LINES``."""
    entries = (history.get("exceptionHistory") or {}).get("entries") or []
    if not entries:
        return []
    newest = entries[0]
    failures = [newest, *(newest.get("concurrentExceptions") or [])]
    lines = [f"Flink's exception history ({where}):"]
    causes: list[str] = []
    for f in failures:
        at = f.get("endpoint") or f.get("location") or "?"
        lines.append(f"task {f.get('taskName') or '?'} on TaskManager {f.get('taskManagerId') or '?'} ({at}): "
                     f"{f.get('exceptionName') or '?'}")
        for line in (f.get("stacktrace") or "").splitlines():
            text = line.strip().removeprefix("Caused by: ")
            if not line.startswith("\t") and _NAMES_A_TASKMANAGER.search(text) and text not in causes:
                causes.append(text)
    return (lines + [f"cause: {c[:300]}" for c in causes])[:MAX_LINES]

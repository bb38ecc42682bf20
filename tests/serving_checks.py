"""What users see of serving, read back from the topics: the version each prediction carries against the versions
published before its event was sent (issue #42: a scorer that announced new versions kept serving an old one, and
the tests of the time looked at what was announced or loaded, or at *any* prediction with the new version)."""
from __future__ import annotations

import json
import time
from collections.abc import Iterable

from kafka import KafkaProducer

from tests.scoring_helpers import predictions, read_topic

#: Events sent this long after a version's publication must carry it or a newer one (docs/serving.md).
AFTER_S = 5.0


def publications(bootstrap: str, updates_topic: str, *, only: set[tuple[str, int]] | None = None
                 ) -> list[tuple[float, str, int]]:
    """(publication time s, run id, version) of every record on the updates topic, in publication order (the
    record's Kafka timestamp: when it was produced); ``only``: just these (run id, version), the real ones of a test
    that also sends forged records."""
    out = []
    for m in read_topic(bootstrap, updates_topic):
        try:
            record = json.loads(m.value)
            found = (m.timestamp / 1000.0, str(record.get("run_id") or ""), int(record["version"]))
        except Exception:  # noqa: BLE001 - not a version: the hostile-record tests put every kind there
            continue
        if only is None or found[1:] in only:
            out.append(found)
    return sorted(out)


def stale(preds: Iterable[dict], sent_at: dict[str, float], published: list[tuple[float, str, int]],
          *, after_s: float = AFTER_S) -> dict:
    """Of the predictions whose event was sent ``after_s`` or more after some publication: how many carry a version
    published before the newest one published by then (or one never published). ``sent_at``: event source
    (``topic/partition/offset``) -> when it was sent (s). Returns {"checked", "stale", "share", "examples":
    [(source, carried, wanted)]}."""
    when = {(run, v): at for at, run, v in published}
    checked, bad, examples = 0, 0, []
    for p in preds:
        sent = sent_at.get(p["pred_source"])
        if sent is None:
            continue
        due = [(at, run, v) for at, run, v in published if at + after_s <= sent]
        if not due:
            continue
        at, run, want = due[-1]
        checked += 1
        carried = (str(p.get("pred_model_run") or ""), int(p["pred_model_version"]))
        if when.get(carried, float("-inf")) < at:
            bad += 1
            if len(examples) < 5:
                examples.append((p["pred_source"], carried, (run, want)))
    return {"checked": checked, "stale": bad, "share": bad / checked if checked else 0.0, "examples": examples}


def stale_scored(preds: Iterable[dict], published: list[tuple[float, str, int]], *, after_s: float = AFTER_S) -> dict:
    """As ``stale``, by when each prediction was made (its ``scoring_time``) rather than when its event was sent: of
    the predictions made ``after_s`` or more after a publication, those that carry an older version (a whole job's
    check, where the trainer publishes while events flow)."""
    sent = {}
    rows = []
    for p in preds:
        made = p["pred_scoring_time"]
        sent[p["pred_source"]] = made.timestamp() if hasattr(made, "timestamp") else float(made) / 1000.0
        rows.append(p)
    return stale(rows, sent, published, after_s=after_s)


def raw_sent_at(bootstrap: str, raw_topic: str) -> dict[str, float]:
    """Event source -> its Kafka timestamp (s): when it was sent, for events produced with the broker's clock."""
    return {f"{m.topic}/{m.partition}/{m.offset}": m.timestamp / 1000.0 for m in read_topic(bootstrap, raw_topic)}


def served_fresh(bootstrap: str, names: dict, *, sent_at: dict[str, float] | None = None,
                 only: set[tuple[str, int]] | None = None, after_s: float = AFTER_S) -> dict:
    """``stale`` over a run's topics (``names``: raw, pred, updates)."""
    return stale(predictions(bootstrap, names["pred"]), sent_at or raw_sent_at(bootstrap, names["raw"]),
                 publications(bootstrap, names["updates"], only=only), after_s=after_s)


def send_events(bootstrap: str, topic: str, rows: list[dict], *, timestamp_ms: int | None = None,
                spread_s: float = 0.0) -> dict[str, float]:
    """Send ``rows`` as JSON events (each confirmed); source -> when it was sent (s). ``timestamp_ms``: the records'
    own (old) time, as a replay of a table with its time column stamps them; ``spread_s``: sent over that long, as a
    live source sends."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    sent = {}
    try:
        step = spread_s / max(1, len(rows))
        for row in rows:
            at = time.time()
            meta = producer.send(topic, value=json.dumps(row).encode(), timestamp_ms=timestamp_ms).get(timeout=30)
            sent[f"{topic}/{meta.partition}/{meta.offset}"] = at
            if step:
                time.sleep(step)
    finally:
        producer.close()
    return sent

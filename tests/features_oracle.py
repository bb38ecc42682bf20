"""A brute-force pandas oracle of features over time (tests of pipelines/features and `flowtrain features`).

Every aggregate of an event at ``t`` is computed from its key's events in ``[t - w, t)`` by pandas: time-based
``groupby(key).rolling(w, closed='left')`` for count, sum, mean, min, max and std (ddof=0), a loop over the key's
earlier events for distinct, last and lastK (latest by (time, value)), ``merge_asof(direction='backward')`` for
the joins. Independent of the core: no code of pipelines.features besides the declaration's names.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from pipelines.features.declare import EVENTS, Declaration, last_k

_LIFE = "36500D"  # 100 years: longer than any test data


def _key(df: pd.DataFrame, key: tuple[str, ...]) -> pd.Series:
    parts = [df[k].astype(str).where(df[k].notna()) for k in key]
    out = parts[0]
    for p in parts[1:]:
        out = out + "\x1f" + p
    return out


def _number(values: pd.Series) -> pd.Series:
    v = pd.to_numeric(values, errors="coerce").astype(float)
    return v.where(np.isfinite(v))


def oracle(df: pd.DataFrame, decl: Declaration, micros: np.ndarray, tables: dict | None = None) -> pd.DataFrame:
    """The expected features of every row of ``df`` (in its order); ``micros``: its event times (int64 us, rows
    without a time: a value below -2**61)."""
    n = len(df)
    out: dict[str, np.ndarray] = {}
    timed = micros > -(1 << 61)
    for key in decl.keys():
        k = _key(df, key)
        ok = (k.notna() & timed).to_numpy()
        frame = pd.DataFrame({"k": k[ok].to_numpy(), "t": pd.to_datetime(micros[ok], unit="us"),
                              "i": np.flatnonzero(ok)}).sort_values(["k", "t", "i"], kind="stable")
        rolled = frame.set_index("t")

        def roll(values: np.ndarray, window: str, how: str, rolled=rolled) -> np.ndarray:
            r = rolled.assign(v=values[rolled["i"].to_numpy()]).groupby("k")["v"].rolling(window, closed="left")
            got = (r.std(ddof=0) if how == "std" else getattr(r, how)()).to_numpy()
            full = np.full(n, np.nan)
            full[rolled["i"].to_numpy()] = got
            return full

        ones = np.ones(n)
        seen = roll(ones, _LIFE, "count")
        out[f"{'_'.join(key)}_seen"] = (np.nan_to_num(seen) > 0).astype(np.int64)
        by_key = {kk: g["i"].to_numpy() for kk, g in frame.groupby("k", sort=False)}
        for a in decl.by_key(key):
            raw = df[a.column] if a.column != EVENTS else None
            numbers = _number(raw).to_numpy() if raw is not None else ones
            present = np.where(raw.notna().to_numpy(), 1.0, np.nan) if raw is not None and \
                not pd.api.types.is_numeric_dtype(raw) else numbers  # count: the values there
            for w in a.windows:
                window = _LIFE if w.seconds is None else f"{w.seconds}s"
                for agg in a.aggs:
                    name = a.feature(agg, w)
                    if agg in ("count", "sum"):
                        got = roll(present if agg == "count" else numbers, window, agg)
                        out[name] = np.nan_to_num(got).astype(np.int64 if agg == "count" else float)
                        out[name][~ok] = 0
                    elif agg in ("mean", "min", "max", "std"):
                        out[name] = roll(numbers, window, agg)
                    else:
                        out.update(_brute(a, agg, w, name, raw, numbers, micros, ok, k, by_key))
    result = df.copy()
    for name, col in out.items():
        result[name] = col
    for j in decl.joins:
        table = tables[j.table].copy()
        others = [c for c in table.columns if c not in j.key and c not in (j.valid_from, "_vf_micros")]
        left = pd.DataFrame({"_k": _key(df, j.key), "_t": micros, "_i": np.arange(n)})
        right = table.assign(_k=_key(table, j.key)).rename(columns={c: j.column_name(c) for c in others})
        if j.valid_from:
            right["_t"] = right.pop("_vf_micros")
            merged = pd.merge_asof(left.sort_values("_t"), right.sort_values("_t")[["_t", "_k", *map(j.column_name, others)]],
                                   on="_t", by="_k", direction="backward").sort_values("_i")
        else:
            merged = left.merge(right[["_k", *map(j.column_name, others)]], on="_k", how="left")
        for c in others:
            result[j.column_name(c)] = merged[j.column_name(c)].to_numpy()
    return result


def _brute(a, agg, w, name, raw, numbers, micros, ok, k, by_key) -> dict:
    """distinct, last, lastK: a loop over each event's key's earlier events."""
    n = len(micros)
    kk = last_k(agg)
    text = raw is not None and not pd.api.types.is_numeric_dtype(raw)
    vals = raw.astype(object).where(raw.notna(), None).to_numpy() if text else numbers
    present = np.array([v is not None for v in vals]) if text else np.isfinite(vals)
    cols = [np.full(n, None if text else np.nan, dtype=object if text else float) for _ in range(max(kk, 1))]
    distinct = np.zeros(n, dtype=np.int64)
    keys = k.to_numpy()
    for i in np.flatnonzero(ok):
        idx = by_key[keys[i]]
        t = micros[i]
        sel = idx[(micros[idx] < t) & present[idx]]
        if w.seconds is not None:
            sel = sel[micros[sel] >= t - w.seconds * 1_000_000]
        if agg == "distinct":
            distinct[i] = len({vals[j] for j in sel})
            continue
        latest = sorted(sel, key=lambda j: (micros[j], vals[j]), reverse=True)
        for slot in range(max(kk, 1)):
            if slot < len(latest):
                cols[slot][i] = vals[latest[slot]]
    if agg == "distinct":
        return {name: distinct}
    if kk:
        return {f"{name}_{s + 1}": cols[s] for s in range(kk)}
    return {name: cols[0]}


def waiting_at_end(records, lateness_s: float) -> set[str]:
    """The ids (``txn``, as text) of the events a stream part still holds at the end, from the raw topic's
    ``records`` (each with ``partition``, ``offset`` and its JSON ``value`` holding ``txn`` and ``time``): in each
    partition, in offset order, every event from the first one more than ``lateness_s`` after the partition's
    greatest time on (they wait for the watermark; rows go on in offset order)."""
    import json

    by_part: dict[int, list] = {}
    for m in records:
        event = json.loads(m.value)
        by_part.setdefault(m.partition, []).append((m.offset, float(event["time"]), str(event["txn"])))
    out: set[str] = set()
    for events in by_part.values():
        events.sort()
        top = max(t for _, t, _ in events)
        first = next((i for i, (_, t, _) in enumerate(events) if t > top - lateness_s), len(events))
        out |= {txn for _, _, txn in events[first:]}
    return out


def logged_ids(log_dir) -> set[str]:
    """The ids (``txn``, as text) of the events a --log-features directory holds."""
    import json
    from pathlib import Path

    return {str(json.loads(line)["txn"]) for f in Path(log_dir).glob("*.jsonl") for line in f.read_text().splitlines()
            if line.strip()}

"""The wire format of a published model version with ID tables: a snapshot or a delta.

A version's payload is a safetensors file (no pickle: nothing a reader loads runs code) holding
the dense parameters (``dense/<name>``) and, per ID table, the rows added or updated
(``ids/<table>/keys`` int64, ``ids/<table>/rows`` float32 ``[n, dim]``) and the keys evicted
(``ids/<table>/evicted``). Its metadata says the ``version``, the ``kind`` (``snapshot``: every
row the table holds; ``delta``: only the rows changed since version ``base``) and the format.
A delta is applied only on top of exactly its ``base``: a scorer that has another version waits
for the next snapshot (``pipelines.ids.serving``). ``info`` is text the payload carries beside its
tensors (the stream trainer's model architecture, so a scorer can rebuild the model), kept in the
metadata as ``info/<name>``.

``signed_record`` is the model-updates record of a payload, signed like every update record
(``connectors.model_updates.sign_record``: HMAC-SHA256 over the record with the payload's sha256),
with ``base`` and ``kind`` inside the signature; ``verify_record`` checks one. A delta's record also names its
base's payload digest (``base_sha256``, signed): a scorer applies a delta only on the very payload it was
computed from — a version of the same number from another lineage (a trainer that resumed from an older
checkpoint and published that number again) never takes a delta that was not made on top of it.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import struct
from dataclasses import dataclass, field

import numpy as np
from safetensors.numpy import load, save

from connectors.model_updates import sign_record

FORMAT = "flowtrain-id-delta/1"
KINDS = ("snapshot", "delta")


class DeltaError(ValueError):
    """A payload or record that cannot be believed: the reason names it."""


@dataclass
class TableChange:
    keys: np.ndarray  # int64 [n]: added or updated
    rows: np.ndarray  # float32 [n, dim]
    evicted: np.ndarray  # int64 [m]


@dataclass
class IdVersion:
    version: int
    base: int | None  # a delta's previous version; None for a snapshot
    kind: str
    dense: dict[str, np.ndarray] = field(default_factory=dict)
    tables: dict[str, TableChange] = field(default_factory=dict)
    info: dict[str, str] = field(default_factory=dict)


def encode(v: IdVersion) -> bytes:
    if v.kind not in KINDS:
        raise ValueError(f"kind {v.kind!r}: one of {KINDS}")
    if (v.kind == "delta") != (v.base is not None):
        raise ValueError("a delta names its base version; a snapshot has none")
    tensors: dict[str, np.ndarray] = {f"dense/{k}": np.ascontiguousarray(a, dtype=np.float32)
                                      for k, a in v.dense.items()}
    for name, t in v.tables.items():
        if "/" in name:
            raise ValueError(f"table name {name!r}: no '/'")
        tensors[f"ids/{name}/keys"] = np.ascontiguousarray(t.keys, dtype=np.int64)
        tensors[f"ids/{name}/rows"] = np.ascontiguousarray(t.rows, dtype=np.float32)
        tensors[f"ids/{name}/evicted"] = np.ascontiguousarray(t.evicted, dtype=np.int64)
    meta = {"format": FORMAT, "version": str(int(v.version)), "kind": v.kind,
            "base": "" if v.base is None else str(int(v.base))}
    for k, text in v.info.items():
        if not isinstance(text, str):
            raise ValueError(f"info {k!r}: text, not {type(text).__name__}")
        meta[f"info/{k}"] = text
    return save(tensors, metadata=meta)


def decode(data: bytes, max_bytes: int = 1 << 31) -> IdVersion:
    """The payload's version; a ``DeltaError`` for anything else (too large, not safetensors, a wrong
    format, inconsistent tables)."""
    if len(data) > max_bytes:
        raise DeltaError(f"an ID version of {len(data):,} bytes is over the limit of {max_bytes:,}")
    try:
        (n,) = struct.unpack("<Q", data[:8])
        meta = json.loads(data[8: 8 + n]).get("__metadata__") or {}
        tensors = load(data)
    except Exception as err:  # noqa: BLE001 - any unreadable payload: named
        raise DeltaError(f"not an ID version payload ({type(err).__name__}: {err})") from None
    if meta.get("format") != FORMAT or meta.get("kind") not in KINDS:
        raise DeltaError(f"not an ID version payload (format {meta.get('format')!r}, kind {meta.get('kind')!r})")
    try:
        version, base = int(meta["version"]), (int(meta["base"]) if meta.get("base") else None)
    except (KeyError, ValueError):
        raise DeltaError("an ID version payload without a whole version number") from None
    out = IdVersion(version, base, meta["kind"],
                    info={k[len("info/"):]: str(t) for k, t in meta.items() if k.startswith("info/")})
    for key, arr in tensors.items():
        part, _, rest = key.partition("/")
        if part == "dense":
            out.dense[rest] = arr
    for name in {k.split("/")[1] for k in tensors if k.startswith("ids/")}:
        keys, rows, ev = (tensors.get(f"ids/{name}/{p}") for p in ("keys", "rows", "evicted"))
        if keys is None or rows is None or ev is None or rows.ndim != 2 or len(rows) != len(keys) \
                or keys.dtype != np.int64 or ev.dtype != np.int64:
            raise DeltaError(f"ID table {name!r}: keys, rows and evicted do not fit together")
        out.tables[name] = TableChange(keys, rows, ev)
    return out


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def signed_record(payload: bytes, *, version: int, base: int | None, kind: str, run_id: str, path: str,
                  sequence: int, key: bytes | None, base_sha256: str | None = None) -> dict:
    """The model-updates record of ``payload`` (signed with ``key`` when given); a delta names its base's
    payload digest ``base_sha256``."""
    if (kind == "delta") != (base_sha256 is not None):
        raise ValueError("a delta names its base's payload digest (base_sha256); a snapshot none")
    record = {"version": int(version), "base": base, "kind": kind, "run_id": run_id, "checkpoint": path,
              "sha256": sha256_of(payload), "bytes": len(payload), "sequence": int(sequence), "format": FORMAT,
              "base_sha256": base_sha256}
    return sign_record(record, key) if key is not None else record


def verify_record(record: dict, payload: bytes, key: bytes | None) -> None:
    """A ``DeltaError`` unless ``record`` is signed with ``key`` (when one is set) and names ``payload``'s digest."""
    if key is not None:
        want = sign_record({k: v for k, v in record.items() if k != "signature"}, key)["signature"]
        if not isinstance(record.get("signature"), str) or not hmac.compare_digest(want, record["signature"]):
            raise DeltaError(f"version {record.get('version')}: bad signature (not signed with this scorer's key)")
    if record.get("sha256") != sha256_of(payload):
        raise DeltaError(f"version {record.get('version')}: the payload's digest is not the record's")

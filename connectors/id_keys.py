"""The key of an ID value: a stable 64-bit hash of its text, never a row.

``"42"`` and ``42`` are the same ID (a CSV column and a JSON number agree). A value that is missing,
empty, too long (``max_bytes``) or of a type an ID cannot have (a float, a list, a dict) has no key:
it uses the table's fallback vector and its reason is counted (``KeyReasons``).

The reason travels with the data: such a value's "key" is one of a few reserved values at the bottom of
the int64 range (``BAD_KEYS``: ``NO_KEY`` is a missing value, the next ones empty, too long, wrong type),
which no ID's key ever takes, so a dataset shard, a feature message and a scorer's batch say why a row
used the fallback vector (``is_key``, ``reason_counts``).
"""
from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable

import numpy as np

DEFAULT_MAX_ID_BYTES = 256  # --max-id-bytes
NO_KEY = np.iinfo(np.int64).min  # the key of a value that has none (uses the fallback vector): a missing one
#: The reserved keys of the values without one, by reason (a key of an ID is never one of these).
BAD_KEYS = {"missing": NO_KEY, "empty": NO_KEY + 1, "too_long": NO_KEY + 2, "wrong_type": NO_KEY + 3}
_RESERVED = 8  # NO_KEY .. NO_KEY + 7 are reserved
_REASON_OF = {v: k for k, v in BAD_KEYS.items()}


def is_key(keys) -> np.ndarray:
    """Which of ``keys`` (int64) are IDs' keys (not the reserved keys of values without one)."""
    return np.asarray(keys, dtype=np.int64) >= NO_KEY + _RESERVED


def reason_counts(keys) -> dict[str, int]:
    """How many of ``keys`` are the reserved key of each reason (reasons with none left out)."""
    keys = np.asarray(keys, dtype=np.int64)
    bad = keys[~is_key(keys)]
    if not len(bad):
        return {}
    values, counts = np.unique(bad, return_counts=True)
    return {_REASON_OF.get(int(v), "missing"): int(n) for v, n in zip(values, counts)}


def key_of(text: str) -> int:
    """The signed 64-bit key of an ID's text (BLAKE2b, 8 bytes, little endian): the same in every
    process, run and machine (unlike Python's ``hash``)."""
    key = int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little", signed=True)
    return key if key >= NO_KEY + _RESERVED else key + _RESERVED  # never a reserved key (BAD_KEYS)


def id_text(value, max_bytes: int = DEFAULT_MAX_ID_BYTES) -> tuple[str | None, str | None]:
    """``(text, None)`` for a usable ID value, else ``(None, reason)``."""
    if value is None or (isinstance(value, (float, np.floating)) and value != value):  # None or NaN
        return None, "missing"
    if isinstance(value, (float, np.floating)) and float(value).is_integer():
        value = int(value)  # 42.0: an integer column that held a missing value (pandas), the ID 42
    if isinstance(value, bool) or not isinstance(value, (str, int, np.integer)):
        return None, f"wrong type ({type(value).__name__})"
    text = value if isinstance(value, str) else str(int(value))
    if text == "":
        return None, "empty"
    if len(text.encode("utf-8")) > max_bytes:
        return None, f"too long (over {max_bytes} bytes, --max-id-bytes)"
    return text, None


class KeyReasons(Counter):
    """Values that got no key, counted by reason."""


def keys_of(values: Iterable, max_bytes: int = DEFAULT_MAX_ID_BYTES,
            reasons: KeyReasons | None = None) -> np.ndarray:
    """int64 keys of ``values`` (where a value has none, the reserved key of its reason, ``BAD_KEYS``; the
    reason counted in ``reasons``)."""
    out = []
    for value in values:
        text, reason = id_text(value, max_bytes)
        if text is None:
            if reasons is not None:
                reasons[reason] += 1
            out.append(BAD_KEYS[reason_kind(reason)])
        else:
            out.append(key_of(text))
    return np.asarray(out, dtype=np.int64)


def reason_kind(reason: str) -> str:
    """The kind (a ``BAD_KEYS`` name) of an ``id_text`` reason: ``wrong type (float)`` -> ``wrong_type``."""
    return next((k for k in BAD_KEYS if reason.startswith(k.replace("_", " "))), "missing")

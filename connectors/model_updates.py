"""Model-update records: what the online trainer publishes and what a scorer may believe.

A record on the model-updates topic is JSON naming one published model version::

    {"version": 7, "run_id": "3f2c...", "checkpoint": "/runs/s/published/ckpt-000000007.pt",
     "sha256": "<hex digest of that file>", "bytes": 412345, ..., "signature": "<hex>"}

``signature`` is HMAC-SHA256, keyed with the update key, over the record's canonical JSON
(sorted keys, no spaces) without the signature: it covers the checkpoint file's digest, so a
signed record authenticates the file's bytes as well as its version, run and path. A signed
record also carries ``sequence``: when it was published (milliseconds since the epoch, strictly
increasing per trainer), the order a scorer believes across runs; a record re-sent later keeps
its old sequence, so a replay never rolls a scorer back (Kafka's own timestamp is the re-sender's). The key is
read from a file (``--update-key-file``) or the ``FLOWTRAIN_UPDATE_KEY`` environment variable,
never from the command line; ``UpdateKeySource`` names where, so a worker process reads it
itself and the key never travels in a pipeline graph or a config file.

``check_record`` decides whether a record can be believed (format, size, nesting, types and ranges,
signature); whatever the bytes, it returns an ``UpdateRecord`` or raises ``RejectedUpdate`` (the
reason, and its ``kind`` for counting), never another exception;
``read_model_file`` reads the file it names: only a regular file (a FIFO or device is refused
without blocking), at most ``max_bytes``, with its digest checked against the record's.

Versions are scoped by ``run_id``: a version number means something only within its trainer run.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from connectors.secrets import check_private

__all__ = ["UPDATE_KEY_ENV", "MAX_RECORD_BYTES", "MAX_RECORD_DEPTH", "MAX_VERSION", "MAX_RUN_ID_CHARS",
           "DEFAULT_MAX_MODEL_BYTES", "UpdateKeySource", "UpdateRecord", "RejectedUpdate", "sign_record",
           "check_record", "read_model_file", "read_regular_file", "sha256_hex"]

UPDATE_KEY_ENV = "FLOWTRAIN_UPDATE_KEY"
#: A model-update record is a few hundred bytes; anything far larger is not one.
MAX_RECORD_BYTES = 64 * 1024
#: Nesting levels of objects and arrays in a record (the trainer's records have 2).
MAX_RECORD_DEPTH = 8
#: The largest version number and sequence (a prediction's ``model_version`` is an int64).
MAX_VERSION = 2 ** 63 - 1
#: The longest run id (it is copied into every prediction; the trainer's are 32 hex digits).
MAX_RUN_ID_CHARS = 128
_MAX_PATH_CHARS = 4096
_SHA256 = re.compile(r"[0-9a-f]{64}")
#: The largest model file a scorer reads (``--max-model-bytes``).
DEFAULT_MAX_MODEL_BYTES = 1 << 30
#: The shortest key accepted (HMAC-SHA256 keys shorter than the hash weaken it).
MIN_KEY_BYTES = 16


class RejectedUpdate(ValueError):
    """A record or file that is not believed; the message is the reason, ``kind`` its class (for
    counting and logging once per kind): tombstone, oversized, not JSON, malformed, unsigned, bad
    signature, stale, file, load."""

    def __init__(self, reason: str, kind: str = "malformed"):
        super().__init__(reason)
        self.kind = kind


@dataclass(frozen=True)
class UpdateKeySource:
    """Where the update key comes from: a file, else an environment variable (both: the file)."""

    key_file: str | None = None
    env: str = UPDATE_KEY_ENV

    @classmethod
    def from_options(cls, key_file: str | None, env: str = UPDATE_KEY_ENV) -> UpdateKeySource | None:
        """The key's source when one is given (``key_file`` or a non-empty ``env``), else None."""
        if key_file:
            return cls(str(Path(key_file).expanduser().resolve()), env)
        return cls(None, env) if os.environ.get(env) else None

    def load(self) -> bytes:
        """The key's bytes (a file's content without its trailing newline); a clear error if unusable."""
        if self.key_file:
            check_private(self.key_file, "--update-key-file")  # only its owner may read a key (as ssh asks)
            try:
                data = read_regular_file(self.key_file, 64 * 1024, what="update key file")
            except (OSError, RejectedUpdate) as err:
                raise ValueError(f"--update-key-file {self.key_file}: {err}") from None
            key = data.rstrip(b"\r\n")
            where = f"--update-key-file {self.key_file}"
        else:
            key = os.environ.get(self.env, "").encode()
            where = f"environment variable {self.env}"
        if len(key) < MIN_KEY_BYTES:
            raise ValueError(f"{where}: the update key has {len(key)} bytes; use at least {MIN_KEY_BYTES} "
                             f"(e.g. `head -c 32 /dev/urandom | base64 > update.key`)")
        return key

    def describe(self) -> str:
        return f"--update-key-file {self.key_file}" if self.key_file else f"${self.env}"


def _canonical(record: dict) -> bytes:
    return json.dumps({k: v for k, v in record.items() if k != "signature"}, sort_keys=True,
                      separators=(",", ":"), allow_nan=False).encode()


def sign_record(record: dict, key: bytes) -> dict:
    """The record with its ``signature`` (HMAC-SHA256 over its canonical JSON, digest included)."""
    if "sha256" not in record:
        raise ValueError("a signed model-update record needs the checkpoint's 'sha256'")
    return {**record, "signature": hmac.new(key, _canonical(record), hashlib.sha256).hexdigest()}


@dataclass(frozen=True)
class UpdateRecord:
    """A model-update record that passed ``check_record``."""

    version: int
    run_id: str  # "" for a record of a trainer that did not name its run
    path: str
    sha256: str | None  # None only without a key (an old unsigned record): the file's sidecar is checked
    size: int | None
    signed: bool
    raw: dict
    sequence: int | None = None  # when it was published (ms), signed; None only in an unsigned record


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is out of a float's range")
    return value


def _depth(value) -> int:
    """Nesting levels of objects and arrays in a parsed JSON value (iterative: no recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, level)
            if level > MAX_RECORD_DEPTH:
                break
            stack.extend((v, level + 1) for v in item if isinstance(v, (dict, list)))
    return deepest


def _whole(value, low: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and low <= value <= MAX_VERSION


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_record(value: bytes | None, key: bytes | None) -> UpdateRecord:
    """Parse and authenticate one record; raises ``RejectedUpdate`` with the reason (and only that:
    any bytes at all are a record or a rejection, never another exception)."""
    try:
        return _check_record(value, key)
    except RejectedUpdate:
        raise
    except RecursionError:
        raise RejectedUpdate("not a model-update record (nested too deeply)", "malformed") from None
    except Exception as err:  # noqa: BLE001 - whatever a record holds, it is a rejection with a reason
        raise RejectedUpdate(f"not a model-update record ({type(err).__name__}: {str(err)[:200]})",
                             "malformed") from None


def _check_record(value, key: bytes | None) -> UpdateRecord:
    if value is None:
        raise RejectedUpdate("empty record (a tombstone), not a model-update record", "tombstone")
    if not isinstance(value, (bytes, bytearray)):
        raise RejectedUpdate(f"not a model-update record (a {type(value).__name__}, not bytes)")
    if len(value) > MAX_RECORD_BYTES:
        raise RejectedUpdate(f"record of {len(value):,} bytes, over the {MAX_RECORD_BYTES:,}-byte bound of a "
                             f"model-update record", "oversized")
    try:
        record = json.loads(value, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise RejectedUpdate("not a model-update record (JSON nested too deeply)", "not JSON") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise RejectedUpdate(f"not a model-update record (not JSON: {str(err)[:200]})", "not JSON") from None
    if not isinstance(record, dict):
        raise RejectedUpdate("not a model-update record (not a JSON object)")
    if _depth(record) > MAX_RECORD_DEPTH:
        raise RejectedUpdate(f"not a model-update record (nested more than {MAX_RECORD_DEPTH} levels)")
    try:
        version, path = record["version"], record["checkpoint"]
    except KeyError as err:
        raise RejectedUpdate(f"not a model-update record (no {err}); expected JSON with 'version' and "
                             f"'checkpoint'") from None
    if not _whole(version, 1):
        raise RejectedUpdate(f"not a model-update record ('version' must be a whole number from 1 to 2^63-1, "
                             f"not {_short(version)})")
    if not isinstance(path, str) or not path or "\x00" in path or len(path) > _MAX_PATH_CHARS:
        raise RejectedUpdate(f"not a model-update record ('checkpoint' must be a path: text without NUL, at most "
                             f"{_MAX_PATH_CHARS} characters, not {_short(path)})")
    run_id, digest, size = record.get("run_id", ""), record.get("sha256"), record.get("bytes")
    sequence, signature = record.get("sequence"), record.get("signature")
    if not isinstance(run_id, str) or len(run_id) > MAX_RUN_ID_CHARS:
        raise RejectedUpdate(f"not a model-update record ('run_id' must be text of at most {MAX_RUN_ID_CHARS} "
                             f"characters, not {_short(run_id)})")
    if digest is not None and (not isinstance(digest, str) or not _SHA256.fullmatch(digest)):
        raise RejectedUpdate(f"not a model-update record ('sha256' must be 64 hex digits, not {_short(digest)})")
    if size is not None and not _whole(size, 0):
        raise RejectedUpdate(f"not a model-update record ('bytes' must be a whole number >= 0, not {_short(size)})")
    if sequence is not None and not _whole(sequence, 0):
        raise RejectedUpdate(f"not a model-update record ('sequence' must be a whole number >= 0, not "
                             f"{_short(sequence)})")
    if signature is not None and not isinstance(signature, str):
        raise RejectedUpdate("not a model-update record ('signature' must be text)")
    if key is not None:
        if signature is None:
            raise RejectedUpdate("unsigned: an update key is set and the record has no signature", "unsigned")
        if digest is None:
            raise RejectedUpdate("unsigned: the record names no checkpoint digest ('sha256')", "unsigned")
        want = hmac.new(key, _canonical(record), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(want, signature):
            raise RejectedUpdate("bad signature: not signed with this scorer's update key", "bad signature")
        if sequence is None or not run_id:
            raise RejectedUpdate("signed, but without its run id and 'sequence' (a record of an older flowtrain "
                                 "trainer, whose order cannot be checked): publish it again with this version",
                                 "unsigned")
    return UpdateRecord(version, run_id, path, digest, size, key is not None, record, sequence)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_regular_file(path: str | os.PathLike, max_bytes: int, *, what: str = "model file") -> bytes:
    """The bytes of a regular file of at most ``max_bytes``; a FIFO, device or directory is refused
    without blocking (opened non-blocking, checked with ``fstat`` on the opened file)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise RejectedUpdate(f"{what} {path} does not exist (removed, or not on this machine's filesystem)", "file") from None
    except OSError as err:
        raise RejectedUpdate(f"{what} {path} cannot be opened ({err.strerror})", "file") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RejectedUpdate(f"{what} {path} is not a regular file", "file")
        if st.st_size > max_bytes:
            raise RejectedUpdate(f"{what} {path} has {st.st_size:,} bytes, over the {max_bytes:,}-byte bound "
                                 f"(--max-model-bytes)", "file")
        os.set_blocking(fd, True)
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:
                raise RejectedUpdate(f"{what} {path} grew past the {max_bytes:,}-byte bound while being read", "file")
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_model_file(record: UpdateRecord, max_bytes: int) -> bytes:
    """The bytes of the file a checked record names, its digest equal to the record's (when it has one)."""
    data = read_regular_file(record.path, max_bytes)
    if record.size is not None and len(data) != record.size:
        raise RejectedUpdate(f"model file {record.path} has {len(data):,} bytes, the record says {record.size:,}", "file")
    if record.sha256 is not None and not hmac.compare_digest(sha256_hex(data), record.sha256):
        raise RejectedUpdate(f"model file {record.path} does not match the record's sha256 (changed or torn since "
                             f"it was published)", "file")
    return data

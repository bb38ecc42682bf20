"""Published model versions: what the online trainer publishes, and a published file back into a model.

Publishing (``Publisher``, used by the online trainer at each checkpoint): the version's model
(weights, architecture, version, step, run id; no optimizer) is written atomically into
``<run>/published/ckpt-<version>.pt`` with its SHA-256 beside it. That directory has its own
retention (``keep``, default 10 versions), separate from the trainer's checkpoints (which keep 3),
so a version stays loadable while a scorer may still need it; the scorer also keeps its own
verified copy of each version it serves. The record on the model-updates topic names the file,
its digest and size, the trainer's run id, the version and its ``sequence`` (the publication
time in milliseconds, strictly increasing per publisher: the order scorers believe across runs,
which a re-sent old record cannot change), and is signed (HMAC-SHA256,
``connectors.model_updates``) when an update key is set (``--update-key-file`` or
``FLOWTRAIN_UPDATE_KEY``).

A model with ID tables is published differently (``publish_ids``): each version is a payload
(``connectors.id_deltas``, safetensors) of the dense parameters and only the ID rows changed since
the previous version, with a full snapshot every ``--snapshot-every`` versions
(``flowtrain.train.ids.publish.IdPublisher``), written to ``<run>/published/ids-<version>-<kind>.safetensors``;
tables sharded over the replicas (``--workers N``) publish the same versions, every replica's changed rows
gathered to rank 0.
Its record adds ``kind`` (snapshot or delta), ``base`` (a delta's previous version) and
``format``, inside the signature. Retention keeps the newest ``keep`` payloads *and* every one
from the newest snapshot on, so a scorer starting late finds the newest snapshot and the deltas
after it (``pipelines.serving.versions.VersionTracker`` applies them in order).

Loading (``LoadPublishedVersion``): such a file into the model it holds, built exactly as the
trainer builds it (``Architecture.build`` on the batch dataset), in eval mode, with its version.
Only a regular file of bounded size is read; its digest is checked (the record's when given,
else the ``.sha256`` beside it) and the weights load strictly, so a torn, corrupted or mismatched
file is an error that says why. A file that is an ID-version snapshot (the scorer's own copy of the
version it serves, made from the snapshot and deltas it applied) is rebuilt from the architecture it
carries, its dense parameters and its tables' rows. It is a plain picklable callable: the scoring pipeline (which may
not import flowtrain) receives it as ``load_version``.
"""
from __future__ import annotations

import io
import json
import sys
import time
import uuid
from pathlib import Path

import torch

from connectors.atomic import atomic_write
from connectors.id_deltas import FORMAT as ID_FORMAT
from connectors.id_deltas import DeltaError, IdVersion
from connectors.id_deltas import decode as decode_id_version
from connectors.model_updates import (
    DEFAULT_MAX_MODEL_BYTES,
    RejectedUpdate,
    UpdateKeySource,
    read_regular_file,
    sha256_hex,
    sign_record,
)
from flowtrain.train import checkpoint
from flowtrain.train.ids.publish import load_snapshot
from flowtrain.train.models import Architecture

#: Versions kept in ``<run>/published/`` (the trainer's checkpoints keep 3).
DEFAULT_KEEP_PUBLISHED = 10


def new_run_id() -> str:
    """A trainer run's id: versions are numbered within it (a scorer orders versions per run)."""
    return uuid.uuid4().hex


class Publisher:
    """Writes a version into ``<run>/published/`` and makes its (signed) update record."""

    def __init__(self, run_dir: str | Path, *, keep: int = DEFAULT_KEEP_PUBLISHED,
                 key_source: UpdateKeySource | None = None):
        if keep < 1:
            raise ValueError(f"keep_published={keep}: keep at least 1 published version")
        self.dir = Path(run_dir) / "published"
        self.keep = keep
        self.key = key_source.load() if key_source is not None else None
        self.key_source = key_source
        self._warned = False
        self._sequence = 0
        self._ids_sha256: str | None = None  # the digest of this process's last ID version: the next delta's base

    def _next_sequence(self) -> int:
        self._sequence = max(time.time_ns() // 1_000_000, self._sequence + 1)  # strictly increasing
        return self._sequence

    def _signed(self, record: dict) -> dict:
        record = json.loads(json.dumps(record, default=str))  # plain JSON types, as the scorer will see them
        if self.key is None:
            if not self._warned:
                self._warned = True
                print("stream train: WARNING: model versions are published UNSIGNED (no --update-key-file and no "
                      "$FLOWTRAIN_UPDATE_KEY): any producer on the updates topic can make scorers load its file",
                      file=sys.stderr, flush=True)
            return record
        return sign_record(record, self.key)

    def publish_ids(self, payload: bytes, meta: IdVersion, *, step: int, run_id: str, **fields) -> dict:
        """Write an ID version's payload (``IdPublisher.publish``), then return its (signed) record. A delta's
        record names its base's payload digest (``base_sha256``: the last ID version this process published):
        a scorer applies it only on top of exactly that payload (``pipelines.ids.serving``)."""
        if meta.kind == "delta" and self._ids_sha256 is None:
            raise ValueError(f"ID version {meta.version}: a delta, but this publisher published no ID version before "
                             f"it (the first version of a process is a snapshot)")
        path = self.dir / f"ids-{meta.version:09d}-{meta.kind}.safetensors"
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_write(path, payload)
        self._prune_ids()
        record = {**fields, "version": meta.version, "base": meta.base, "kind": meta.kind, "format": ID_FORMAT,
                  "run_id": run_id, "step": step, "checkpoint": str(path.resolve()), "sha256": sha256_hex(payload),
                  "bytes": len(payload), "sequence": self._next_sequence(),
                  "base_sha256": self._ids_sha256 if meta.kind == "delta" else None,
                  "rows": {name: int(len(t.keys)) for name, t in meta.tables.items()},
                  "evicted": {name: int(len(t.evicted)) for name, t in meta.tables.items()}}
        self._ids_sha256 = record["sha256"]
        return self._signed(record)

    def _prune_ids(self) -> None:
        """Keep the newest ``keep`` payloads and all from the newest snapshot on (a late scorer's start)."""
        files = sorted(self.dir.glob("ids-*.safetensors"))
        snapshots = [i for i, p in enumerate(files) if p.name.endswith("-snapshot.safetensors")]
        first_kept = min(max(0, len(files) - self.keep), snapshots[-1] if snapshots else 0)
        for old in files[:first_kept]:
            old.unlink(missing_ok=True)

    def publish(self, *, model: dict, architecture: dict, version: int, step: int, run_id: str,
                **fields) -> dict:
        """Write the version's file, then return its record (signed when a key is set)."""
        path = checkpoint.save(self.dir, version, {"model": model, "architecture": architecture, "version": version,
                                                   "step": step, "run_id": run_id}, keep=self.keep)
        data = path.read_bytes()
        record = {**fields, "version": version, "run_id": run_id, "step": step, "checkpoint": str(path.resolve()),
                  "sha256": sha256_hex(data), "bytes": len(data), "sequence": self._next_sequence()}
        return self._signed(record)


class LoadPublishedVersion:
    """``(path, sha256=None) -> (model in eval mode, version)`` for the models trained on ``dataset``."""

    def __init__(self, dataset: str | Path, *, max_bytes: int = DEFAULT_MAX_MODEL_BYTES):
        self.dataset = str(dataset)
        self.max_bytes = int(max_bytes)
        self._data = None

    def __getstate__(self):
        return {"dataset": self.dataset, "max_bytes": self.max_bytes}

    def __setstate__(self, state):
        self.__init__(state["dataset"], max_bytes=state.get("max_bytes", DEFAULT_MAX_MODEL_BYTES))

    @property
    def data(self):
        if self._data is None:
            from flowtrain.train.loader import TabularDataset

            self._data = TabularDataset(self.dataset)
        return self._data

    def __call__(self, path: str, sha256: str | None = None) -> tuple[torch.nn.Module, int]:
        try:
            data = read_regular_file(path, self.max_bytes, what="checkpoint")
        except RejectedUpdate as err:
            raise ValueError(str(err)) from None
        if sha256 is None:  # no digest from a record: the one the trainer wrote beside the file
            side = Path(path).with_suffix(".sha256")
            try:
                sha256 = json.loads(read_regular_file(side, 64 * 1024, what="checksum file"))["sha256"]
            except (RejectedUpdate, ValueError, KeyError, TypeError):
                sha256 = None
            if sha256 is None:
                raise ValueError(f"checkpoint {path} has no readable {side.name}: its integrity cannot be checked")
        if sha256_hex(data) != sha256:
            raise ValueError(f"checkpoint {path} does not match its checksum; it is torn or corrupted")
        if data[8:9] == b"{" and not data.startswith(b"PK"):  # safetensors (a JSON header), not a torch zip
            return self._load_id_snapshot(path, data)
        state = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        if not isinstance(state, dict) or not isinstance(state.get("model"), dict) or "version" not in state:
            raise ValueError(f"checkpoint {path} holds no 'model' and 'version': not a published model version")
        if not isinstance(state.get("architecture"), dict):
            raise ValueError(f"checkpoint {path} holds no 'architecture' (kind, hidden sizes): cannot rebuild its "
                             f"model; publish it with the online trainer (flowtrain stream train)")
        model = Architecture.from_dict(state["architecture"], f"checkpoint {path}").build(self.data)
        model.load_state_dict(state["model"], strict=True)
        model.requires_grad_(False)
        model.eval()
        return model, int(state["version"])

    def _load_id_snapshot(self, path: str, data: bytes) -> tuple[torch.nn.Module, int]:
        try:
            v = decode_id_version(data, self.max_bytes)
        except DeltaError as err:
            raise ValueError(f"checkpoint {path} is neither a torch checkpoint nor an ID version: {err}") from None
        if v.kind != "snapshot" or "architecture" not in v.info:
            raise ValueError(f"checkpoint {path} is an ID {v.kind} without the model's architecture: only a whole "
                             f"version (a snapshot, or the scorer's copy of what it serves) loads alone")
        try:
            arch = json.loads(v.info["architecture"])
        except ValueError:
            raise ValueError(f"checkpoint {path}: its architecture is not JSON") from None
        model = Architecture.from_dict(arch, f"checkpoint {path}").build(self.data)
        load_snapshot(model, v, f"checkpoint {path}")
        model.requires_grad_(False)
        model.eval()
        return model, v.version


__all__ = ["Publisher", "LoadPublishedVersion", "DEFAULT_KEEP_PUBLISHED", "new_run_id"]

"""Published versions of a model with ID tables: the dense parameters and only the ID rows changed.

``IdPublisher(model, snapshot_every)`` finds the model's ID embeddings (``IdEmbedding`` modules,
by their names in the model); ``publish(version)`` returns the payload (``connectors.id_deltas``)
of that version: a full snapshot every ``snapshot_every`` versions (and the first), else a delta of
the rows added or updated and the keys evicted since the previous version. Its cost grows with the
rows touched, not with the table. The stream trainer publishes through it when its model has ID
tables (``flowtrain.train.published.Publisher.publish_ids``). A model whose tables are sharded over the
data-parallel ranks (``ShardedIdEmbedding``: ``stream train --workers N``) publishes the same versions: every rank
calls ``publish`` at the same step (a collective), each rank's changed rows are gathered to rank 0
(``gather_changes``; a snapshot gathers every row) and rank 0 gets the payload, the other ranks None.

``load_snapshot(model, version)`` is the other way: a snapshot's dense parameters and rows into a
model built by the same architecture (what a scorer serves: ``LoadPublishedVersion``).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from connectors.id_deltas import IdVersion, TableChange, encode
from flowtrain.train.ids.embedding import IdEmbedding, ShardedIdEmbedding, gather_changes, packed_state
from flowtrain.train.ids.table import IdTable


def id_tables(model: nn.Module) -> dict[str, IdEmbedding]:
    """The model's ID embeddings by their names in it (none: a model without ID tables)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, IdEmbedding)}


def published_tables(model: nn.Module) -> dict[str, IdEmbedding | ShardedIdEmbedding]:
    """The ID tables a version publishes: whole (``IdEmbedding``) or this rank's shard (``ShardedIdEmbedding``)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, (IdEmbedding, ShardedIdEmbedding))}


def dense_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and persistent buffers: its ``state_dict`` without the ID tables, read without
    touching the tables (a version's cost is not the table's). A non-persistent buffer (a constant the architecture
    makes, e.g. the periodic embeddings' phase) is not state: never published."""
    state = dict(model.named_parameters())
    for prefix, module in model.named_modules():
        for name, buffer in module.named_buffers(prefix=prefix, recurse=False):
            if buffer is not None and name.rsplit(".", 1)[-1] not in module._non_persistent_buffers_set:
                state[name] = buffer
    return state


class IdPublisher:
    def __init__(self, model: nn.Module, snapshot_every: int = 10):
        if snapshot_every < 1:
            raise ValueError(f"--snapshot-every {snapshot_every}: must be at least 1")
        self.model, self.snapshot_every = model, int(snapshot_every)
        self.tables = published_tables(model)
        self.sharded = any(isinstance(m, ShardedIdEmbedding) for m in self.tables.values())
        self.previous: int | None = None
        self.published = 0

    def publish(self, version: int, info: dict[str, str] | None = None) -> tuple[bytes, IdVersion] | None:
        """The payload of ``version`` and what it holds. With sharded tables a collective (every rank calls it
        at the same step, with the same ``version``): rank 0 gets the payload, the other ranks None."""
        snapshot = self.previous is None or self.published % self.snapshot_every == 0
        self.previous, self.published, previous = int(version), self.published + 1, self.previous
        tables = {}
        for name, emb in self.tables.items():  # in the same order on every rank: the modules' order
            if isinstance(emb, ShardedIdEmbedding):
                d = gather_changes(emb, snapshot, dst=0)
                if d is None:  # not rank 0: its rows are on their way there
                    continue
            else:
                d = emb.table.snapshot() if snapshot else emb.table.take_delta()
                if snapshot:
                    emb.table.take_delta()  # the interval starts again at the snapshot
            tables[name] = TableChange(d.keys, d.rows.numpy(), d.evicted)
        if self.sharded and len(tables) < len(self.tables):
            return None
        dense = {k: v.detach().cpu().numpy() for k, v in dense_state(self.model).items()}
        v = IdVersion(int(version), None if snapshot else previous, "snapshot" if snapshot else "delta",
                      dense, tables, dict(info or {}))
        return encode(v), v


def load_snapshot(model: nn.Module, version: IdVersion, what: str = "the ID version") -> nn.Module:
    """``version`` (a snapshot) into ``model``: its dense parameters strictly, and each ID table's rows (keys and
    vectors; no optimizer state: a served table does not train). A ``ValueError`` naming what does not fit."""
    if version.kind != "snapshot":
        raise ValueError(f"{what}: a {version.kind} is applied on top of its base, not loaded alone")
    tables = id_tables(model)
    if set(version.tables) != set(tables):
        raise ValueError(f"{what} holds the ID tables {sorted(version.tables)}, the model {sorted(tables)}")
    want = set(dense_state(model))
    if set(version.dense) != want:
        missing, extra = sorted(want - set(version.dense)), sorted(set(version.dense) - want)
        raise ValueError(f"{what}: dense parameters do not fit the model (missing {missing[:5]}, unexpected "
                         f"{extra[:5]})")
    dense = {k: torch.from_numpy(np.array(a)) for k, a in version.dense.items()}
    model.load_state_dict(dense, strict=False)
    for name, emb in tables.items():
        change = version.tables[name]
        if change.rows.shape[1:] != (emb.dim,):
            raise ValueError(f"{what}: ID table {name!r} has rows of width {change.rows.shape[1:]}, the model "
                             f"{emb.dim}")
        state = packed_state(emb.table.state_dict(), torch.from_numpy(change.keys.copy()),
                             torch.from_numpy(np.array(change.rows, dtype=np.float32)))
        emb.table = IdTable.from_state(state)
    return model

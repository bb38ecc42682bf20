"""Wide and deep with ID tables: ``TabularMLP`` over the numerics and each ID column's embedding.

The input is the dataset's ``(x_num, x_cat)`` where ``x_cat``'s last ``len(id_columns)`` columns are
the ID columns' int64 keys (``flowtrain.train.loader``: after the category codes). Each ID column
gets an ``IdEmbedding`` (``id_dim`` wide, frequency-filtered, expiring, bounded); its vectors join
the numerics as the MLP's input (and the linear part's: a fitted linear model starts the wide part
with zero weight on them). After each optimizer step the training engine calls ``id_step``.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from flowtrain.train.ids.embedding import TABLE, IdEmbedding, ShardedIdEmbedding
from flowtrain.train.ids.table import table_tensors
from flowtrain.train.models.ensemble import FREQUENCY_SCALE, wide_and_deep

DEFAULT_ID_DIM = 16


class IdWideDeep(nn.Module):
    def __init__(self, n_numeric: int, cardinalities: Sequence[int], id_columns: Sequence[str], *,
                 id_dim: int = DEFAULT_ID_DIM, hidden: Sequence[int] = (256, 128), dropout: float = 0.1,
                 outputs: int = 1, table: dict | None = None, ensemble: int = 1, numeric_embedding: int = 0,
                 frequency_scale: float = FREQUENCY_SCALE):
        super().__init__()
        self.n_numeric, self.n_cat, self.outputs = int(n_numeric), len(cardinalities), outputs
        self.id_columns, self.id_dim, self.table_options = list(id_columns), int(id_dim), dict(table or {})
        # ModuleDict names cannot hold dots: the tables are ids.0, ids.1, ... in id_columns' order
        self.ids = nn.ModuleDict({str(i): IdEmbedding(self.id_dim, **self.table_options)
                                  for i in range(len(self.id_columns))})
        # the ID vectors join the numerics; only the numerics themselves get periodic embeddings
        self.mlp = wide_and_deep(self.n_numeric + self.id_dim * len(self.id_columns), cardinalities,
                                 hidden=tuple(hidden), dropout=dropout, outputs=outputs, ensemble=ensemble,
                                 numeric_embedding=numeric_embedding, periodic=self.n_numeric,
                                 frequency_scale=frequency_scale)
        self.ensemble, self.numeric_embedding = int(ensemble), int(numeric_embedding)

    def architecture(self, hidden: Sequence[int], dropout: float) -> dict:
        """What a bundle's model.json says to rebuild this model (``from_architecture``)."""
        arch = {"kind": "mlp_ids", "hidden": list(hidden), "dropout": dropout, "id_columns": self.id_columns,
                "id_dim": self.id_dim, "table": self.table_options}
        if self.ensemble > 1 or self.numeric_embedding:  # the default recipe's (absent: the plain wide and deep)
            arch.update(ensemble=self.ensemble, numeric_embedding=self.numeric_embedding)
        return arch

    def describe(self) -> str:
        """The architecture in words (the report's)."""
        return (f"{self.mlp.describe()}, and dynamic ID tables for {', '.join(self.id_columns)} ({self.id_dim} wide, "
                f"their vectors beside the numerics)")

    def forward(self, x_num: torch.Tensor, x_cat: torch.Tensor) -> torch.Tensor:
        embs = [self.ids[str(i)](x_cat[:, self.n_cat + i]).to(x_num.device) for i in range(len(self.id_columns))]
        return self.mlp(torch.cat([x_num, *embs], dim=1), x_cat[:, : self.n_cat])

    def id_step(self, global_n: int, lr: float) -> None:
        """The ID tables' optimizer step for the rows the last training forward used."""
        for emb in self.ids.values():
            emb.step(global_n, lr)

    # --- sharded over data-parallel ranks (flowtrain.train.trainer's DataParallelEngine) ------------------------
    def shard_ids(self, rank: int, world: int, group=None) -> None:
        """Each ID table becomes this rank's shard of it (``ShardedIdEmbedding``): before the optimizer and
        the reducer are built (the fallback vectors are new parameters, with the same values)."""
        for name, emb in list(self.ids.items()):
            if isinstance(emb, ShardedIdEmbedding):
                continue
            t = emb.table
            sharded = ShardedIdEmbedding(self.id_dim, rank, world, group, max_ids=t.max_ids, min_count=t.min_count,
                                         ttl=t.ttl, optimizer=t.optimizer, betas=t.betas, eps=t.eps,
                                         init_std=t.init_std, seed=t.seed).to(emb.fallback.dtype)  # --dtype
            sharded._load_table(table_tensors(emb.table))  # this rank's keys of the table so far
            with torch.no_grad():
                sharded.fallback.copy_(emb.fallback)
            sharded.train(emb.training)
            self.ids[name] = sharded

    @property
    def sharded(self) -> bool:
        return any(isinstance(e, ShardedIdEmbedding) for e in self.ids.values())

    def full_state_dict(self) -> dict:
        """``state_dict`` with each sharded table whole (a collective when sharded): what a checkpoint holds,
        whatever the number of workers that wrote it or resume it."""
        state = self.state_dict()
        for name, emb in self.ids.items():
            if isinstance(emb, ShardedIdEmbedding):
                prefix = f"ids.{name}.{TABLE}"
                state = {k: v for k, v in state.items() if not k.startswith(prefix)}
                state.update({prefix + k: v for k, v in emb.full_table_tensors().items()})
        return state

    def unshard_ids(self) -> None:
        """Every rank gets each table whole, as an ``IdEmbedding`` (a collective): the fitted model."""
        for name, emb in list(self.ids.items()):
            if isinstance(emb, ShardedIdEmbedding):
                whole = IdEmbedding(self.id_dim).to(emb.fallback.dtype)
                whole._load_table(emb.full_table_tensors())
                with torch.no_grad():
                    whole.fallback.copy_(emb.fallback)
                whole.train(emb.training)
                self.ids[name] = whole

    def init_wide(self, linear_state: dict) -> None:
        """Start the linear part from a fitted ``LinearModel`` over the numerics and categories: zero
        weight on the ID embeddings."""
        state = dict(linear_state)
        w = state.get("numeric.weight")
        extra = self.id_dim * len(self.id_columns)
        if w is not None and extra:
            state["numeric.weight"] = torch.cat([w, torch.zeros(w.shape[0], extra, dtype=w.dtype, device=w.device)],
                                                dim=1)
        elif w is None and extra:  # no numerics: the linear part's numeric layer exists for the embeddings
            state["numeric.weight"] = torch.zeros(self.outputs, extra, device="cpu")  # a state (cpu), also at a
            state["numeric.bias"] = torch.zeros(self.outputs, device="cpu")  # build on the meta device
        self.mlp.init_wide(state)

    def table_stats(self) -> dict:
        return {col: self.ids[str(i)].table.stats.as_dict() | {"rows": len(self.ids[str(i)].table)}
                for i, col in enumerate(self.id_columns)}


def from_architecture(spec, arch: dict) -> IdWideDeep:
    """The model a bundle's ``mlp_ids`` architecture describes (weights and tables loaded after)."""
    return IdWideDeep(spec.n_numeric, spec.cardinalities, arch["id_columns"], id_dim=int(arch["id_dim"]),
                      hidden=tuple(arch["hidden"]), dropout=float(arch.get("dropout", 0.0)),
                      outputs=spec.outputs, table=dict(arch.get("table") or {}),
                      ensemble=int(arch.get("ensemble", 1)), numeric_embedding=int(arch.get("numeric_embedding", 0)))

"""``fit``'s data-parallel engine with ZeRO-sharded state (``--shard-states``): a ``ZeroSharder``
(``flowtrain.parallel.zero.sharder``) behind the engine interface of ``flowtrain.train.trainer.DataParallelEngine``.
"""
from __future__ import annotations

import torch
from torch import nn

from flowtrain.parallel.context import DistContext
from flowtrain.parallel.mapreduce import empty_forward, local_rows, sum_loss
from flowtrain.parallel.zero.sharder import ZeroSharder
from flowtrain.parallel.zero.units import peak_rss_bytes

__all__ = ["ZeroEngine"]


class ZeroEngine:
    """``fit``'s data-parallel engine with sharded state (``--shard-states``; the interface of
    ``flowtrain.train.trainer.DataParallelEngine``): each replica trains its rows of every global
    batch, the reduce is a reduce-scatter, Adam steps each rank's shard."""

    def __init__(self, model: nn.Module, ctx: DistContext, config, loss_fn: nn.Module):
        self.model, self.ctx, self.loss_fn = model, ctx, loss_fn
        self.rng_rank = ctx.rank
        lr, wd = config.lr, getattr(config, "weight_decay", None) or 0.0  # the stream trainer has no --weight-decay
        self.sharder = ZeroSharder(model, ctx, stage=config.shard_states,
                                   make_optimizer=lambda ps: torch.optim.Adam(ps, lr=lr, weight_decay=wd),
                                   bucket_mb=config.bucket_mb)
        self.optimizer = self.sharder.optimizer
        self.measured: dict = {}
        # ZeRO-3: the model lives in the shards; ``fit`` evaluates it layer by layer (each gathered for its forward,
        # then freed), keeps its best weights as this rank's pieces and writes the whole model streamed
        self.holds_shards = config.shard_states == "parameters"
        if self.holds_shards:
            self.sharder.release()

    def set_lr(self, lr: float) -> None:
        self.sharder.set_lr(lr)

    def train_step(self, batch, target: torch.Tensor) -> tuple[int, float]:
        lo, hi = local_rows(len(batch), self.ctx)
        self.sharder.zero_grad()
        loss_sum = None
        if hi > lo:
            loss_sum = sum_loss(self.loss_fn, self.model(batch.x_num[lo:hi], batch.x_cat[lo:hi]), target[lo:hi])
        elif self.sharder.stage == "parameters":  # no rows: still in every gather, a zero gradient
            loss_sum = empty_forward(self.model, batch.x_num[lo:hi], batch.x_cat[lo:hi]).sum() * 0.0
        global_n, mean_loss = self.sharder.backward(loss_sum, hi - lo)
        self.sharder.step()
        self.sharder.sync_buffers(hi - lo)
        self.measured = self.sharder.state_bytes()
        return global_n, mean_loss

    def sync_model(self) -> None:
        self.sharder.gather()

    def optimizer_state(self) -> dict:
        return self.sharder.optimizer_state()

    def stage_states(self) -> list[dict]:
        return [self.model.state_dict()]

    def shard_states(self) -> list:
        return []

    def shard_pieces(self, whole: dict[str, dict] | None = None) -> tuple[dict, dict]:
        """This rank's part of a sharded checkpoint (``ZeroSharder.shard_pieces``)."""
        return self.sharder.shard_pieces(whole)

    def shard_targets(self, saved: dict[str, tuple], pieces_of_best: bool = False) -> tuple[dict, dict]:
        return self.sharder.shard_targets(saved, pieces_of_best)

    def take_shards(self, tensors: dict) -> None:
        self.sharder.take_shards(tensors)
        if self.holds_shards:
            self.sharder.release()

    def load(self, model_state: dict, optimizer_state: dict) -> None:
        if "stages" in optimizer_state:
            raise ValueError("this checkpoint was written by a pipeline-parallel run: resume it with the same --stages")
        self.sharder.gather()
        self.model.load_state_dict(model_state)
        self.sharder.load_parameters()
        self.sharder.load_optimizer_state(optimizer_state)
        if self.holds_shards:
            self.sharder.release()

    # -- a model that lives in the shards (ZeRO-3: ``holds_shards``) ------------------------------------------
    def state_pieces(self) -> dict:
        """The current weights as this rank holds them (``ZeroSharder.state_pieces``): ``fit``'s best weights."""
        return self.sharder.state_pieces()

    def pieces_of(self, whole: dict) -> dict:
        return self.sharder.pieces_of(whole)

    def best_pieces(self, tensors: dict) -> dict:
        return self.sharder.best_pieces(tensors)

    def load_pieces(self, pieces: dict) -> None:
        self.sharder.load_pieces(pieces)

    def load_model_pieces(self, load) -> None:
        """The weights of a sharded checkpoint into this rank's shards, in place: ``load(tensors, chunks)`` reads
        them (``flowtrain.train.checkpoint.load_shards`` on its directory)."""
        tensors, chunks = self.sharder.model_targets()
        load(tensors, chunks)
        self.sharder.take_model(tensors)

    def write_model(self, path, writer: bool) -> None:
        """The whole model's ``state_dict`` into ``path`` by the rank ``writer`` is true on (a collective; no rank
        holds the whole model: ``ZeroSharder.write_whole``)."""
        self.sharder.write_whole(path, writer)

    def memory(self) -> dict:
        """Bytes of state this rank held after its last step, its peak during steps, and peak RSS."""
        return {**self.measured, "peak_state": self.sharder.peak_state_bytes, "peak_rss": peak_rss_bytes()}

    def close(self) -> None:
        self.sharder.close(gather=not self.holds_shards)

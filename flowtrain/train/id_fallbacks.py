"""The online trainer's count of rows trained with an ID's fallback vector (the ID value had no key).

Counted by ``"column: reason"`` (``connectors.id_keys.BAD_KEYS``): the last checkpoint's total
(``base``) plus this replica's rows since (``new``); at each checkpoint and at the end every
replica's are summed (a collective) into the new total, which the checkpoint saves.
"""
from __future__ import annotations

from collections.abc import Sequence

from connectors.id_keys import reason_counts
from flowtrain.parallel import DistContext
from flowtrain.train.loader import Batch
from flowtrain.train.replicas import gather, sum_counts


class IdFallbacks:
    """Rows trained whose ID value had no key, by column and reason."""

    def __init__(self, id_columns: Sequence[str]):
        self.id_columns = id_columns
        self.base: dict[str, int] = {}  # the last checkpoint's total (every replica's)
        self.new: dict[str, int] = {}  # this replica's since

    def restore(self, state: dict) -> None:
        """The total a checkpoint's ``state`` saved."""
        self.base = {str(k): int(v) for k, v in (state.get("id_fallbacks") or {}).items()}

    def count(self, batch: Batch) -> None:
        """This replica's rows trained with an ID value that has no key (the fallback vector), by column and reason:
        the ID columns' keys are the last columns of ``x_cat`` (``flowtrain.train.loader``)."""
        ids = self.id_columns
        if not ids:
            return
        keys = batch.x_cat[:, batch.x_cat.shape[1] - len(ids):].numpy()
        for i, col in enumerate(ids):
            for kind, n in reason_counts(keys[:, i]).items():
                name = f"{col}: {kind}"
                self.new[name] = self.new.get(name, 0) + n

    def commit(self, ctx: DistContext) -> dict[str, int]:
        """The checkpoint's counts plus every replica's since (a collective): the new total, returned."""
        self.base = sum_counts([self.base, *gather(ctx, dict(self.new))])
        self.new = {}
        return self.base

    def local(self) -> dict[str, int]:
        """The last total plus this replica's since (no collective)."""
        return sum_counts([self.base, self.new])

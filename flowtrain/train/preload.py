"""What a training worker imports lazily, imported at once (``import_training``).

A capped training worker (``--worker-memory``) calls it before its cap is calibrated, and the memory plan before it
measures a worker's fixed overhead (``flowtrain.train.memory_plan.worker_overhead_bytes``): under ``RLIMIT_AS``
(``flowtrain.parallel.memcap``) the address space a worker may still map after the calibration is its cap less what
it holds plus a fixed headroom, and a library mapped later spends it. The largest: the optimizer's first
``add_param_group`` imports ``torch._dynamo`` (torch's ``_disable_dynamo``), which loads triton's ``libtriton.so``:
~140 MiB resident and ~245 MiB of address space on this machine, enough alone to put a capped rank over its cap in
its first step.
"""
from __future__ import annotations

import torch
import torch.utils.serialization.config  # noqa: F401 - light; what DCP's FileSystemWriter reads on its first save
from torch import nn

from flowtrain.train.metrics import import_evaluation

__all__ = ["import_training"]


def import_training() -> None:
    """Imports what training imports on first use: the evaluation's libraries (``import_evaluation``), what an
    optimizer loads when it is made and steps (``torch._dynamo``; made here on one throwaway parameter), TensorBoard's
    writer (``flowtrain.observe.board``: every rank of a multi-worker run writes one) and distributed checkpoints
    (``flowtrain.train.checkpoint``'s DCP shards)."""
    import_evaluation()
    weight = nn.Parameter(torch.zeros(1))
    weight.grad = torch.zeros(1)
    torch.optim.Adam([weight]).step()
    from torch.distributed import checkpoint  # noqa: F401
    from torch.utils.tensorboard import SummaryWriter  # noqa: F401

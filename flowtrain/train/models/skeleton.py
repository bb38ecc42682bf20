"""A model's skeleton: built on the meta device with its initializers skipped, for its shapes at no memory (the
bundle's check of its weights against its architecture, ``flowtrain.train.bundle``)."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["skeleton"]


class _NoInit(torch.overrides.TorchFunctionMode):
    """``torch.nn.init``'s initializers leave their tensor as it is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def skeleton(build: Callable[[], nn.Module]) -> nn.Module:
    """What ``build()`` makes, on the meta device and with its initializers skipped: its shapes, with no memory.
    Skipping matters: a meta tensor's random initializer runs torch's reference kernels, whose first call imports
    ``torch._dynamo`` (1.6 s of every ``flowtrain predict`` here, measured)."""
    with torch.device("meta"), _NoInit():
        return build()

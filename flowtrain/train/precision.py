"""``--dtype``: the floating-point type training runs in (``float32``, or ``float64`` as a check mode).

In float32, Adam amplifies summation order: where a gradient sums to ~1e-9 (near-dead units, rare ID rows) it
steps by about ``lr * g / (|g| + eps)``, so the rounding of another reduction order (N workers' all-reduce, a
grid's micro-batches, ID tables' all-to-all) moves a few weights by up to ~1e-4, and the equality of a layout
with one process can only be checked loosely. In float64 the same differences are ~1e-16 relative: N workers,
ZeRO stages, grids and ID tables equal one process to ~1e-12, so their tests check equality tightly.

``use_dtype`` puts a model in the type (its parameters, buffers and ID tables; a deferred model's values are
made in it, ``flowtrain.parallel.deferred``) and casts the floating inputs of its ``forward`` (the loader's
batches are float32); ``cast_batch`` casts a batch for an engine that feeds layers directly (pipeline stages).
Gradients, optimizer state and the reducers' buffers follow the parameters' type.
"""
from __future__ import annotations

import torch
from torch import nn

from flowtrain.parallel.deferred import is_deferred, set_target
from flowtrain.train.loader import Batch

__all__ = ["DTYPES", "cast_batch", "model_dtype", "torch_dtype", "use_dtype"]

DTYPES = {"float32": torch.float32, "float64": torch.float64}
_HOOKED = "_flowtrain_input_dtype"


def torch_dtype(name: str | torch.dtype | None) -> torch.dtype:
    """``--dtype``'s value as a torch dtype (None: float32)."""
    if isinstance(name, torch.dtype):
        return name
    if name is None:
        return torch.float32
    if name not in DTYPES:
        raise ValueError(f"--dtype {name!r}: use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def model_dtype(model: nn.Module) -> torch.dtype:
    """The floating-point type of ``model``'s parameters (a deferred model's: the one its values are made in)."""
    target = getattr(getattr(model, "_flowtrain_deferred", None), "dtype", None)
    if target is not None:
        return target
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _cast_inputs(dtype: torch.dtype):
    def hook(_module, args, kwargs):
        cast = tuple(a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() and a.dtype != dtype else a
                     for a in args)
        return cast, kwargs
    return hook


def use_dtype(model: nn.Module, dtype: torch.dtype | str | None) -> nn.Module:
    """``model`` in ``dtype`` (in place; module doc); float32, the default, changes nothing of a float32 model."""
    dtype = torch_dtype(dtype)
    if is_deferred(model):
        set_target(model, dtype=dtype)
    elif model_dtype(model) != dtype:
        model.to(dtype)
    if dtype != torch.float32 and getattr(model, _HOOKED, None) != dtype:
        model.register_forward_pre_hook(_cast_inputs(dtype), with_kwargs=True)
        object.__setattr__(model, _HOOKED, dtype)
    return model


def cast_batch(batch: Batch, dtype: torch.dtype) -> Batch:
    """``batch`` with its numerics and labels in ``dtype`` (codes and keys stay int64)."""
    if batch.x_num.dtype == dtype and batch.y.dtype == dtype and (batch.w is None or batch.w.dtype == dtype):
        return batch
    return Batch(batch.x_num.to(dtype), batch.x_cat, batch.y.to(dtype), None if batch.w is None else batch.w.to(dtype))

"""An ID table's two hot loops in C (probe.c), where the install built them: the key -> row lookup, and that lookup
fused with the rows' gather at inference. setup.py builds probe.c as an optional extension (no compiler: the install
goes on); this module loads it with ctypes (plain C, no Python API) and ``AVAILABLE`` says whether it did. Without
it, ``KeyIndex`` looks up in numpy and ``IdTable.vectors`` gathers with ``index_select``: the same rows and values,
slower (docs/benchmarks.md, ``flowtrain bench ids``). The callers check what C cannot: contiguous CPU arrays of the
layout's dtypes, every row index within its matrix."""
from __future__ import annotations

import ctypes
import importlib.util

import numpy as np
import torch

__all__ = ["AVAILABLE", "embed", "lookup"]

_P, _N = ctypes.c_void_p, ctypes.c_int64


def _load():
    spec = importlib.util.find_spec(f"{__package__}._probe")
    if spec is None or not spec.has_location:
        return None
    try:
        lib = ctypes.CDLL(spec.origin)
    except OSError:
        return None
    lib.flowtrain_ids_lookup.restype = _N
    lib.flowtrain_ids_lookup.argtypes = [_P, _N, _P, _N, _P, _P]
    lib.flowtrain_ids_embed.restype = _N
    lib.flowtrain_ids_embed.argtypes = [_P, _N, _P, _N, _P, _P, _N, _P, _P, _P]
    return lib


_LIB = _load()
AVAILABLE = _LIB is not None


def lookup(keys: np.ndarray, tables: tuple[int, int, int]) -> tuple[np.ndarray, int]:
    """Each key's row (-1: none) and how many have none. ``keys``: contiguous int64; ``tables``: the addresses of
    ``KeyIndex``'s int32 slots and int64 ``row_key``, and the slot count (``KeyIndex._probe_tables``)."""
    slots, n_slots, row_key = tables
    out = np.empty(len(keys), dtype=np.int64)
    missing = _LIB.flowtrain_ids_lookup(keys.ctypes.data, len(keys), slots, n_slots, row_key, out.ctypes.data)
    return out, missing


def embed(keys: np.ndarray, tables: tuple[int, int, int], weight: torch.Tensor,
          fallback: torch.Tensor) -> tuple[np.ndarray, torch.Tensor, int]:
    """``lookup``'s rows and missing count, and ``weight[rows]`` (``fallback`` where a row is -1): a new
    ``[len(keys), dim]`` tensor. ``weight``: a contiguous CPU matrix with a row for every row of the index;
    ``fallback``: a vector of its dtype."""
    slots, n_slots, row_key = tables
    rows = np.empty(len(keys), dtype=np.int64)
    out = torch.empty(len(keys), weight.shape[1], dtype=weight.dtype)
    if not fallback.is_contiguous():
        fallback = fallback.contiguous()
    missing = _LIB.flowtrain_ids_embed(keys.ctypes.data, len(keys), slots, n_slots, row_key, weight.data_ptr(),
                                       weight.shape[1] * weight.element_size(), fallback.data_ptr(), rows.ctypes.data,
                                       out.data_ptr())
    return rows, out, missing

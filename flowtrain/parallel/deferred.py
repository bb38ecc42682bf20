"""Deferred construction: a model built on the meta device, its parameters made real later, whole or only the
slices a rank owns, with the values one process gives them.

``deferred(build, seed)`` runs ``build()`` on the meta device under a recorder (a ``TorchFunctionMode``): every
torch call that makes a meta tensor (``torch.empty``, ``torch.zeros``, a view, ``x.float()``) or writes one
(``nn.init.kaiming_uniform_``, ``fill_``, ``copy_`` from a loaded state, ``w[0] = 0``) is kept, with its
arguments; initializers on meta tensors are skipped (no memory, no time). Any ``nn.Module`` family builds this
way: its own ``__init__`` and ``reset_parameters`` run unchanged.

A parameter's (or buffer's) initial value is computed when it is needed (``Materializer.value``): the calls
that made and wrote its storage, and those its inputs depend on, replayed in order on the CPU. Each call that
may draw random numbers draws them from its own generator, seeded from the model's seed and the call's place in
the construction (``op_seed``), never from a stream shared with the calls before it. So a parameter's value does
not depend on which others were made before it, or at all: one process materialising the whole model
(``materialize``) and a ZeRO-3 rank materialising one parameter at a time to keep its slice
(``flowtrain.parallel.zero.units.ShardUnit``) get the same numbers, parameter by parameter; a slice equals the
slice of the whole. A rank holds one parameter whole at a time while it takes its slice (the memory plan's
``materialize`` transient).

The recording stays on the module (``DEFERRED_ATTR``) until it is materialised; ``target(module, device, dtype)``
says where and in which floating-point type its values go (``--device``, ``--dtype``).
"""
from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["DEFERRED_ATTR", "Materializer", "Recording", "deferred", "is_deferred", "materialize", "op_seed",
           "recording_of", "set_target"]

DEFERRED_ATTR = "_flowtrain_deferred"
# In-place calls that only write values (on a meta tensor: a no-op, skipped; the replay runs them). nn.init's
# functions are skipped on meta tensors too: a meta tensor's random initializer imports torch._dynamo (1.6 s).
_WRITES = {"__setitem__", "copy_", "fill_", "zero_", "normal_", "uniform_", "bernoulli_", "exponential_",
           "geometric_", "log_normal_", "cauchy_", "random_", "clamp_", "mul_", "div_", "add_", "sub_",
           "masked_fill_", "index_fill_", "index_copy_", "scatter_", "fmod_", "abs_", "neg_", "sqrt_", "exp_"}


def _key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage (views and a ``Parameter`` share their tensor's)."""
    return t.untyped_storage()._cdata


def _is_meta(x) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "meta"


def op_seed(seed: int, index: int) -> int:
    """The seed of the ``index``-th recorded call of a model seeded with ``seed``: a 63-bit hash of both."""
    digest = hashlib.blake2b(f"{int(seed)}:{int(index)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass(frozen=True)
class _Meta:
    """A recorded meta tensor, by its place in its storage (no reference to the tensor: a view kept alive would
    hold its parameter, which ``torch.utils.swap_tensors`` then refuses to swap). A pytree leaf."""
    key: int
    shape: tuple
    stride: tuple
    offset: int
    dtype: torch.dtype


def _describe(x):
    return _Meta(_key(x), tuple(x.shape), tuple(x.stride()), x.storage_offset(), x.dtype) if _is_meta(x) else x


@dataclass
class _Op:
    index: int
    func: Callable
    args: tuple  # meta tensors as _Meta
    kwargs: dict
    outs: list  # the _Meta of each meta tensor it returned, in tree_flatten order (None where a leaf was not one)
    reads: set  # storage keys of its meta tensor arguments
    writes: set  # storage keys it made or wrote


@dataclass
class Recording:
    """What ``deferred`` recorded of a model's construction, and where its values go."""
    seed: int
    ops: list = field(default_factory=list)
    storages: list = field(default_factory=list)  # every recorded storage, alive: its key stays its own
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype | None = None  # None: as built


class _Recorder(torch.overrides.TorchFunctionMode):
    def __init__(self, recording: Recording):
        super().__init__()
        self.recording = recording

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        leaves, _ = tree_flatten((args, kwargs))
        metas = [x for x in leaves if _is_meta(x)]
        init = getattr(func, "__module__", None) == "torch.nn.init"
        target = args[0] if args else kwargs.get("tensor")
        if (init or name in _WRITES) and _is_meta(target):
            out = target if name != "__setitem__" else None  # a no-op on the meta device: recorded, not run
            written = {_key(target)}
        else:
            out = func(*args, **kwargs)
            written = {_key(x) for x in (kwargs.get("out"),) if _is_meta(x)}
            if name.endswith("_") and not name.startswith("_") and _is_meta(target):
                written.add(_key(target))  # another in-place call: it ran (on meta), its writes replay
        outs, _ = tree_flatten(out)
        made = [_describe(x) if _is_meta(x) else None for x in outs]
        written |= {m.key for m in made if m is not None}
        if written:
            rec = self.recording
            rec.storages += [x.untyped_storage() for x in (*metas, *(o for o in outs if _is_meta(o)))]
            args, kwargs = tree_map(_describe, (args, kwargs))
            rec.ops.append(_Op(len(rec.ops), func, args, kwargs, made, {_key(x) for x in metas}, written))
        return out


def deferred(build: Callable[[], nn.Module], seed: int) -> nn.Module:
    """``build()`` on the meta device, recorded (module doc): a module whose parameters and buffers hold no memory
    until ``materialize`` (or a ZeRO-3 sharder) gives them their values."""
    recording = Recording(int(seed))
    with torch.device("meta"), _Recorder(recording), warnings.catch_warnings():
        # a state loaded into the meta parameters (a fitted linear part) is recorded, and replayed: not a no-op
        warnings.filterwarnings("ignore", message=".*copying from a non-meta parameter.*")
        module = build()
    if any(_is_meta(t) for t in (*module.parameters(), *module.buffers())):
        object.__setattr__(module, DEFERRED_ATTR, recording)
    return module


def recording_of(module: nn.Module) -> Recording | None:
    return getattr(module, DEFERRED_ATTR, None)


def is_deferred(module: nn.Module) -> bool:
    """Whether ``module`` still waits for its values (built by ``deferred``, not yet materialised)."""
    return recording_of(module) is not None


def set_target(module: nn.Module, device=None, dtype: torch.dtype | None = None) -> None:
    """Where (``device``) and in which floating-point type (``dtype``) the values of a deferred module go."""
    rec = recording_of(module)
    if device is not None:
        rec.device = torch.device(device)
    if dtype is not None:
        rec.dtype = dtype


class Materializer:
    """Initial values of a deferred module's tensors, one at a time (module doc)."""

    def __init__(self, module: nn.Module):
        self.module, self.recording = module, recording_of(module)
        if self.recording is None:
            raise ValueError("the module was not built by flowtrain.parallel.deferred.deferred")

    @property
    def device(self) -> torch.device:
        return self.recording.device

    def dtype_of(self, t: torch.Tensor) -> torch.dtype:
        want = self.recording.dtype
        return want if want is not None and t.is_floating_point() else t.dtype

    def value(self, t: torch.Tensor, device=None) -> torch.Tensor:
        """The initial value of the meta tensor ``t`` (a parameter, a buffer, any tensor the build made): a new
        contiguous tensor on ``device`` (default: the CPU), in the target dtype."""
        if not _is_meta(t):
            return t.detach().to(device or "cpu", self.dtype_of(t)).clone()
        ops = self._needed(_key(t))
        bases: dict[int, torch.Tensor] = {}

        def resolve(x):
            if not isinstance(x, _Meta):
                return x
            base = bases.get(x.key)
            if base is None or base.dtype != x.dtype:
                raise RuntimeError(f"deferred construction: a meta tensor of shape {x.shape} was used before it was "
                                   f"made (an operation flowtrain's recorder did not see)")
            return base.as_strided(x.shape, x.stride, x.offset)

        with torch.random.fork_rng(devices=[]), torch.no_grad(), torch.device("cpu"):
            for op in ops:
                torch.manual_seed(op_seed(self.recording.seed, op.index))
                args, kwargs = tree_map(resolve, (op.args, op.kwargs))
                name = getattr(op.func, "__name__", "")
                got = op.func(*args, **kwargs)
                if name == "__setitem__" or (name in _WRITES and got is None):
                    continue
                outs, _ = tree_flatten(got)
                for meta, r in zip(op.outs, outs):
                    if meta is not None and isinstance(r, torch.Tensor):
                        bases.setdefault(meta.key, r)  # the storage's maker: its other views are strided on it
            out = resolve(_describe(t)).detach()
        # the replay's own tensor when it is exactly the value (no second copy of a big parameter), else a copy
        owned = out.is_contiguous() and out.storage_offset() == 0 and \
            out.untyped_storage().nbytes() == out.numel() * out.element_size()
        moved = out.to(device or "cpu", self.dtype_of(t))
        return moved if owned or moved is not out else moved.clone()

    def _needed(self, key: int) -> list[_Op]:
        """The recorded calls a storage's value depends on, in order: those that made or wrote it, and,
        transitively, those that made what they read (as it was when they read it)."""
        needed, marked = {key}, []
        for op in reversed(self.recording.ops):
            if op.writes & needed:
                marked.append(op)
                needed |= op.reads
        return marked[::-1]


def materialize(module: nn.Module, device=None, dtype: torch.dtype | None = None) -> nn.Module:
    """Every parameter and buffer of a deferred ``module`` made real, whole, in place (the same ``Parameter``
    objects: ``torch.utils.swap_tensors``), on ``device`` in ``dtype`` (default: its target); returns it. A module
    not deferred is returned as it is."""
    if not is_deferred(module):
        return module
    if device is not None or dtype is not None:
        set_target(module, device, dtype)
    source = Materializer(module)
    replaced: dict[int, nn.Parameter] = {}  # parameters that could not be swapped in place: their new objects
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is None or id(p) in replaced:
                if p is not None:
                    sub._parameters[name] = replaced[id(p)]  # a tied parameter: the same new object
                continue
            if not _is_meta(p):
                continue
            real = nn.Parameter(source.value(p, source.device), requires_grad=p.requires_grad)
            try:
                torch.utils.swap_tensors(p, real)
            except RuntimeError:  # a module holding weak references to its parameters (an RNN's flat weights)
                replaced[id(p)] = sub._parameters[name] = real
        for name, b in list(sub._buffers.items()):
            if b is not None and _is_meta(b):
                sub._buffers[name] = source.value(b, source.device)
        for name, v in list(vars(sub).items()):  # tensors a module keeps beside its parameters and buffers
            if _is_meta(v) and not isinstance(v, nn.Parameter):
                setattr(sub, name, source.value(v, source.device))
    object.__delattr__(module, DEFERRED_ATTR)
    if replaced:
        module._apply(lambda t: t)  # modules that derive state from their parameters (RNNs) take the new ones
    if source.recording.dtype is not None:  # state a module keeps outside its tensors (ID tables) follows too
        module.to(source.recording.dtype)
    return module


def swap_in_placeholder(p: nn.Parameter, device, dtype: torch.dtype) -> tuple[torch.Size, torch.Tensor]:
    """Make the meta parameter ``p`` a real, empty one on ``device`` (the same object), so its ``data`` can become
    a view of a flat buffer; returns its shape and a meta tensor of it (for ``Materializer.value``)."""
    meta = p.detach()
    torch.utils.swap_tensors(p, nn.Parameter(torch.empty(0, dtype=dtype, device=device), requires_grad=p.requires_grad))
    return meta.shape, meta

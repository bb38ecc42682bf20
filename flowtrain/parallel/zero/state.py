"""The checkpoint half of ``flowtrain.parallel.zero.sharder.ZeroSharder`` (a mixin): its state as a plain optimizer's and
model's (gathered: ``optimizer_state``), as this rank's pieces (``shard_pieces`` / ``shard_targets`` /
``take_shards``, the sharded checkpoints' DCP pieces; ``state_pieces`` / ``load_pieces``, the best weights kept
per rank), and the whole model written to a ``torch.save`` file without any rank holding it (``write_whole``:
the file's layout first, then each unit's bytes, gathered one unit at a time).
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode  # loaded with torch: skip_data's tensors without bytes

from connectors.atomic import atomic_file

__all__ = ["ZeroCheckpointing"]


def _piece(value: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Elements ``[a, b)`` of a parameter given whole, or already as those elements (a rank's piece)."""
    flat = value.reshape(-1)
    return flat if flat.numel() == b - a else flat[a:b]


class ZeroCheckpointing:
    """Checkpoints of a ``ZeroSharder`` (module doc); it has ``module``, ``units``, ``optimizer``, ``world``,
    ``rank``, ``group``, ``gather`` and ``release``."""

    def optimizer_state(self) -> dict:
        """The state dict a plain optimizer over ``module.parameters()`` would have (a collective)."""
        order = {id(p): k for k, p in enumerate(self.module.parameters())}
        sd = self.optimizer.state_dict()
        piece_ids = [(u, i, a, b) for u in self.units for (i, a, b, _) in u.pieces]
        state: dict[int, dict] = {}
        keys = sorted({k for s in sd["state"].values() for k, v in s.items()
                       if torch.is_tensor(v) and v.dim() == 1})
        for u in self.units:
            # each per-element state of the unit, as a flat shard, then all-gathered
            for key in keys:
                shard = torch.zeros(u.shard_numel, dtype=u.full.dtype, device=u.full.device)
                for j, (uu, i, a, b) in enumerate(piece_ids):
                    if uu is u and j in sd["state"] and key in sd["state"][j]:
                        lo = u.offsets[i] + a - u.lo
                        shard[lo:lo + (b - a)] = sd["state"][j][key]
                whole = torch.zeros(u.padded, dtype=u.full.dtype, device=u.full.device)
                if self.world > 1:
                    dist.all_gather_single(whole, shard, group=self.group)
                else:
                    whole.copy_(shard)
                for p, view, off, n in zip(u.params, u.views, u.offsets, u.sizes):
                    state.setdefault(order[id(p)], {})[key] = whole[off:off + n].view(view.shape).cpu().clone()
        # scalar state (Adam's step) and which parameters have state at all: from every rank's pieces
        scalars: dict[int, dict] = {}
        for j, (u, i, _, _) in enumerate(piece_ids):
            for k, v in sd["state"].get(j, {}).items():
                if not (torch.is_tensor(v) and v.dim() == 1):
                    scalars.setdefault(order[id(u.params[i])], {})[k] = v
        if self.world > 1:
            everyone: list = [None] * self.world
            dist.all_gather_object(everyone, {k: {n: (v.cpu() if torch.is_tensor(v) else v) for n, v in d.items()}
                                              for k, d in scalars.items()}, group=self.group)
            for other in everyone:
                for k, d in other.items():
                    scalars.setdefault(k, {}).update(d)
        out_state = {k: {**scalars[k], **state[k]} for k in sorted(scalars)}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(range(len(order)))}
                  for g in sd["param_groups"]]
        return {"state": out_state, "param_groups": groups}

    def load_optimizer_state(self, full: dict) -> None:
        """Cut a plain optimizer's state dict (over ``module.parameters()``) into this rank's pieces."""
        order = {id(p): k for k, p in enumerate(self.module.parameters())}
        pieces = [(u, i, a, b) for u in self.units for (i, a, b, _) in u.pieces]
        state = {}
        for j, (u, i, a, b) in enumerate(pieces):
            mine = full["state"].get(order[id(u.params[i])], full["state"].get(str(order[id(u.params[i])])))
            if mine is None:
                continue
            state[j] = {k: (v.reshape(-1)[a:b].clone() if torch.is_tensor(v) and v.dim() > 0 else v)
                        for k, v in mine.items()}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(range(len(pieces)))}
                  for g in full["param_groups"][:1]]
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})

    # -- sharded checkpoints (flowtrain.train.checkpoint.save_shards / load_shards: DCP) -------------------
    def _names(self) -> dict[int, str]:
        return {id(p): n for n, p in self.module.named_parameters() if id(p) in self._where}

    def _own_ranges(self):
        """(parameter name, its elements [a, b) this rank owns, its whole size, the shard's view, the optimizer piece)."""
        names = self._names()
        for u in self.units:
            for i, a, b, piece in u.pieces:
                lo = u.offsets[i] + a - u.lo
                yield names[id(u.params[i])], a, b, u.sizes[i], u.shard[lo:lo + (b - a)], piece

    def shard_pieces(self, whole: dict[str, dict] | None = None) -> tuple[dict, dict]:
        """What this rank writes into a sharded checkpoint: ``model.<name>`` (its shard of each parameter, a
        flat range), ``optim.<name>.<key>`` (its pieces' optimizer state; a scalar such as Adam's step whole),
        and for each ``prefix: state dict`` of ``whole`` (state this rank holds whole, e.g. the best weights)
        ``<prefix>.<name>``: the same ranges of it. Rank 0 adds what is not sharded (buffers, frozen
        parameters) whole. Returns (tensors, chunks: name -> (offset, whole length))."""
        tensors, chunks = {}, {}
        for name, a, b, n, shard, piece in self._own_ranges():
            tensors[f"model.{name}"], chunks[f"model.{name}"] = shard, (a, n)
            for key, v in self.optimizer.state.get(piece, {}).items():
                if torch.is_tensor(v) and v.dim() == 1:
                    tensors[f"optim.{name}.{key}"], chunks[f"optim.{name}.{key}"] = v, (a, n)
                else:  # the same on every rank holding a piece of the parameter: one copy is kept
                    tensors[f"optim.{name}.{key}"] = torch.as_tensor(v)
            for prefix, state in (whole or {}).items():  # whole tensors, or this rank's pieces (``state_pieces``)
                tensors[f"{prefix}.{name}"], chunks[f"{prefix}.{name}"] = _piece(state[name], a, b), (a, n)
        if self.rank == 0:
            sharded = set(self._names().values())
            for prefix, state in (("model", self.module.state_dict()), *(whole or {}).items()):
                tensors.update({f"{prefix}.{k}": v for k, v in state.items() if k not in sharded})
        return tensors, chunks

    def shard_targets(self, saved: dict[str, tuple], pieces_of_best: bool = False) -> tuple[dict, dict]:
        """Where a resume reads this rank's pieces of a sharded checkpoint holding ``saved`` (name -> shape), written
        by any number of ranks: its shard of each parameter (read in place), its pieces' optimizer state, the
        module's other state whole; ``pieces_of_best``: its pieces of the best weights saved with them (``best.``;
        ``best_pieces`` takes them). Returns (tensors, chunks) for ``load_shards``, then ``take_shards``."""
        tensors, chunks = {}, {}
        for name, a, b, n, shard, _ in self._own_ranges():
            tensors[f"model.{name}"], chunks[f"model.{name}"] = shard, (a, n)
            for key in saved:
                if key.startswith(f"optim.{name}.") and "." not in key[len(f"optim.{name}."):]:
                    if len(saved[key]) == 1:
                        tensors[key], chunks[key] = torch.zeros(b - a, dtype=shard.dtype, device=shard.device), (a, n)
                    else:
                        tensors[key] = torch.zeros(saved[key])
            if pieces_of_best and f"best.{name}" in saved:  # the best weights too: this rank's pieces of them
                tensors[f"best.{name}"], chunks[f"best.{name}"] = torch.zeros_like(shard), (a, n)
        sharded = set(self._names().values())
        for k, v in self.module.state_dict().items():
            if k not in sharded:
                tensors[f"model.{k}"] = torch.empty_like(v)
                if pieces_of_best and f"best.{k}" in saved:
                    tensors[f"best.{k}"] = torch.empty_like(v)
        return tensors, chunks

    def take_shards(self, tensors: dict) -> None:
        """After ``load_shards`` filled ``shard_targets``' tensors: the optimizer's pieces take their state, the
        module its other state, and every rank gathers the parameters from the shards read."""
        state, pieces = {}, [t for u in self.units for (_, _, _, t) in u.pieces]
        index = {id(t): j for j, t in enumerate(pieces)}
        for name, _, _, _, _, piece in self._own_ranges():
            mine = {k[len(f"optim.{name}."):]: v for k, v in tensors.items() if k.startswith(f"optim.{name}.")
                    and "." not in k[len(f"optim.{name}."):]}
            if mine:
                state[index[id(piece)]] = mine
        groups = [{**g, "params": list(range(len(pieces)))} for g in self.optimizer.state_dict()["param_groups"][:1]]
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})
        sharded = set(self._names().values())
        others = {k: tensors[f"model.{k}"] for k in self.module.state_dict() if k not in sharded}
        if others:
            self.module.load_state_dict(others, strict=False)
        self.gather()  # the parameters whole again, from the shards just read

    def load_parameters(self) -> None:
        """After the module's parameters were overwritten whole (a resume): take this rank's shards."""
        with torch.no_grad():
            for u in self.units:
                u.shard.copy_(u.full[u.lo:u.lo + u.shard_numel])


    # -- the best weights, per rank (``fit``: a ZeRO-3 rank never holds the whole model) -------------------------
    def state_pieces(self) -> dict:
        """The current model as this rank holds it: its piece of each sharded parameter (name -> a flat copy of
        its owned elements; a parameter it owns none of is left out) and the module's other state whole (buffers,
        frozen parameters)."""
        out = {name: shard.detach().clone() for name, _, _, _, shard, _ in self._own_ranges()}
        sharded = set(self._names().values())
        out.update({k: v.detach().clone() for k, v in self.module.state_dict().items() if k not in sharded})
        return out

    def pieces_of(self, whole: dict) -> dict:
        """``state_pieces``' form of a whole model state dict (a checkpoint read whole)."""
        sharded = set(self._names().values())
        out = {name: whole[name].reshape(-1)[a:b].to(shard.dtype).clone() for name, a, b, _, shard, _ in
               self._own_ranges()}
        out.update({k: v.clone() for k, v in whole.items() if k not in sharded})
        return out

    def best_pieces(self, tensors: dict) -> dict:
        """``state_pieces``' form of the ``best.`` tensors ``shard_targets(..., pieces_of_best=True)`` read."""
        return {k[len("best."):]: v for k, v in tensors.items() if k.startswith("best.")}

    def load_pieces(self, pieces: dict) -> None:
        """Make ``pieces`` (``state_pieces``' form) the current model: each shard takes its pieces, the module its
        other state; units that were whole are gathered again."""
        sharded = set(self._names().values())
        with torch.no_grad():
            for name, _, _, _, shard, _ in self._own_ranges():
                shard.copy_(pieces[name].reshape(-1))
        others = {k: v for k, v in pieces.items() if k not in sharded}
        if others:
            self.module.load_state_dict(others, strict=False)
        for u in self.units:
            if u.gathered:
                u.gather_params(self.group)

    def model_targets(self) -> tuple[dict, dict]:
        """Where the ``model.`` pieces of a sharded checkpoint are read straight into this rank's shards (in place,
        no copy: ``fit``'s best weights read back from their checkpoint) and the module's other state whole."""
        tensors, chunks = {}, {}
        for name, a, _, n, shard, _ in self._own_ranges():
            tensors[f"model.{name}"], chunks[f"model.{name}"] = shard, (a, n)
        sharded = set(self._names().values())
        for k, v in self.module.state_dict().items():
            if k not in sharded:
                tensors[f"model.{k}"] = torch.empty_like(v)
        return tensors, chunks

    def take_model(self, tensors: dict) -> None:
        """After ``load_shards`` filled ``model_targets``: the module takes its other state; units that were whole
        are gathered again from the shards read."""
        sharded = set(self._names().values())
        others = {k[len("model."):]: v for k, v in tensors.items() if k[len("model."):] not in sharded}
        if others:
            self.module.load_state_dict(others, strict=False)
        for u in self.units:
            if u.gathered:
                u.gather_params(self.group)

    # -- the whole model, streamed ----------------------------------------------------------------------------
    def write_whole(self, path: str | Path, writer: bool) -> None:
        """``torch.save`` of the module's whole ``state_dict`` into ``path`` (written whole or not at all), by the
        rank ``writer`` is true on, without any rank holding the whole model (a collective: every rank of the group
        calls it): the file is laid out first with the tensors' bytes left empty (``torch.serialization.skip_data``),
        then each unit is gathered, its parameters' bytes written at their records' offsets, and freed again (ZeRO-3);
        the rest of the state (buffers) comes from the writer's module. ``torch.load(weights_only=True)`` opens it."""
        sharded = {id(p): (u, i) for u in self.units for i, p in enumerate(u.params)}
        entries = []  # (key, where: (unit, index) or the tensor itself, shape, dtype)
        for key, t in self.module.state_dict(keep_vars=True).items():
            where = sharded.get(id(t))
            if where is not None:
                u, i = where
                entries.append((key, where, tuple(u.views[i].shape), u.full.dtype))
            else:
                entries.append((key, t.detach(), tuple(t.shape), t.dtype))
        with (atomic_file(path, "w+b") if writer else _NoFile()) as fh:
            if writer:
                _layout(fh, [(shape, dtype) for _, _, shape, dtype in entries], [key for key, *_ in entries])
                offsets = _record_offsets(fh.name, len(entries))
            for u in self.units:
                was = u.gathered
                u.gather_params(self.group)
                if writer:
                    for k, (_, where, _, _) in enumerate(entries):
                        if isinstance(where, tuple) and where[0] is u:
                            _write_at(fh, offsets[k], u.views[where[1]])
                if not was:
                    u.free_params()
            if writer:
                for k, (_, where, _, _) in enumerate(entries):
                    if not isinstance(where, tuple):
                        _write_at(fh, offsets[k], where)


class _NoFile:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _layout(fh, shapes: list[tuple], keys: list[str]) -> None:
    """A ``torch.save`` file of a dict ``keys`` -> tensors of ``shapes`` (shape, dtype), their bytes left empty."""
    with FakeTensorMode():
        skeleton = {key: torch.empty(shape, dtype=dtype) for key, (shape, dtype) in zip(keys, shapes)}
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(skeleton, fh)
    fh.flush()


def _record_offsets(path: str, n: int) -> list[int]:
    """Where the bytes of storage records ``data/0`` .. ``data/<n-1>`` start (one per tensor, in the dict's order:
    ``torch.save`` numbers storages as it meets them)."""
    reader = torch._C.PyTorchFileReader(path)
    return [reader.get_record_offset(f"data/{k}") for k in range(n)]


def _write_at(fh, offset: int, t: torch.Tensor) -> None:
    """``t``'s bytes at ``offset`` of ``fh``, read in place (a ``numpy()`` view would make a ZeRO unit's storage
    unresizable: it could not be freed again)."""
    data = t.detach().to("cpu").contiguous()
    nbytes = data.numel() * data.element_size()
    fh.seek(offset)
    if nbytes:
        fh.write((ctypes.c_char * nbytes).from_address(data.data_ptr()))

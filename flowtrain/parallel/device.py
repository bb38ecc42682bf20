"""Devices: one ``--device`` (auto, cpu, cuda) for everything a training step touches.

- ``resolve_device`` turns the option into a ``torch.device``: ``auto`` is CUDA when a GPU is
  visible, else the CPU; each local worker takes its own GPU, ``cuda:LOCAL_RANK``, and more local
  workers than GPUs is an error that says how many of each there are.
- ``backend_for``: NCCL for CUDA (with gloo beside it for CPU tensors, e.g. the objects
  ``all_gather_object`` pickles), gloo for the CPU.
- ``to_device`` / ``move_batch``: batches go from pinned host memory with non-blocking copies,
  so the copy overlaps the work already queued on the GPU; on the CPU they are left as they are.
- ``cpu_state``: a ``state_dict`` as CPU tensors, for checkpoints any machine can open with
  ``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import dataclasses
import os

import torch

__all__ = ["DEVICES", "DeviceError", "resolve_device", "backend_for", "to_device", "move_batch", "cpu_state",
           "local_world_size"]

DEVICES = ("auto", "cpu", "cuda")


class DeviceError(ValueError):
    """The requested device cannot be used; the message names the option and the fix."""


def local_world_size() -> int:
    """Workers on this machine (torchrun's / flowtrain's LOCAL_WORLD_SIZE; 1 when not set)."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))


def resolve_device(name: str | None = "auto", *, local_rank: int = 0, local_world: int = 1,
                   cuda_count: int | None = None) -> torch.device:
    """The device of the worker with ``local_rank`` among ``local_world`` workers on this machine.

    ``cuda_count`` defaults to the GPUs torch sees (``CUDA_VISIBLE_DEVICES`` applies).
    """
    name = (name or "auto").lower()
    if name.startswith("cuda:"):
        raise DeviceError(f"--device {name}: give --device cuda; each local worker takes GPU LOCAL_RANK itself "
                          f"(restrict the GPUs with CUDA_VISIBLE_DEVICES)")
    if name not in DEVICES:
        raise DeviceError(f"--device {name!r} is not one of {', '.join(DEVICES)}")
    if name == "cpu":
        return torch.device("cpu")
    count = torch.cuda.device_count() if cuda_count is None else cuda_count
    available = count > 0 and (cuda_count is not None or torch.cuda.is_available())
    if not available:
        if name == "cuda":
            raise DeviceError("--device cuda: no CUDA device is visible to torch (torch.cuda.is_available() is "
                              "False); use --device cpu, or --device auto to take a GPU only when there is one")
        return torch.device("cpu")
    if local_world > count:
        raise DeviceError(f"{local_world} local workers but {count} GPU(s) visible: each local worker takes its "
                          f"own GPU (cuda:LOCAL_RANK). Use at most {count} workers per machine "
                          f"(workers x stages x tensor-parallel), or --device cpu")
    if not 0 <= local_rank < count:
        raise DeviceError(f"LOCAL_RANK {local_rank} has no GPU ({count} visible); check LOCAL_RANK / "
                          f"CUDA_VISIBLE_DEVICES")
    return torch.device("cuda", local_rank)


def backend_for(device: torch.device | str) -> str:
    """The torch.distributed backend for ``device``."""
    return "cpu:gloo,cuda:nccl" if torch.device(device).type == "cuda" else "gloo"


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor`` on ``device``: from pinned memory without blocking when it goes to a GPU."""
    device = torch.device(device)
    if tensor.device == device or (device.type == "cuda" and tensor.device.type == "cuda"
                                   and device.index in (None, tensor.device.index)):
        return tensor
    if device.type == "cuda" and tensor.device.type == "cpu":
        if not tensor.is_pinned():
            tensor = tensor.pin_memory()
        return tensor.to(device, non_blocking=True)
    return tensor.to(device)


def move_batch(batch, device: torch.device | str):
    """A dataclass of tensors (e.g. ``flowtrain.train.loader.Batch``) with every tensor on ``device``."""
    device = torch.device(device)
    if device.type == "cpu" and all(not isinstance(getattr(batch, f.name), torch.Tensor)
                                    or getattr(batch, f.name).device.type == "cpu"
                                    for f in dataclasses.fields(batch)):
        return batch
    changes = {f.name: to_device(getattr(batch, f.name), device) for f in dataclasses.fields(batch)
               if isinstance(getattr(batch, f.name), torch.Tensor)}
    return dataclasses.replace(batch, **changes)


def cpu_state(state: dict) -> dict:
    """A ``state_dict`` (possibly nested, e.g. an optimizer's) with every tensor on the CPU."""
    if isinstance(state, torch.Tensor):
        return state.detach().cpu()
    if isinstance(state, dict):
        return {k: cpu_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [cpu_state(v) for v in state]
    if isinstance(state, tuple):
        return tuple(cpu_state(v) for v in state)
    return state

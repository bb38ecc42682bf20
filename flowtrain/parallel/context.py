"""The process context of a worker: its rank, world, device and process group.

``init_from_env`` joins the process group torchrun's or flowtrain's launcher describes in the
environment. On one machine (``MASTER_ADDR`` a loopback address, as ``flowtrain ... --workers N``
sets it) the rendezvous store listens on 127.0.0.1 only: torch's ``env://`` rendezvous would bind
it to every interface whatever ``MASTER_ADDR`` says, so rank 0 binds the socket itself and hands
it to ``TCPStore``. Across machines (torchrun) the store is torch's own; ``restart_hazard`` names the
one torchrun setting under which a restarted group may not connect.

``gather_json`` exchanges small JSON-able values between ranks as bytes in a tensor: nothing a peer
sends is unpickled.
"""
from __future__ import annotations

import datetime as _dt
import ipaddress
import json
import os
import socket
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flowtrain.parallel.device import backend_for, local_world_size, resolve_device

__all__ = ["DistContext", "init_from_env", "gather_json", "restart_hazard"]


@dataclass(frozen=True)
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str = "none"
    device: str = "cpu"  # where this rank's model, batches and collectives live (``--device``)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _loopback_store(rank: int, world: int, port: int, timeout: _dt.timedelta) -> dist.TCPStore:
    """The rendezvous store on 127.0.0.1:``port``: rank 0 serves it on a socket bound to loopback."""
    if rank != 0:
        return dist.TCPStore("127.0.0.1", port, world, False, timeout=timeout)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(max(128, world))
    except OSError:
        sock.close()
        raise
    # The store owns the listening socket from here on (libuv closes it with the store).
    return dist.TCPStore("127.0.0.1", port, world, True, timeout=timeout, master_listen_fd=sock.detach())


def restart_hazard(env=os.environ) -> str | None:
    """Why a restarted torchrun group may fail to connect, with the fix; None when it cannot happen.

    torchrun (torch >= 2.5, c10d rendezvous) hands its workers the agent's own TCPStore, one server for the
    whole job (``TORCHELASTIC_USE_AGENT_STORE=True``). Keys a round's workers wrote stay there, so after a
    restart a worker can read a dead peer's address from an earlier round and fail with ``Gloo
    connectFullMesh failed ... Connection refused`` (pytorch/pytorch#135712): every such round costs a
    restart, and the budget runs out. With ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in torchrun's
    environment each round's rank 0 serves a fresh store.
    """
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) < 1:
        return None
    return ("torchrun --max-restarts shares its rendezvous store with the workers: a restarted group can read a dead "
            "worker's address from an earlier round and fail to connect until the restarts run out "
            "(pytorch/pytorch#135712); start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment")


def init_from_env(*, timeout_s: float = 60.0, device: str | None = "auto") -> DistContext:
    """Join the process group described by torchrun's / flowtrain's environment variables.

    ``timeout_s`` bounds every collective: a stalled peer makes the others fail within it.
    ``device`` (auto, cpu, cuda) picks this rank's device, ``cuda:LOCAL_RANK`` on a GPU, and the
    backend with it: NCCL for CUDA tensors (gloo beside it for CPU ones), gloo on the CPU.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device, local_rank=local_rank, local_world=local_world_size())
    if world <= 1:
        return DistContext(device=str(dev))
    backend = backend_for(dev)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        hazard = restart_hazard()
        if hazard and os.environ.get("RANK") == "0":
            print(f"flowtrain worker: warning: {hazard}", file=sys.stderr, flush=True)
        timeout = _dt.timedelta(seconds=timeout_s)
        kwargs = {}
        master = os.environ.get("MASTER_ADDR", "")
        if _is_loopback(master) and os.environ.get("MASTER_PORT") and "TORCHELASTIC_RUN_ID" not in os.environ:
            rank = int(os.environ["RANK"])
            kwargs = {"store": _loopback_store(rank, world, int(os.environ["MASTER_PORT"]), timeout),
                      "rank": rank, "world_size": world}
        dist.init_process_group(backend=backend, timeout=timeout, device_id=dev if dev.type == "cuda" else None,
                                **kwargs)
    return DistContext(dist.get_rank(), dist.get_world_size(), local_rank, backend, str(dev))


def _to_wire(value):
    """JSON-able form of ``value``: numpy arrays and scalars, tuples and dicts with non-string keys kept."""
    import numpy as np

    if isinstance(value, np.ndarray):
        return {"ndarray": value.dtype.str, "shape": list(value.shape), "data": value.ravel().tolist()}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {"dict": [[_to_wire(k), _to_wire(v)] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        return {"list": [_to_wire(v) for v in value]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"gather_json cannot send a {type(value).__name__}")


def _from_wire(value):
    import numpy as np

    if isinstance(value, dict):
        if "ndarray" in value:
            return np.asarray(value["data"], dtype=np.dtype(value["ndarray"])).reshape(value["shape"])
        if "dict" in value:
            return {_from_wire(k): _from_wire(v) for k, v in value["dict"]}
        return [_from_wire(v) for v in value["list"]]
    return value


def gather_json(value, group=None) -> list:
    """Every rank's ``value``, in rank order, exchanged as UTF-8 JSON in tensors: a peer's data is
    parsed, never unpickled. ``value`` holds numbers, strings, None, lists, tuples (they come back
    as lists), dicts (any of those as keys) and numpy arrays (dtype and shape kept)."""
    wire = json.dumps(_to_wire(value), separators=(",", ":"), allow_nan=True)
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [_from_wire(json.loads(wire))]
    data = torch.frombuffer(bytearray(wire.encode()), dtype=torch.uint8)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64), group=group)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[:data.numel()] = data
    parts = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return [_from_wire(json.loads(p[:int(n.item())].numpy().tobytes().decode())) for p, n in zip(parts, sizes)]

"""What a DCP checkpoint's files hold, read from its metadata (the sharded-checkpoint tests' shared helper)."""
from __future__ import annotations

from pathlib import Path

import torch.distributed.checkpoint as dcp


def elements_per_file(shards: Path, prefix: str) -> dict[str, int]:
    """Elements of the tensors named ``prefix...`` each file of a DCP checkpoint holds (its metadata)."""
    meta = dcp.FileSystemReader(str(shards)).read_metadata()
    out: dict[str, int] = {}
    for index, info in meta.storage_data.items():
        if index.fqn.startswith(prefix):
            chunk = next(c for c in meta.state_dict_metadata[index.fqn].chunks if c.offsets == index.offset)
            out[info.relative_path] = out.get(info.relative_path, 0) + chunk.sizes.numel()
    return out

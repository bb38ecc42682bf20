"""Checkpoints: temp file, fsync, rename, with a SHA-256 beside it.

A checkpoint is a dict of tensors and plain Python values, so ``torch.load(path,
weights_only=True)`` opens it without running any pickled code. ``latest`` finds the newest
one whose checksum matches: a torn or corrupted file is skipped, never loaded.
``load_latest`` loads the newest checkpoint that verifies *and* loads, falling back to the one
before when the newest is corrupt; ``require_latest`` makes "no loadable checkpoint" an error
that names every file and why (a resume must never silently start over).

Runs: ``save(..., run_id=ID)`` records the run in the checksum file beside the checkpoint. Pruning
(``keep``) only ever deletes checkpoints of that same run, and ``latest`` / ``load_latest`` /
``require_latest`` given a ``run_id`` only consider that run's checkpoints: another run's files in
the same directory are never loaded, resumed from or deleted. A checkpoint is written as
``ckpt-<step>.pt.tmp-<run id>`` first; a failed save removes it, and ``remove_temporaries(directory,
run_id)`` (called when a run starts) removes those a crash of the same run left.

Sharded state (``--shard-states``): every rank writes its own pieces with ``torch.distributed.checkpoint``
(DCP) into ``ckpt-<step>.dcp.tmp-<run id>/`` (``save_shards``, a collective: one ``__<rank>_0.distcp`` file
per rank and DCP's ``.metadata``); rank 0 then renames the directory to ``ckpt-<step>.dcp`` and writes
``ckpt-<step>.pt`` (the rest of the state, small) last, its checksum file recording every shard file's
SHA-256: a ``ckpt-<step>.pt`` that verifies has whole shards beside it. A piece is a flat range of a tensor
(``chunks``: name -> (offset, whole length)), or a flat range of a block of it (``flowtrain.train.pieces.Piece``: a
tensor shard's slice of a parameter, saved in the parameter's whole shape as at most a few boxes of DCP chunks with
their offsets in it); ``load_shards`` reads any ranges of the saved tensors back, whatever ranges or blocks the
ranks that wrote them held and whatever shape they saved them in (DCP's resharding), so a checkpoint written by N
ranks resumes on any number, with or without tensor shards.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from connectors.atomic import atomic_file, file_sha256
from flowtrain.train.pieces import as_piece, placements

_NAME = re.compile(r"^ckpt-(\d{9})\.pt$")
_log = logging.getLogger(__name__)
#: ``run_id`` default of the readers: any run's checkpoints (callers that keep no run id).
ANY_RUN = object()


class CheckpointError(ValueError):
    """No loadable checkpoint where one is required; the message names the files and why."""


class _HashingWriter:
    """A binary file that also hashes what is written to it (the checksum without reading the file back)."""

    def __init__(self, fh):
        self._fh, self._h = fh, hashlib.sha256()

    def write(self, data) -> int:
        self._h.update(data)
        return self._fh.write(data)

    def flush(self) -> None:
        self._fh.flush()

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def _tmp_suffix(run_id: str | None) -> str:
    return f".tmp-{run_id}" if run_id else ".tmp"


def save(directory: str | Path, step: int, state: dict[str, Any], *, keep: int = 3, run_id: str | None = None,
         shards: Path | None = None, keep_steps: tuple[int, ...] = ()) -> Path:
    """Write ``ckpt-<step>.pt`` and its ``.sha256`` (which records ``run_id``) atomically; keep the
    newest ``keep`` checkpoints *of this run* (another run's are never deleted) and those of ``keep_steps`` (the
    best weights of a ZeRO-3 run live in their own checkpoint). ``shards``: the
    directory ``save_shards`` wrote, moved beside it as ``ckpt-<step>.dcp`` first (named in the state
    as ``shards``, every file's checksum in the ``.sha256``)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"ckpt-{step:09d}.pt"
    side = final.with_suffix(".sha256")
    shard_sums = None
    if shards is not None:
        placed = final.with_suffix(SHARDS_SUFFIX)
        if placed.exists():  # this run's own, from before a restart at the same step (the .pt goes first)
            if final.exists() and run_of(final) != run_id:
                raise CheckpointError(f"{placed} belongs to another run's {final.name} (run id {run_of(final)}): "
                                      f"a checkpoint never replaces another run's; use another --out")
            final.unlink(missing_ok=True)
            shutil.rmtree(placed)
        Path(shards).rename(placed)
        shard_sums = {f.name: file_sha256(f) for f in sorted(placed.iterdir())}
        state = {**state, "sharded_state": placed.name}
    # the one atomic writer (tmp beside the target, fsync, rename); a failed save removes its tmp
    with atomic_file(final, tmp_name=final.name + _tmp_suffix(run_id)) as fh:
        hashing = _HashingWriter(fh)
        torch.save(state, hashing)
    with atomic_file(side, tmp_name=side.name + _tmp_suffix(run_id)) as fh:
        record = {"file": final.name, "sha256": hashing.hexdigest(), "step": step, "run_id": run_id}
        fh.write(json.dumps({**record, "shards": shard_sums} if shard_sums is not None else record).encode())
    if keep:
        mine = [p for p in all_checkpoints(directory) if run_of(p) == run_id]
        for old in mine[:-keep]:
            if int(_NAME.match(old.name).group(1)) in keep_steps:
                continue
            old.unlink(missing_ok=True)
            old.with_suffix(".sha256").unlink(missing_ok=True)
            if old.with_suffix(SHARDS_SUFFIX).is_dir():
                shutil.rmtree(old.with_suffix(SHARDS_SUFFIX), ignore_errors=True)
    return final


#: The directory of a checkpoint's sharded state, beside its ``ckpt-<step>.pt``.
SHARDS_SUFFIX = ".dcp"


def save_shards(directory: str | Path, step: int, tensors: dict[str, torch.Tensor], chunks: dict,
                *, run_id: str | None = None, group=None) -> Path:
    """Every rank writes its ``tensors`` (a collective, DCP): a name in ``chunks`` is this rank's piece of a
    flat tensor, ``(offset, whole length)``, or of a block of a tensor (a ``Piece``); any other is whole (one
    rank's copy is kept). Returns the temporary directory that rank 0's ``save(..., shards=...)`` moves into
    place."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    tmp = Path(directory) / f"ckpt-{step:09d}{SHARDS_SUFFIX}{_tmp_suffix(run_id)}"
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(tmp)), planner=_piece_save_planner(chunks),
             process_group=group, no_dist=not dist.is_initialized())
    return tmp


def _saved(path: str | Path) -> dict:
    import torch.distributed.checkpoint as dcp

    try:
        meta = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as err:  # noqa: BLE001 - whatever DCP raises on a missing or unreadable directory
        raise CheckpointError(f"sharded checkpoint {path} cannot be read ({type(err).__name__}: {err}); "
                              f"resume from an earlier checkpoint or start a new run (--overwrite)") from None
    return {name: md for name, md in meta.state_dict_metadata.items() if hasattr(md, "size")}


def shard_names(path: str | Path) -> dict[str, tuple[int, ...]]:
    """The tensors a sharded checkpoint holds: name -> whole shape (its DCP metadata)."""
    return {name: tuple(md.size) for name, md in _saved(path).items()}


def read_whole(path: str | Path, model: torch.nn.Module, parts: tuple[str, ...] = ("model", "optim", "best"), *,
               param_groups: list | None = None, group=None) -> dict:
    """A sharded checkpoint's tensors whole, whichever ranks wrote them (a collective when distributed):
    ``model`` and ``best`` as ``model``'s state dicts, ``optim`` as the state dict of a plain optimizer over
    ``model.parameters()`` (``param_groups``: its groups' options, as saved)."""
    saved = _saved(path)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    tensors = {}
    for part in ("model", "best"):
        if part in parts:
            for key in shapes:
                md = saved.get(f"{part}.{key}")
                tensors[f"{part}.{key}"] = torch.empty(tuple(md.size) if md is not None else (shapes[key].numel(),),
                                                       dtype=md.properties.dtype if md is not None else torch.float32)
    if "optim" in parts:
        tensors.update({name: torch.empty(tuple(md.size), dtype=md.properties.dtype) for name, md in saved.items()
                        if name.startswith("optim.")})
    load_shards(path, tensors, {}, group=group)
    out: dict = {part: {k: tensors[f"{part}.{k}"].reshape(shape) for k, shape in shapes.items()}
                 for part in ("model", "best") if part in parts}
    if "optim" in parts:
        params = list(model.named_parameters())
        state = {}
        for index, (name, p) in enumerate(params):
            mine = {k[len(f"optim.{name}."):]: v for k, v in tensors.items()
                    if k.startswith(f"optim.{name}.") and "." not in k[len(f"optim.{name}."):]}
            if mine:
                state[index] = {k: v.reshape(p.shape) if v.dim() == 1 else v for k, v in mine.items()}
        out["optimizer"] = {"state": state, "param_groups": [{**g, "params": list(range(len(params)))}
                                                             for g in (param_groups or [{}])[:1]]}
    return out


def load_shards(path: str | Path, tensors: dict[str, torch.Tensor], chunks: dict, *, group=None) -> None:
    """Fill ``tensors`` (a collective): a name in ``chunks`` with that piece (a range of the flat tensor, or a
    ``Piece`` of a block of it), any other with the whole saved tensor, whichever ranks wrote which pieces and in
    whichever shape (flat, or the parameter's). A name the checkpoint does not hold, or a size that differs, is a
    ``CheckpointError`` naming the directory."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    saved = shard_names(path)
    for name, t in tensors.items():
        want = as_piece(chunks[name]).whole if name in chunks else tuple(t.shape)
        fits = name in saved and (math.prod(saved[name]) == math.prod(want) if name in chunks else saved[name] == want)
        if not fits:
            found = f"holds it with shape {list(saved[name])}" if name in saved else "does not hold it"
            raise CheckpointError(f"sharded checkpoint {path} cannot be resharded into this model: it {found}, the "
                                  f"model's {name} has shape {list(want)} (another architecture); resume with the "
                                  f"run's own model options, or start a new run (--overwrite)")
    dcp.load(tensors, storage_reader=dcp.FileSystemReader(str(path)), planner=_piece_load_planner(chunks),
             process_group=group, no_dist=not dist.is_initialized())


def load_sharded(engine, model: torch.nn.Module, path: Path, state: dict) -> dict | None:
    """Model and optimizer state from checkpoint ``path`` (its ``state``) whose state was saved sharded
    (``--shard-states``: each rank its pieces), into ``engine``'s layout (a collective): a ZeRO engine
    (``shard_targets``; on a grid: ZeRO over the replicas of its stages and tensor shards) reads its own pieces,
    whichever ranks wrote them; data parallelism, and a grid without ZeRO when a grid wrote them, read them whole;
    a grid without ZeRO cannot take those a data-parallel run wrote (one line naming the file and the fix).
    Returns the best weights saved with it, whole (None: none were)."""
    shards = path.with_suffix(SHARDS_SUFFIX)
    layout = state.get("layout", {})
    # a grid reads them through its ZeRO sharder, or whole when a grid wrote them (its stage cut)
    if hasattr(engine, "grid") and not hasattr(engine, "shard_targets") and not state.get("stage_bounds"):
        raise CheckpointError(
            f"{path} holds ZeRO-sharded state (--workers {layout.get('workers', '?')} --shard-states "
            f"{layout.get('shard_states', '?')}), which reshards across data-parallel workers (and the replicas of "
            f"pipeline stages and tensor shards), not into unsharded stages or tensor shards: resume it without "
            f"--stages / --tensor-parallel (any --workers and --shard-states), or with --workers 2 or more and "
            f"--shard-states, or start a new run with --overwrite")
    saved = shard_names(shards)
    best = ("best",) if any(name.startswith("best.") for name in saved) else ()
    if hasattr(engine, "shard_targets"):
        # a sharder reads flat ranges of flat tensors; a grid with tensor shards saved them in their own shapes
        flat = {k: (math.prod(v),) if len(v) > 1 else v for k, v in saved.items()}
        pieces = bool(best) and getattr(engine, "holds_shards", False)  # ZeRO-3: its pieces of the best weights too
        tensors, chunks = engine.shard_targets(flat, pieces_of_best=True) if pieces else engine.shard_targets(flat)
        load_shards(shards, tensors, chunks)
        engine.take_shards(tensors)
        if pieces:
            return engine.best_pieces(tensors)
        return read_whole(shards, model, best)["best"] if best else None
    whole = read_whole(shards, model, ("model", "optim", *best), param_groups=state.get("optimizer_groups"))
    engine.load(whole["model"], whole["optimizer"])
    return whole.get("best")


def shards_of(directory: str | Path, step: int) -> Path:
    """The sharded state of checkpoint ``step`` in ``directory`` (``ckpt-<step>.dcp``)."""
    return Path(directory) / f"ckpt-{step:09d}{SHARDS_SUFFIX}"


def _piece_save_planner(chunks: dict):
    """DCP's default save planner, but a name in ``chunks`` is written as its piece's boxes at their offsets of the
    whole tensor (a rank's ZeRO shard of a parameter is a flat range, of a tensor shard's slice on a grid: not one
    of DTensor's even chunks)."""
    from torch.distributed.checkpoint import DefaultSavePlanner, SavePlan, WriteItem
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItemType

    class PieceSavePlanner(DefaultSavePlanner):
        def __init__(self):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self.views: dict[tuple, torch.Tensor] = {}

        def create_local_plan(self) -> SavePlan:
            items = []
            for name, t in self.state_dict.items():
                properties = TensorProperties.create_from_tensor(t)
                if name not in chunks:
                    at = torch.Size([0] * t.dim())
                    items.append(WriteItem(index=MetadataIndex(name, at), type=WriteItemType.TENSOR, tensor_data=(
                        TensorWriteData(chunk=ChunkStorageMetadata(offsets=at, sizes=t.size()), properties=properties,
                                        size=t.size()))))
                    continue
                piece, flat = as_piece(chunks[name]), t.reshape(-1)
                for offsets, sizes, at in placements(piece, t.numel(), piece.whole):
                    self.views[(name, tuple(offsets))] = flat[at:at + math.prod(sizes)].view(sizes)
                    items.append(WriteItem(
                        index=MetadataIndex(name, torch.Size(offsets)), type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=torch.Size(offsets),
                                                                               sizes=torch.Size(sizes)),
                                                    properties=properties, size=torch.Size(piece.whole))))
            self.plan = SavePlan(items)
            return self.plan

        def lookup_object(self, index):
            key = (index.fqn, tuple(index.offset))
            return self.views[key] if key in self.views else self.state_dict[index.fqn]

    return PieceSavePlanner()


def _piece_load_planner(chunks: dict):
    """DCP's default load planner, reading a name in ``chunks`` into its piece: the boxes of the saved tensor (in
    whichever shape it was saved) its elements lie in."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, LoadPlan
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class PieceLoadPlanner(DefaultLoadPlanner):
        def __init__(self):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self.views: dict[str, list[torch.Tensor]] = {}

        def create_local_plan(self) -> LoadPlan:
            requests = []
            for name, t in self.state_dict.items():
                saved = self.metadata.state_dict_metadata[name]
                if name in chunks:
                    if not t.is_contiguous():  # its boxes are views of it: a copy would be filled instead
                        raise ValueError(f"load_shards fills {name} in place: pass a contiguous tensor")
                    flat = t.view(-1)
                    boxes = placements(chunks[name], t.numel(), tuple(saved.size))
                    self.views[name] = [flat[at:at + math.prod(sizes)].view(sizes) for _, sizes, at in boxes]
                    wanted = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s, _ in boxes]
                else:
                    self.views[name] = [t]
                    wanted = [ChunkStorageMetadata(offsets=torch.Size([0] * t.dim()), sizes=t.size())]
                requests += create_read_items_for_chunk_list(name, saved, wanted)
            return LoadPlan(requests)

        def lookup_tensor(self, index):
            return self.views[index.fqn][index.index or 0]

    return PieceLoadPlanner()


def run_of(path: str | Path) -> str | None:
    """The run id recorded beside checkpoint ``path`` (None: none recorded, or no readable checksum file)."""
    try:
        return json.loads(Path(path).with_suffix(".sha256").read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def remove_temporaries(directory: str | Path, run_id: str | None) -> list[Path]:
    """Delete the ``ckpt-*.pt.tmp-<run_id>`` (and checksum) files a crash of run ``run_id`` left."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    suffix = _tmp_suffix(run_id)
    gone = [p for p in directory.iterdir() if p.name.startswith("ckpt-") and p.name.endswith(suffix)
            and any(p.name.endswith(kind + suffix) for kind in (".pt", ".sha256", SHARDS_SUFFIX))]
    for p in gone:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)  # the shards a crash left half written
        else:
            p.unlink(missing_ok=True)
    return gone


def _mine(directory: str | Path, run_id) -> list[Path]:
    files = all_checkpoints(directory)
    return files if run_id is ANY_RUN else [p for p in files if run_of(p) == run_id]


def all_checkpoints(directory: str | Path) -> list[Path]:
    directory = Path(directory)
    if not directory.exists():
        return []
    return sorted(p for p in directory.iterdir() if _NAME.match(p.name))


def verify(path: Path) -> bool:
    """The checkpoint matches its checksum, and so does every shard file its checksum file lists."""
    side = path.with_suffix(".sha256")
    try:
        record = json.loads(side.read_text())
        shards = path.with_suffix(SHARDS_SUFFIX)
        return record["sha256"] == file_sha256(path) and all(
            file_sha256(shards / name) == digest for name, digest in (record.get("shards") or {}).items())
    except (OSError, ValueError, KeyError, AttributeError):
        return False


def latest(directory: str | Path, *, run_id=ANY_RUN) -> Path | None:
    """The newest checkpoint (of run ``run_id``, when given) whose checksum matches, or None."""
    for path in reversed(_mine(directory, run_id)):
        if verify(path):
            return path
    return None


def load(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not verify(path):
        raise ValueError(f"checkpoint {path} does not match its checksum ({path.with_suffix('.sha256').name}); "
                         f"it is torn or corrupted")
    return torch.load(path, weights_only=True, map_location="cpu")


def _problem(path: Path) -> str | None:
    side = path.with_suffix(".sha256")
    if not side.exists():
        return f"has no {side.name} (an interrupted save)"
    if not verify(path):
        shards = f" (or a file of its {path.with_suffix(SHARDS_SUFFIX).name})" \
            if path.with_suffix(SHARDS_SUFFIX).exists() else ""
        return f"does not match its checksum{shards} in {side.name} (torn or corrupted)"
    return None


def load_latest(directory: str | Path, *, run_id=ANY_RUN) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint (of run ``run_id``, when given) that verifies and loads, with its state;
    None when there is none. A corrupt newer one is skipped (logged with the reason) in favour of the
    one before."""
    skipped = []
    for path in reversed(_mine(directory, run_id)):
        reason = _problem(path)
        if reason is None:
            try:
                state = torch.load(path, weights_only=True, map_location="cpu")
            except Exception as err:  # noqa: BLE001 - any unloadable file falls back to the previous one
                reason = f"cannot be loaded ({type(err).__name__}: {err})"
            else:
                for bad, why in skipped:
                    _log.warning("checkpoint %s skipped: it %s; using %s", bad.name, why, path.name)
                return path, state
        skipped.append((path, reason))
    return None


def require_latest(directory: str | Path, *, run_id=ANY_RUN) -> tuple[Path, dict[str, Any]]:
    """``load_latest``, but no loadable checkpoint is a ``CheckpointError`` naming each file and why;
    with ``run_id``, checkpoints of another run are named as such and never loaded."""
    found = load_latest(directory, run_id=run_id)
    if found is not None:
        return found
    files = _mine(directory, run_id)
    if not files:
        others = all_checkpoints(directory)
        if others:
            owners = sorted({str(run_of(p)) for p in others})
            raise CheckpointError(f"{directory} holds {len(others)} checkpoint(s) ({others[-1].name}, ...) of "
                                  f"another run (run id {', '.join(owners)}), none of this run ({run_id}); "
                                  f"a resume never continues another run's state")
        raise CheckpointError(f"{directory} holds no checkpoint (ckpt-<step>.pt)")
    reasons = "; ".join(f"{p.name} {_problem(p) or 'cannot be loaded'}" for p in reversed(files))
    raise CheckpointError(f"none of the {len(files)} checkpoint(s) in {directory} can be loaded: {reasons}")

"""The D x S x T engine of ``fit``: pipeline stages and tensor shards of the model, with replicas.

``fit`` uses it when ``--stages`` or ``--tensor-parallel`` is above 1 (``DataParallelEngine``
otherwise). Every rank holds tensor shard t of stage s of the model for replica d
(``flowtrain.parallel.grid``); one code path for every shape of the grid:

1. rank 0 cuts the ``nn.Sequential`` into S stages by measured cost and broadcasts the cut;
2. each stage is split by its tensor plan (``flowtrain.parallel.tensor.plan``: column/row pairs,
   vocabulary-parallel tables; T = 1 leaves it whole);
3. a ``StageWorker`` runs the schedule (1F1B or GPipe; with one stage, one micro-batch), its
   tensor shards all-reduce inside the layers, activations cross stages on the pipeline's
   groups, and the replicas of a (stage, shard) reduce gradient sums and counts on their
   data-parallel group;
4. every rank steps its own parameters with the same optimizer.

The device holds this rank's shard only; the whole model, which ``sync_model`` fills, lives in
host memory.

With ``--shard-states`` and replicas, each (stage, shard)'s state is ZeRO-sharded over its replicas
(``flowtrain.parallel.zero.sharder.shard_stage_worker``), and the checkpoints are saved sharded (``shard_pieces``): each
rank writes the flat ranges of its parameters it owns, under the whole model's names (a stage keeps them); with
tensor shards each range of a shard's slice is written at its offsets in the whole parameter
(``flowtrain.train.pieces.Piece``), so a checkpoint resumes with any replicas, tensor shards or none.

The random state is seeded per replica and stage, never per shard (``rng_rank``), so the shards
of a tensor group draw the same dropout masks. ``sync_model`` gathers the shards and stages
into the whole model on every rank (for evaluation and checkpoints).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from flowtrain.parallel import DistContext
from flowtrain.parallel.device import cpu_state
from flowtrain.parallel.grid import Grid, build_groups
from flowtrain.parallel.pipeline import StageWorker, replica_rows
from flowtrain.parallel.schedules import SCHEDULES
from flowtrain.parallel.stages import merge_stage_states, plan_stages, plan_with_bounds, stage_module
from flowtrain.parallel.tensor.plan import TensorGroup, plan_tensor_parallel, shard_module
from flowtrain.parallel.zero.sharder import shard_stage_worker
from flowtrain.parallel.zero.units import peak_rss_bytes, storage_bytes
from flowtrain.train.models import pack
from flowtrain.train.pieces import Piece

__all__ = ["GridEngine"]


class GridEngine:
    """Each rank trains its tensor shard of its pipeline stage of the model, for its replica."""

    def __init__(self, model: nn.Sequential, ctx: DistContext, config, loss_fn: nn.Module, sample: torch.Tensor,
                 *, device: torch.device | str = "cpu"):
        self.ctx, self.model, self.device = ctx, model, torch.device(device)
        stages, tensor = int(config.stages), int(config.tensor_parallel)
        self.grid = Grid.from_world(ctx.world_size, stages=stages, tensor=tensor)
        self.groups = build_groups(self.grid, ctx.rank)
        pos = self.pos = self.groups.pos
        sample = sample.cpu()
        on_cpu = model if all(p.device.type == "cpu" for p in model.parameters()) else _cpu_copy(model)
        if stages > 1:  # rank 0 measures the layers and decides the cut (a resumed run: its own); every rank uses it
            given = [tuple(b) for b in config.stage_bounds] if config.stage_bounds else None
            plan = plan_stages(on_cpu, stages, sample) if ctx.is_main and not given else None
            shared = [plan.bounds if plan else given]
            dist.broadcast_object_list(shared, src=0)
            self.plan = plan if plan is not None else plan_with_bounds(on_cpu, shared[0], sample)
        else:
            self.plan = plan_with_bounds(on_cpu, [(0, len(model))], sample)
        del on_cpu
        self.tensor_plans = [plan_tensor_parallel(stage_module(model, self.plan, s), tensor) for s in range(stages)]
        self.tg = TensorGroup(self.groups.tensor, pos.tensor, tensor)
        self.module = shard_module(stage_module(model, self.plan, pos.stage), self.tensor_plans[pos.stage],
                                   self.tg).to(self.device)
        # The device holds this rank's shard of its stage; the whole model (evaluation, checkpoints)
        # stays in host memory, or stages and shards would save no device memory.
        model.to("cpu")
        if ctx.is_main:
            print(self.describe(), flush=True)
        microbatches = int(config.microbatches) if stages > 1 else 1
        in_shape = self.plan.out_shapes[pos.stage - 1] if pos.stage else tuple(sample.shape[1:])
        self.worker = StageWorker(self.module, pos, self.groups.data, SCHEDULES[config.schedule](stages, microbatches),
                                  microbatches, in_shape, loss_fn, bucket_mb=config.bucket_mb,
                                  p2p_groups=(self.groups.forward, self.groups.backward), device=self.device)
        lr, wd = config.lr, getattr(config, "weight_decay", None) or 0.0  # the stream trainer has no --weight-decay
        # --shard-states optimizer | gradients | parameters: ZeRO-1/2/3 over this stage's (and shard's) replicas
        self.sharder = shard_stage_worker(self.worker, ctx, stage=getattr(config, "shard_states", "none"),
                                          make_optimizer=lambda ps: torch.optim.Adam(ps, lr=lr, weight_decay=wd),
                                          bucket_mb=config.bucket_mb)
        self.optimizer = self.sharder.optimizer if self.sharder is not None else \
            torch.optim.Adam(self.module.parameters(), lr=lr, weight_decay=wd)
        self.rng_rank = pos.replica * stages + pos.stage  # shards of a tensor group draw alike
        self._states: list[dict] | None = None
        self._shards: list[list[dict]] | None = None
        if self.sharder is not None:
            # ZeRO on the grid saves its checkpoints sharded as data parallelism's ZeRO does (the interface ``fit``
            # and the stream trainer look for): a stage keeps the model's parameter names, so each rank writes flat
            # ranges of whole parameters (a tensor shard: of its slices, placed in the whole), which a resume with
            # any --workers reads
            self.shard_pieces, self.shard_targets, self.take_shards = \
                self._shard_pieces, self._shard_targets, self._take_shards

    def describe(self) -> str:
        """The grid (which rank does what), the stage plan and each stage's tensor plan."""
        roles = {}
        for rank in range(self.grid.world_size):
            p = self.grid.position(rank)
            a, b = self.plan.bounds[p.stage]
            roles[rank] = f"layers {a}-{b - 1}" + (f", shard {p.tensor + 1}/{self.grid.tensor}" if self.grid.tensor > 1
                                                   else "")
        parts = [f"grid: {self.grid.describe()}", self.grid.table(roles)]
        if self.grid.stages > 1:
            parts.append(self.plan.table(self.model))
        if self.grid.tensor > 1:
            for s, tp in enumerate(self.tensor_plans):
                parts.append((f"stage {s}: " if self.grid.stages > 1 else "") + tp.table())
        return "\n".join(parts)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def train_step(self, batch, target: torch.Tensor) -> tuple[int, float]:
        pos = self.pos
        lo, hi = replica_rows(len(batch), pos)
        x = pack(batch.x_num[lo:hi], batch.x_cat[lo:hi]) if pos.is_first else None
        if self.sharder is not None:
            self.sharder.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)
        stats = self.worker.step(x, target[lo:hi] if pos.is_last else None, hi - lo)
        if self.sharder is not None:
            self.sharder.step()  # the shard's Adam step, then the parameters all-gathered
        else:
            self.optimizer.step()
        counts = pos.is_last and pos.tensor == 0  # each replica's loss once, not once per shard
        totals = torch.tensor([stats.loss_sum, float(hi - lo)] if counts else [0.0, 0.0], dtype=torch.float64,
                              device=self.device)
        dist.all_reduce(totals)  # the loss reaches rank 0 (and everyone)
        n, loss_sum = int(totals[1]), float(totals[0])
        return n, loss_sum / n if n else 0.0

    # -- whole-model views ---------------------------------------------------------------------------
    def _gather(self, obj) -> list:
        out = [None] * self.ctx.world_size
        dist.all_gather_object(out, obj)
        return out

    def sync_model(self) -> None:
        """Bring every stage's and shard's current weights into this rank's whole model."""
        if self.sharder is not None:
            self.sharder.gather()  # ZeRO-3: this rank holds only its shard of each layer until it gathers them
        everyone = self._gather(cpu_state(self.module.state_dict()))
        if self.sharder is not None:
            self.sharder.release()  # ZeRO-3: freed again (the next forward gathers each layer)
        g = self.grid
        self._shards = [[everyone[g.rank_of(0, s, t)] for t in range(g.tensor)] for s in range(g.stages)]
        self._states = [self.tensor_plans[s].merge(self._shards[s]) for s in range(g.stages)]
        self.model.load_state_dict(merge_stage_states(self._states))

    def stage_states(self) -> list[dict]:
        """Each stage's unsharded ``state_dict`` (as of the last ``sync_model``)."""
        return self._states

    def shard_states(self) -> list[list[dict]]:
        """[stage][tensor shard] -> that shard's ``state_dict`` (as of the last ``sync_model``);
        empty without tensor parallelism (the stage states are the shards then)."""
        return self._shards if self.grid.tensor > 1 else []

    def optimizer_state(self) -> dict:
        """Every stage's (and shard's) optimizer state, from replica 0; a collective."""
        mine = self.sharder.optimizer_state() if self.sharder is not None else self.optimizer.state_dict()
        everyone = self._gather(cpu_state(mine))
        g = self.grid
        if g.tensor == 1:
            stages = [everyone[g.rank_of(0, s, 0)] for s in range(g.stages)]
        else:
            stages = [{"tensor_shards": [everyone[g.rank_of(0, s, t)] for t in range(g.tensor)]}
                      for s in range(g.stages)]
        return {"stages": stages, "grid": {"stages": g.stages, "tensor_parallel": g.tensor}}

    def load(self, model_state: dict, optimizer_state: dict) -> None:
        """Resume: the whole model's state (cut into this rank's stage and shard) and this
        rank's optimizer state; the checkpoint must come from the same --stages and
        --tensor-parallel."""
        g = self.grid
        stages = optimizer_state.get("stages")
        written = optimizer_state.get("grid", {"stages": len(stages) if stages else 1, "tensor_parallel": 1})
        if stages is None and "state" in optimizer_state:
            # a plain optimizer's state over the whole model (a sharded checkpoint read whole): this shard's part
            mine = self._stage_optimizer_state(optimizer_state)
        elif stages is None or written["stages"] != g.stages or written["tensor_parallel"] != g.tensor:
            raise ValueError(f"this checkpoint was written with --stages {written['stages']} --tensor-parallel "
                             f"{written['tensor_parallel']}: resume it with the same options")
        else:
            mine = stages[self.pos.stage]
            mine = mine["tensor_shards"][self.pos.tensor] if g.tensor > 1 else mine
        self.model.load_state_dict(model_state)
        stage_keys = set(stage_module(self.model, self.plan, self.pos.stage).state_dict())
        stage_state = {k: v for k, v in model_state.items() if k in stage_keys}
        shard = self.tensor_plans[self.pos.stage].shard_state(stage_state, self.pos.tensor)
        if self.sharder is not None:
            self.sharder.gather()  # ZeRO-3: the layers whole to be overwritten, then this rank takes its shards
        self.module.load_state_dict(shard)
        if self.sharder is not None:  # the whole stage's state, cut into this replica's pieces
            self.sharder.load_parameters()
            self.sharder.load_optimizer_state(mine)
        else:
            self.optimizer.load_state_dict(mine)

    def _stage_optimizer_state(self, whole: dict) -> dict:
        """This stage's (and tensor shard's) part of a plain optimizer state dict over ``self.model.parameters()``
        (by name: a stage keeps the model's parameter names; a shard's slices cut as its parameters are), as one
        over its own parameters."""
        index = {name: k for k, (name, _) in enumerate(self.model.named_parameters())}
        names = [name for name, _ in self.module.named_parameters()]
        sliced = self.tensor_plans[self.pos.stage].sharded_params() if self.grid.tensor > 1 else {}
        state = {}
        for j, name in enumerate(names):
            mine = whole["state"].get(index[name], whole["state"].get(str(index[name])))
            if mine is not None and name in sliced:
                dim, ranges = sliced[name]
                lo, hi = ranges[self.pos.tensor]
                mine = {k: v.narrow(dim, lo, hi - lo).clone() if torch.is_tensor(v) and v.dim() > dim else v
                        for k, v in mine.items()}
            if mine is not None:
                state[j] = mine
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(range(len(names)))}
                  for g in whole["param_groups"][:1]]
        return {"state": state, "param_groups": groups}

    # -- sharded checkpoints (ZeRO on the grid's replicas: bound in __init__) -------------------------------
    def _shard_pieces(self, whole: dict[str, dict] | None = None) -> tuple[dict, dict]:
        """This rank's part of a sharded checkpoint (``ZeroSharder.shard_pieces``); of ``whole`` (whole-model
        state such as the best weights) this stage's keys only, cut to this tensor shard's slices: the other
        stages and shards write theirs."""
        keys = set(self.module.state_dict())
        plan, tensor = self.tensor_plans[self.pos.stage], self.grid.tensor > 1
        mine = {}
        for prefix, state in (whole or {}).items():
            stage = {k: v for k, v in state.items() if k in keys}
            mine[prefix] = plan.shard_state(stage, self.pos.tensor) if tensor else stage
        tensors, chunks = self.sharder.shard_pieces(mine)
        return self._in_whole(tensors, chunks, writing=True) if tensor else (tensors, chunks)

    def _shard_targets(self, saved: dict[str, tuple]) -> tuple[dict, dict]:
        tensors, chunks = self.sharder.shard_targets(saved)
        return self._in_whole(tensors, chunks, writing=False) if self.grid.tensor > 1 else (tensors, chunks)

    def _in_whole(self, tensors: dict, chunks: dict, *, writing: bool) -> tuple[dict, dict]:
        """The sharder's flat ranges of this tensor shard's parameters as pieces of the whole parameters
        (``flowtrain.train.pieces.Piece``: a slice sits at its offset in the whole tensor, a replicated parameter is
        the whole).
        ``writing``: a shard other than the first leaves out what every shard holds alike (replicated parameters,
        their optimizer state, buffers), which the first writes."""
        sliced = self.tensor_plans[self.pos.stage].sharded_params()
        shapes = {k: tuple(v.shape) for k, v in self.model.state_dict().items()}
        out_tensors, out_chunks = {}, {}
        for key, value in tensors.items():
            part, name = key.split(".", 1)
            name = name.rsplit(".", 1)[0] if part == "optim" else name  # optim.<parameter>.<state key>
            if writing and self.pos.tensor > 0 and name not in sliced:
                continue
            out_tensors[key] = value
            if key in chunks:
                whole, (start, _) = shapes[name], chunks[key]
                corner, block = (0,) * len(whole), whole
                if name in sliced:
                    dim, ranges = sliced[name]
                    lo, hi = ranges[self.pos.tensor]
                    corner = tuple(lo if i == dim else 0 for i in range(len(whole)))
                    block = tuple(hi - lo if i == dim else n for i, n in enumerate(whole))
                out_chunks[key] = Piece(start, whole, corner, block)
        return out_tensors, out_chunks

    def _take_shards(self, tensors: dict) -> None:
        """This stage's pieces taken (``ZeroSharder.take_shards``), then the whole model filled (a collective)."""
        self.sharder.take_shards(tensors)
        self.sharder.release()
        self.sync_model()

    def memory(self) -> dict:
        """Bytes of state this rank holds now (distinct tensor storages) and its peak RSS."""
        if self.sharder is not None:
            return {**self.sharder.state_bytes(), "peak_rss": peak_rss_bytes()}
        params = list(self.module.parameters())
        state = [v for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        buffers = [b.buffer for b in getattr(self.worker.reducer, "buckets", [])]
        out = {"parameters": storage_bytes(params), "gradients": storage_bytes([p.grad for p in params]),
               "optimizer": storage_bytes(state), "buffers": storage_bytes(buffers)}
        return {**out, "total": sum(out.values()), "peak_rss": peak_rss_bytes()}

    def close(self) -> None:
        """Wait for outstanding sends, then destroy this engine's process groups."""
        try:
            self.worker.close()
            if dist.is_initialized():
                dist.barrier()  # no group goes while a peer may still read from it
        finally:
            self.groups.close()


def _cpu_copy(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(model).cpu()

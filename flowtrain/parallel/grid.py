"""The D x S x T grid of workers: data-parallel replicas x pipeline stages x tensor shards.

One description, plain data, printable and testable in one process::

    >>> print(Grid(data=2, stages=2, tensor=2).table())          # doctest: +SKIP
    | rank | replica | stage | tensor shard | tensor group | data-parallel group | pipeline |
    |---|---|---|---|---|---|---|
    | 0 | 0 | 0 | 0 | 0,1 | 0,4 | 0,2 |
    ...

Ranks are numbered tensor shard fastest, then stage, then replica:
``rank = (replica * S + stage) * T + shard`` (with T = 1 this is the 2-D grid's
``replica * S + stage``). The shards of one stage of one replica are neighbours, so on GPUs a
tensor group (the chattiest: two all-reduces per layer pair) lands on one machine.

Process groups, one per:
- **tensor group** (same replica and stage): the tensor-parallel all-reduces;
- **data-parallel group** (same stage and shard, every replica): the map/reduce gradient
  reduce. Tensor-sharded parameters are reduced here only; replicated parameters inside a
  tensor group get identical gradients on every shard (same rows, same random numbers);
- **pipeline** (same replica and shard, every stage): activations and gradients between
  neighbouring stages. Each pipeline gets two groups, one per direction (activations forward,
  gradients backward), so a forward send and a backward send between the same two stages never
  queue behind each other (NCCL runs one stream per communicator and peer).

``torch.distributed.new_group`` must be called by every rank, for every group, in the same order:
``build_groups`` does exactly that. ``ProcessGroups.close`` destroys the groups it made.
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Grid", "GridPosition", "ProcessGroups", "build_groups", "GridError"]


class GridError(ValueError):
    """The workers cannot form the requested grid; the message names the options to change."""


@dataclass(frozen=True)
class GridPosition:
    """One rank's coordinates: stage of S, replica of D, tensor shard of T."""

    stage: int
    stages: int
    replica: int
    replicas: int
    tensor: int = 0
    tensors: int = 1

    def rank_of(self, stage: int, replica: int | None = None, tensor: int | None = None) -> int:
        replica = self.replica if replica is None else replica
        tensor = self.tensor if tensor is None else tensor
        return (replica * self.stages + stage) * self.tensors + tensor

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1


@dataclass(frozen=True)
class Grid:
    """D replicas x S stages x T tensor shards on D*S*T ranks."""

    data: int = 1
    stages: int = 1
    tensor: int = 1

    def __post_init__(self):
        for name, value in (("--workers", self.data), ("--stages", self.stages), ("--tensor-parallel", self.tensor)):
            if int(value) < 1:
                raise GridError(f"{name} must be at least 1 (got {value})")

    @classmethod
    def from_world(cls, world_size: int, *, stages: int = 1, tensor: int = 1) -> Grid:
        """The grid of ``world_size`` ranks with S stages and T shards (D = world / (S*T))."""
        per_replica = stages * tensor
        if stages < 1 or tensor < 1 or world_size % per_replica:
            raise GridError(f"{world_size} workers cannot form a grid of --stages {stages} x --tensor-parallel "
                            f"{tensor}: the number of workers must be a multiple of {per_replica} "
                            f"(D replicas x S stages x T shards)")
        return cls(world_size // per_replica, stages, tensor)

    @property
    def world_size(self) -> int:
        return self.data * self.stages * self.tensor

    def rank_of(self, replica: int, stage: int, tensor: int) -> int:
        return (replica * self.stages + stage) * self.tensor + tensor

    def position(self, rank: int) -> GridPosition:
        if not 0 <= rank < self.world_size:
            raise GridError(f"rank {rank} is outside a grid of {self.world_size} workers")
        tensor = rank % self.tensor
        stage = (rank // self.tensor) % self.stages
        replica = rank // (self.tensor * self.stages)
        return GridPosition(stage, self.stages, replica, self.data, tensor, self.tensor)

    # -- the groups, as lists of ranks, in the one order every rank creates them ------------------
    def tensor_groups(self) -> list[list[int]]:
        return [[self.rank_of(r, s, t) for t in range(self.tensor)]
                for r in range(self.data) for s in range(self.stages)]

    def data_groups(self) -> list[list[int]]:
        return [[self.rank_of(r, s, t) for r in range(self.data)]
                for s in range(self.stages) for t in range(self.tensor)]

    def pipeline_groups(self) -> list[list[int]]:
        return [[self.rank_of(r, s, t) for s in range(self.stages)]
                for r in range(self.data) for t in range(self.tensor)]

    def describe(self) -> str:
        return (f"{self.data} replica(s) x {self.stages} stage(s) x {self.tensor} tensor shard(s) = "
                f"{self.world_size} workers")

    def table(self, roles: dict[int, str] | None = None) -> str:
        """Which rank does what; ``roles`` adds a column (e.g. each stage's layers)."""
        head = "| rank | replica | stage | tensor shard | tensor group | data-parallel group | pipeline |"
        rule = "|---|---|---|---|---|---|---|"
        if roles:
            head, rule = head + " role |", rule + "---|"
        rows = [head, rule]
        for rank in range(self.world_size):
            p = self.position(rank)

            def ranks(group: list[int]) -> str:
                return ",".join(map(str, group)) if len(group) > 1 else "-"

            tg = [self.rank_of(p.replica, p.stage, t) for t in range(self.tensor)]
            dg = [self.rank_of(r, p.stage, p.tensor) for r in range(self.data)]
            pg = [self.rank_of(p.replica, s, p.tensor) for s in range(self.stages)]
            row = f"| {rank} | {p.replica} | {p.stage} | {p.tensor} | {ranks(tg)} | {ranks(dg)} | {ranks(pg)} |"
            if roles:
                row += f" {roles.get(rank, '')} |"
            rows.append(row)
        return "\n".join(rows)


@dataclass
class ProcessGroups:
    """This rank's position and the groups it belongs to (None where the group has one member:
    nothing to communicate)."""

    grid: Grid
    pos: GridPosition
    tensor: object = None
    data: object = None
    forward: object = None  # pipeline: activations to the next stage
    backward: object = None  # pipeline: gradients to the previous stage
    created: list = field(default_factory=list)

    def close(self) -> None:
        """Destroy the groups this rank is a member of (before the process exits)."""
        import torch.distributed as dist

        if dist.is_initialized():
            for group in self.created:
                try:
                    dist.destroy_process_group(group)
                except (ValueError, RuntimeError):
                    pass  # already gone with the default group
        self.created = []
        self.tensor = self.data = self.forward = self.backward = None


def build_groups(grid: Grid, rank: int, *, backend: str | None = None) -> ProcessGroups:
    """Create every group of ``grid`` (a collective: every rank calls it, same order) and
    return this rank's. Single-member groups are not created."""
    import torch.distributed as dist

    if grid.world_size != dist.get_world_size():
        raise GridError(f"the grid ({grid.describe()}) does not match the {dist.get_world_size()} workers "
                        f"that started")
    pos = grid.position(rank)
    out = ProcessGroups(grid, pos)

    def make(lists: list[list[int]]):
        mine = None
        for ranks in lists:
            if len(ranks) < 2:
                continue
            group = dist.new_group(ranks, backend=backend)
            if rank in ranks:
                mine = group
                out.created.append(group)
        return mine

    out.tensor = make(grid.tensor_groups())
    out.data = make(grid.data_groups())
    out.forward = make(grid.pipeline_groups())
    out.backward = make(grid.pipeline_groups())
    return out

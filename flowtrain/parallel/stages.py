"""Cutting an ``nn.Sequential`` into S contiguous stages of balanced cost.

The cost of a layer is its measured forward + backward time on a sample batch (parameter count
when no sample is given). The cut minimizes the most expensive stage (the linear partition
problem, solved exactly by dynamic programming), because the slowest stage sets the pipeline's
pace. Slices of an ``nn.Sequential`` keep the original child names, so each stage's
``state_dict`` keys are the unsplit model's keys and stage checkpoints merge by union.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["StagePlan", "layer_costs", "partition", "plan_stages", "plan_with_bounds", "stage_module",
           "merge_stage_states"]


@dataclass
class StagePlan:
    bounds: list[tuple[int, int]]  # layer index ranges [start, end) per stage
    layer_costs: list[float]
    cost_unit: str  # "ms" (measured) or "params"
    params: list[int]  # parameters per stage
    out_shapes: list[tuple[int, ...]]  # per-example output shape of each stage ([] if unknown)

    @property
    def stages(self) -> int:
        return len(self.bounds)

    def stage_costs(self) -> list[float]:
        return [sum(self.layer_costs[a:b]) for a, b in self.bounds]

    def table(self, model: nn.Sequential | None = None) -> str:
        rows = ["| stage | layers | parameters | cost |", "|---|---|---|---|"]
        for s, ((a, b), params, cost) in enumerate(zip(self.bounds, self.params, self.stage_costs())):
            names = f"{a}-{b - 1}" if b - a > 1 else f"{a}"
            if model is not None:
                kinds = ", ".join(type(layer).__name__ for layer in list(model)[a:b])
                names = f"{names} ({kinds})"
            unit = f"{cost:.3f} ms" if self.cost_unit == "ms" else f"{cost:,.0f} params"
            rows.append(f"| {s} | {names} | {params:,} | {unit} |")
        return "\n".join(rows)


def layer_costs(model: nn.Sequential, sample: torch.Tensor, *, repeats: int = 5) -> list[float]:
    """Forward + backward milliseconds of each layer on ``sample`` (median of ``repeats``)."""
    costs = []
    x = sample
    for layer in list(model):
        inp = x.detach()
        if inp.is_floating_point():
            inp.requires_grad_(True)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = layer(inp)
            if out.requires_grad:
                out.float().sum().backward()
            times.append((time.perf_counter() - t0) * 1000)
        layer.zero_grad(set_to_none=True)
        costs.append(sorted(times)[len(times) // 2])
        with torch.no_grad():
            x = layer(x)
    return costs


def partition(costs: list[float], stages: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges, one per stage, minimizing the largest stage cost."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot cut {n} layers into {stages} stages: need 1 <= stages <= {n}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: smallest max-cost cutting the first i layers into k stages; cut[k][i]: last cut
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i] - 1e-12:
                    best[k][i], cut[k][i] = value, j
    bounds, i = [], n
    for k in range(stages, 0, -1):
        j = cut[k][i]
        bounds.append((j, i))
        i = j
    return bounds[::-1]


def plan_stages(model: nn.Sequential, stages: int, sample: torch.Tensor | None = None, *,
                measure: bool = True) -> StagePlan:
    """Balance by measured time on ``sample`` (or by parameters without one, or with
    ``measure=False``: timings differ between processes, so workers that each plan for
    themselves must cut by parameters, or receive the plan). ``sample`` also gives the
    per-example shapes that cross each stage boundary."""
    params = [sum(p.numel() for p in layer.parameters()) for layer in list(model)]
    if sample is not None and measure:
        costs, unit = layer_costs(model, sample), "ms"
    else:
        costs, unit = [float(p) for p in params], "params"
    bounds = partition(costs, stages) if stages > 1 else [(0, len(costs))]
    return plan_with_bounds(model, bounds, sample, costs=costs, cost_unit=unit)


def plan_with_bounds(model: nn.Sequential, bounds: list[tuple[int, int]], sample: torch.Tensor | None = None, *,
                     costs: list[float] | None = None, cost_unit: str = "params") -> StagePlan:
    """A plan for a given cut (e.g. the one rank 0 measured and broadcast)."""
    layers = list(model)
    params = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    out_shapes: list[tuple[int, ...]] = []
    if sample is not None:
        with torch.no_grad():
            x = sample
            for a, b in bounds:
                for i in range(a, b):
                    x = layers[i](x)
                out_shapes.append(tuple(x.shape[1:]))
    return StagePlan([tuple(b) for b in bounds], costs if costs is not None else [float(p) for p in params],
                     cost_unit, [sum(params[a:b]) for a, b in bounds], out_shapes)


def stage_module(model: nn.Sequential, plan: StagePlan, stage: int) -> nn.Sequential:
    """The stage's layers as a plain ``nn.Sequential`` that keeps the model's child names."""
    a, b = plan.bounds[stage]
    return nn.Sequential(OrderedDict(list(model._modules.items())[a:b]))


def merge_stage_states(states: list[dict]) -> dict:
    """One ``state_dict`` for the unsplit model from the stages' (their keys do not overlap)."""
    merged: dict = {}
    for s, state in enumerate(states):
        clash = set(merged) & set(state)
        if clash:
            raise ValueError(f"stage {s} repeats keys of an earlier stage: {sorted(clash)[:5]}")
        merged.update(state)
    return merged

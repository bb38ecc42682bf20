"""Parallel training: each worker's process context (``context``: rank, device, process group on
127.0.0.1 for local runs), data parallelism as map/reduce (``mapreduce``), pipeline parallelism as a
staged operator graph (``schedules`` plain data, ``stages`` planning, ``pipeline`` executor),
tensor parallelism inside layers (``tensor``: column/row pairs, vocabulary-parallel tables, the
shard plan), the D x S x T grid of workers and its process groups (``grid``), devices
(``device``), and the processes that run them (``launch`` spawns, ``worker`` is the one entry
point).

The map/reduce names stay importable from ``flowtrain.parallel`` as before.
"""
from flowtrain.parallel.context import DistContext, gather_json, init_from_env
from flowtrain.parallel.mapreduce import GradientReducer, LocalReducer, local_rows, make_reducer, shard_bounds, sum_loss

__all__ = ["DistContext", "GradientReducer", "LocalReducer", "gather_json", "init_from_env", "local_rows",
           "make_reducer", "shard_bounds", "sum_loss"]

"""A bundle's ID tables checked before anything is allocated (``flowtrain.train.bundle.build_module``).

An ID table's size is its own, not the architecture's: model.json says how it starts (its ``table`` options and
``id_dim``), and its state in weights.safetensors (``<module>.table.<part>``, ``flowtrain.train.ids``) says how
big it is (``config``: capacity, dim, ...). Loading allocates ``capacity x dim`` rows (twice with Adam's
moments) and arrays of ``capacity`` beside them, so a forged bundle saying capacity 1e9 (64 GB) or dim 1e8
asked for memory the file never held. Here, before any table is built:

* model.json's ``table`` options are IdTable's own, each a number in its range, and the table they start with
  (``capacity`` rows of ``id_dim``) is at most ``MAX_START_ELEMENTS``;
* each table's ``config`` is finite whole numbers where a table keeps them, its ``dim`` is model.json's
  ``id_dim`` and its rows' width, and its ``capacity`` is the rows it holds plus the free rows it lists (so the
  file itself holds a number for every row loading allocates), at most ``MAX_TABLE_ELEMENTS`` elements;
* every part has the shape the table's state gives it (``rows``, ``keys``, ``last_seen``, ``row_step``: one per
  row; ``weight`` and Adam's ``exp_avg`` ``[rows, dim]``; ``pending`` ``[n, 2]``; ...).

A table that fails is a ``BundleError`` naming the bundle's file, the table and the field.
"""
from __future__ import annotations

import inspect
import math
from pathlib import Path

from flowtrain.errors import BundleError
from flowtrain.train.ids import IdTable

__all__ = ["CONFIG_FIELDS", "MAX_START_ELEMENTS", "MAX_TABLE_ELEMENTS", "check_id_tables", "check_table_options"]

#: The order of a table state's ``config`` tensor (``flowtrain.train.ids.table.table_tensors`` writes it).
CONFIG_FIELDS = ("dim", "min_count", "ttl", "max_ids", "optimizer", "beta1", "beta2", "eps", "init_std", "seed",
                 "capacity", "clock", "next_prune")
#: The most elements (rows x dim) of a table as model.json starts it, and of a table's loaded state.
MAX_START_ELEMENTS = 1 << 26
MAX_TABLE_ELEMENTS = 1 << 31
_WHOLE = ("dim", "min_count", "ttl", "max_ids", "optimizer", "seed", "capacity", "clock", "next_prune")
_TABLE = ".table."


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _option_ok(name: str, value) -> bool:
    if name in ("ttl", "max_ids") and value is None:
        return True
    if name == "optimizer":
        return value in ("adam", "sgd")
    if name == "betas":
        return isinstance(value, list) and len(value) == 2 and all(_number(b) and 0 <= b < 1 for b in value)
    if not _number(value) or value < 0:
        return False
    return name not in ("min_count", "ttl", "max_ids", "capacity", "seed") or (
        float(value).is_integer() and (name == "seed" or value >= 1))


def check_table_options(where: Path, options, id_dim: int) -> None:
    """model.json's ``table`` options (``where``): IdTable's parameters, each in its range, starting at most
    ``MAX_START_ELEMENTS`` elements; a ``BundleError`` naming the option otherwise."""
    if not isinstance(options, dict):
        raise BundleError(f"{where}: the mlp_ids model's 'table' is not an object of ID table options; export the "
                          f"bundle again")
    known = set(inspect.signature(IdTable.__init__).parameters) - {"self", "dim", "dtype", "shards"}
    for name, value in options.items():
        if name not in known or not _option_ok(name, value):
            raise BundleError(f"{where}: the ID table option {name!r} is {value!r}: "
                              f"{'not an option of an ID table' if name not in known else 'out of its range'}; "
                              f"export the bundle again")
    start = min(int(options.get("capacity", 1024)), int(options.get("max_ids") or options.get("capacity", 1024)))
    if start * id_dim > MAX_START_ELEMENTS:
        raise BundleError(f"{where}: ID tables that start with {start:,} rows of id_dim {id_dim:,} ({start * id_dim:,} "
                          f"elements, more than {MAX_START_ELEMENTS:,}); export the bundle again")


def _config(weights: Path, key: str) -> dict:
    from safetensors import safe_open

    with safe_open(str(weights), framework="pt") as fh:
        values = fh.get_tensor(key).tolist()
    return dict(zip(CONFIG_FIELDS, values))


def check_id_tables(weights: Path, shapes: dict[str, tuple[int, ...]], id_dim: int | None) -> None:
    """Every ID table in ``weights`` (``shapes``: its tensors' shapes, from the header) against its own tensors
    and model.json's ``id_dim`` (None: not an ``mlp_ids`` model), before anything is allocated; reads only each
    table's ``config`` (13 numbers). A ``BundleError`` naming the table and the field."""
    for prefix in sorted({k[: k.index(_TABLE) + len(_TABLE)] for k in shapes if _TABLE in k}):
        _check_table(weights, prefix, {k[len(prefix):]: v for k, v in shapes.items() if k.startswith(prefix)}, id_dim)


def _check_table(weights: Path, prefix: str, parts: dict[str, tuple[int, ...]], id_dim: int | None) -> None:
    """One table (``prefix``: ``<module>.table.``; ``parts``: its tensors' shapes by part): see the module doc."""
    table = prefix[: -len(_TABLE)]

    def bad(field: str, what: str) -> BundleError:
        return BundleError(f"{weights}: ID table {table}: {field} {what}; export the bundle again")

    missing = [p for p in ("config", "weight", "rows", "keys", "free") if p not in parts]
    if missing:
        raise bad(f"'{missing[0]}'", "is missing")
    if parts["config"] != (len(CONFIG_FIELDS),):
        raise bad("'config'", f"has shape {list(parts['config'])}, not [{len(CONFIG_FIELDS)}]")
    c = _config(weights, prefix + "config")
    for name, value in c.items():
        if not math.isfinite(value) or (name in _WHOLE and not float(value).is_integer()):
            raise bad(f"config {name!r}", f"is {value!r}, not a {'whole ' if name in _WHOLE else ''}number")
    dim, capacity = int(c["dim"]), int(c["capacity"])
    weight = parts["weight"]
    n = weight[0] if len(weight) == 2 else -1
    if len(weight) != 2 or weight[1] != dim or dim < 1:
        raise bad("config 'dim'", f"{dim:,} does not fit its weight {list(weight)}")
    if id_dim is not None and dim != id_dim:
        raise bad("config 'dim'", f"{dim:,} is not model.json's id_dim {id_dim!r}")
    free = parts["free"]
    if len(free) != 1 or capacity != max(1, n + free[0]):  # a packed state of no row keeps one
        raise bad("config 'capacity'", f"{capacity:,} is not its {n:,} rows and {free[0] if free else '?'} "
                                       f"free rows")
    if capacity * dim > MAX_TABLE_ELEMENTS:
        raise bad("config 'capacity'", f"{capacity:,} x dim {dim:,} is more than {MAX_TABLE_ELEMENTS:,} elements")
    if int(c["optimizer"]) not in (0, 1) or not (int(c["max_ids"]) == -1 or int(c["max_ids"]) >= 1):
        raise bad("config", f"optimizer {c['optimizer']} / max_ids {c['max_ids']} out of range")
    adam = int(c["optimizer"]) == 0
    want = {"rows": [(n,)], "keys": [(n,)], "last_seen": [(n,)], "row_step": [(n,)],
            "exp_avg": [(n, dim)] if adam else [(0, dim)],
            "exp_avg_sq": [(n, 1), (n,), (n, dim)] if adam else [(0, dim)]}
    for part, shapes_ok in want.items():
        if part in parts and parts[part] not in shapes_ok:
            raise bad(f"'{part}'", f"has shape {list(parts[part])}, not {list(shapes_ok[0])}")
    pending = parts.get("pending", (0, 2))
    if len(pending) != 2 or pending[1] != 2 or parts.get("pending_keys", (pending[0],)) != (pending[0],):
        raise bad("'pending'", f"has shape {list(pending)}, not [n, 2] beside its pending_keys")
    for part in ("dirty", "evicted", "stats"):
        if part in parts and len(parts[part]) != 1:
            raise bad(f"'{part}'", f"has shape {list(parts[part])}, not a list")

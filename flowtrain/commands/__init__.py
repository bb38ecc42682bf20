"""Sub-commands of ``flowtrain`` beyond ``kafka``; each module has ``register(subparsers)``."""
from __future__ import annotations

import importlib

_MODULES = ("batch", "bench", "stream")


def registrars():
    found = []
    for name in _MODULES:
        try:
            module = importlib.import_module(f"flowtrain.commands.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"flowtrain.commands.{name}":
                raise
            continue
        found.append(module.register)
    return found

"""The ``flowtrain`` command line: one module per command, imported only when that command runs."""
from flowtrain.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
